"""Every ```python block of README.md and docs/*.md runs with the suite, as written.

A page is one session: its blocks run in order in one namespace (a block may use what an
earlier block on its page defined), in a real IPython kernel started in a fresh temporary
directory (the runs/ and exports/ a page writes stay there). The kernel runs `%` magics as a
notebook would. A block that starts with `>>>` is a doctest: its output must match what the page
shows (`...` stands for what changes from run to run, as in nitro's docstrings). A failing block
is reported by its page and line, and the traceback points into the page itself.

A block that cannot run here (it needs a GPU, or a second machine) is preceded by a comment that
says why, and is only checked to parse:

    <!-- not run: needs two hosts -->
    ```python
    ...
    ```

Output, shell commands and other languages take their own fence (```text, ```sh, ```json). A
```sh block whose every command is `nitro ...` (the command line, docs/command-line.md) runs
too, in its page's kernel's directory after the blocks before it: each command as the shell
runs it, `nitro` being `python -m nitro.cli`, and each must exit 0. A not-run comment may
precede it as it precedes a ```python block.
"""

from __future__ import annotations

import ast
import dataclasses
import re
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest
from notebook_kernel import REPO, Kernel

markdown_it = pytest.importorskip("markdown_it")

PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
NOT_RUN = re.compile(r"<!--\s*not run:(?P<why>.*?)-->\s*", re.S)
ANSI = re.compile(r"\x1b\[[0-9;]*m")

# Defined in each page's kernel: runs one block in the kernel's namespace, compiled with the page
# as its file name and padded to its line, so tracebacks (and inspect.getsource) read the page.
RUNNER = """
def _nitro_docs_block(source, path, line):
    import doctest
    if source.lstrip().startswith(">>>"):
        parser = doctest.DocTestParser()
        test = parser.get_doctest(source, globals(), path, path, line - 1)
        runner = doctest.DocTestRunner(
            optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE
        )
        report = []
        runner.run(test, out=report.append, clear_globs=False)
        if runner.failures:
            raise AssertionError("".join(report))
        return
    code = get_ipython().transform_cell(source)
    exec(compile("\\n" * (line - 1) + code, path, "exec"), globals())


def _nitro_docs_commands(commands, path, line):
    import shlex, subprocess, sys
    for command in commands:
        shell = shlex.quote(sys.executable) + " -m nitro.cli" + command[len("nitro"):]
        done = subprocess.run(shell, shell=True, capture_output=True, text=True)
        if done.returncode != 0:
            raise AssertionError(
                f"{path}:{line}: `{command}` exited with {done.returncode}:\\n"
                f"{done.stdout[-3000:]}{done.stderr[-3000:]}"
            )
"""


@dataclasses.dataclass(frozen=True)
class Block:
    page: Path
    line: int  # the page's line of the block's first line of code
    source: str
    not_run: str | None  # why it does not run here, or None
    commands: tuple[str, ...] = ()  # a ```sh block's `nitro ...` commands (else Python)

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(REPO)}:{self.line}"


def fences(page: Path) -> list[tuple[object, object]]:
    """Each fenced block of `page` with the token before it (an HTML comment, or another)."""
    tokens = markdown_it.MarkdownIt("commonmark").parse(page.read_text(encoding="utf-8"))
    return [
        (token, tokens[index - 1] if index else None)
        for index, token in enumerate(tokens)
        if token.type == "fence"
    ]


def nitro_commands(source: str) -> tuple[str, ...]:
    """The commands of a ```sh block when each is `nitro ...` (continued lines joined, comment
    lines left out); () otherwise."""
    lines = [line for line in source.replace("\\\n", " ").splitlines() if line.strip()]
    commands = tuple(line.strip() for line in lines if not line.lstrip().startswith("#"))
    return commands if commands and all(c.startswith("nitro ") for c in commands) else ()


def runs(token) -> bool:
    """A fence the suite runs: ```python, or ```sh of `nitro` commands."""
    language = token.info.split()[:1]
    return language == ["python"] or (language == ["sh"] and bool(nitro_commands(token.content)))


def python_blocks(page: Path) -> list[Block]:
    """The blocks of `page` the suite runs, in order: ```python, and ```sh of `nitro`
    commands."""
    blocks = []
    for token, before in fences(page):
        if not runs(token):
            continue
        marker = None
        if before is not None and before.type == "html_block":
            found = NOT_RUN.fullmatch(before.content)
            marker = found["why"].strip() if found else None
            assert marker != "", f"{page.relative_to(REPO)}:{before.map[0] + 1}: say why"
        commands = nitro_commands(token.content) if token.info.split()[:1] == ["sh"] else ()
        blocks.append(Block(page, token.map[0] + 2, token.content, marker, commands))
    return blocks


def _page_id(page: Path) -> str:
    return str(page.relative_to(REPO))


RUN_PAGES = [page for page in PAGES if python_blocks(page)]


# Imported, binding no name, while a kernel waits for its page: these are the libraries every page
# uses, and importing them takes seconds that the page before can run in.
PRELOAD = "; ".join(
    f"__import__({name!r})"
    for name in ("jax", "jax.numpy", "flax.nnx", "optax", "orbax.checkpoint")
)


def _start_kernel(cwd: Path) -> Kernel:
    kernel = Kernel(cwd)
    try:
        kernel.run(RUNNER)
        kernel.finish(kernel.start(PRELOAD, silent=True, store_history=False))
    except BaseException:
        kernel.close()
        raise
    return kernel


@pytest.fixture(scope="module")
def page_kernel(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    """A function returning a fresh kernel, in a fresh directory, for each page in turn: the next
    page's kernel starts in the background while a page runs."""
    wanted = sum(
        item.originalname == "test_every_python_block_of_the_page_runs"
        for item in request.session.items
        if isinstance(item, pytest.Function)
    )
    starter = ThreadPoolExecutor(1, thread_name_prefix="docs-kernel")
    started: list[Future[Kernel]] = []

    def start() -> None:
        nonlocal wanted
        if wanted > 0:
            wanted -= 1
            cwd = tmp_path_factory.mktemp("page")
            started.append(starter.submit(_start_kernel, cwd))

    def take() -> Kernel:
        if not started:
            start()
        kernel = started.pop(0)
        start()  # the next page's
        return kernel.result()

    yield take
    starter.shutdown(wait=True)
    for kernel in started:
        if kernel.exception() is None:
            kernel.result().close()


@pytest.mark.parametrize("page", RUN_PAGES, ids=_page_id)
def test_every_python_block_of_the_page_runs(page: Path, page_kernel):
    kernel = page_kernel()
    try:
        for block in python_blocks(page):
            if block.not_run is not None:
                if not block.commands and not block.source.lstrip().startswith(("%", ">>>")):
                    ast.parse(block.source, filename=block.where)
                continue
            call = (
                f"_nitro_docs_commands({block.commands!r}, {str(page)!r}, {block.line})"
                if block.commands
                else f"_nitro_docs_block({block.source!r}, {str(page)!r}, {block.line})"
            )
            cell = kernel.run(call, timeout=300, check=False)
            if cell.status != "ok":
                traceback = ANSI.sub("", "\n".join(cell.reply["content"]["traceback"]))
                traceback = traceback[traceback.find(f"File {page}") :]  # from the page's frame
                pytest.fail(
                    f"the block at {block.where} failed: {cell.error}\n{traceback}\n"
                    f"{cell.stderr[-4000:]}",
                    pytrace=False,
                )
    finally:
        kernel.close()


@pytest.mark.parametrize("page", PAGES, ids=_page_id)
def test_every_fence_names_its_language(page: Path):
    """An unnamed fence could hide Python that never runs: output takes ```text."""
    unnamed = [token.map[0] + 1 for token, _ in fences(page) if not token.info.strip()]
    assert not unnamed, f"{_page_id(page)}: fences without a language at lines {unnamed}"


@pytest.mark.parametrize("page", PAGES, ids=_page_id)
def test_a_not_run_marker_stands_right_before_a_block_that_runs(page: Path):
    tokens = markdown_it.MarkdownIt("commonmark").parse(page.read_text(encoding="utf-8"))
    for token, after in zip(tokens, [*tokens[1:], None], strict=True):
        if token.type == "html_block" and NOT_RUN.fullmatch(token.content):
            assert after is not None and after.type == "fence", (
                f"{_page_id(page)}:{token.map[0] + 1}: a `<!-- not run: ... -->` comment must "
                "stand right before a ```python fence or a ```sh fence of nitro commands"
            )
            assert runs(after), f"{_page_id(page)}:{token.map[0] + 1}"
