"""A real ipykernel for the notebook tests: start it, run cells, watch its messages.

Test modules import `kernel_fixture`, which provides the `kernel` fixture. Each test module gets one
kernel (starting one and importing JAX costs seconds); tests in a module use distinct names. The
next notebook module's kernel starts in the background while a module's tests run.
"""

from __future__ import annotations

import dataclasses
import os
import queue
import textwrap
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest

jupyter_client = pytest.importorskip("jupyter_client")
pytest.importorskip("ipykernel")
pytest.importorskip("ipywidgets")

REPO = Path(__file__).resolve().parents[1]

# A tiny experiment module the tests import inside the kernel (and rewrite to test reloads).
TINY_MODULE = '''
import time

import numpy as np
import optax
from flax import nnx

import nitro
from nitro import GraphConst


class Net(nnx.Module):
    def __init__(self, width, rngs):
        self.hidden = nnx.Linear(4, width, rngs=rngs)
        self.out = nnx.Linear(width, 2, rngs=rngs)

    def __call__(self, x):
        return self.out(nnx.relu(self.hidden(x)))


class SlowBatches:
    """A restartable source that waits a little per batch, so epochs last long enough to be
    interrupted in the middle."""

    def __init__(self, n_batches, batch_size, delay):
        rng = np.random.default_rng(0)
        self.x = rng.normal(size=(batch_size, 4)).astype(np.float32)
        self.y = (self.x[:, 0] > 0).astype(np.int32)
        self.n_batches, self.delay = n_batches, delay

    def __len__(self):
        return self.n_batches

    def __iter__(self):
        for _ in range(self.n_batches):
            time.sleep(self.delay)
            yield {"x": self.x, "y": self.y}


def scale(x):
    return x * 1.0


@nitro.experiment
class Tiny:
    width: GraphConst[int] = 8
    batches: int = 20
    delay: float = 0.0
    max_epochs: int = 1

    def build_data(self):
        return {
            "train": SlowBatches(self.batches, 8, self.delay),
            "val": SlowBatches(2, 8, 0.0),
        }

    def build_model(self, rngs):
        return Net(self.width, rngs)

    def forward(self, model, *, x):
        return model(scale(x))

    def loss(self, logits, *, y):
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    def metrics(self, logits, *, y):
        return {"acc": (logits.argmax(-1) == y).mean()}
'''


@dataclasses.dataclass
class Cell:
    """What one execution produced."""

    msg_id: str
    reply: dict
    messages: list[dict]

    @property
    def status(self) -> str:
        return self.reply["content"]["status"]

    def stream(self, name: str | None = None) -> str:
        return "".join(
            m["content"]["text"]
            for m in self.messages
            if m["msg_type"] == "stream" and name in (None, m["content"]["name"])
        )

    @property
    def stdout(self) -> str:
        return self.stream("stdout")

    @property
    def stderr(self) -> str:
        return self.stream("stderr")

    def data(self, mime: str = "text/plain") -> list[str]:
        return [
            m["content"]["data"][mime]
            for m in self.messages
            if m["msg_type"] in ("execute_result", "display_data") and mime in m["content"]["data"]
        ]

    def updates(self, mime: str = "text/html") -> list[str]:
        """The `mime` data of every display update the cell received (a run's final record
        replaces its panel this way), without the stand-ins a live panel keeps beside it."""
        return [
            m["content"]["data"][mime]
            for m in self.messages
            if m["msg_type"] == "update_display_data"
            and mime in m["content"]["data"]
            and "nitro-standin" not in m["content"]["data"].get("text/html", "")
        ]

    @property
    def error(self) -> str:
        content = self.reply["content"]
        if content["status"] != "error":
            return ""
        return f"{content['ename']}: {content['evalue']}"


def kernel_env() -> dict[str, str]:
    """The kernel's environment: this checkout importable, JAX on the CPU (several kernels
    may run at once, and a kernel on an accelerator would reserve its memory)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    env.setdefault("JAX_PLATFORMS", "cpu")
    return env


class Kernel:
    def __init__(self, cwd: Path, env: dict[str, str] | None = None):
        """A kernel working in `cwd`; `env`: variables to set in its environment besides
        `kernel_env()`'s (such as `JPY_SESSION_NAME`, which jupyter_server sets to the
        notebook's path)."""
        self.manager = jupyter_client.KernelManager(kernel_name="python3")
        self.manager.start_kernel(cwd=str(cwd), env={**kernel_env(), **(env or {})})
        self.client = self.manager.client()
        self.client.start_channels()
        self.client.wait_for_ready(timeout=120)
        self.log: list[dict] = []  # every iopub message, in arrival order

    def close(self) -> None:
        self.client.stop_channels()
        self.manager.shutdown_kernel(now=True)

    def _drain(self, timeout: float) -> dict | None:
        try:
            message = self.client.get_iopub_msg(timeout=timeout)
        except queue.Empty:
            return None
        self.log.append(message)
        return message

    def start(self, code: str, **options) -> str:
        """Send a cell without waiting for it."""
        return self.client.execute(textwrap.dedent(code), **options)

    def finish(self, msg_id: str, timeout: float = 180) -> Cell:
        """Wait for the cell `msg_id` to finish: its reply and its output."""
        deadline = time.monotonic() + timeout
        idle = False
        while not idle:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"the cell did not finish within {timeout} s")
            message = self._drain(min(remaining, 1.0))
            if message is None:
                continue
            idle = (
                message["parent_header"].get("msg_id") == msg_id
                and message["msg_type"] == "status"
                and message["content"]["execution_state"] == "idle"
            )
        reply = self.client.get_shell_msg(timeout=120)
        while reply["parent_header"].get("msg_id") != msg_id:
            reply = self.client.get_shell_msg(timeout=120)
        mine = [m for m in self.log if m["parent_header"].get("msg_id") == msg_id]
        return Cell(msg_id, reply, mine)

    def run(self, code: str, timeout: float = 180, check: bool = True) -> Cell:
        cell = self.finish(self.start(code), timeout)
        if check and cell.status != "ok":
            raise AssertionError(f"cell failed: {cell.error}\n{cell.stderr}\n{code}")
        return cell

    def eval(self, expression: str, timeout: float = 120) -> str:
        """The repr of `expression`, read without running a cell (no cell events fire)."""
        msg_id = self.client.execute(
            "", silent=True, store_history=False, user_expressions={"value": expression}
        )
        reply = self.client.get_shell_msg(timeout=timeout)
        while reply["parent_header"].get("msg_id") != msg_id:
            reply = self.client.get_shell_msg(timeout=timeout)
        result = reply["content"]["user_expressions"]["value"]
        if result["status"] != "ok":
            raise AssertionError(f"{expression}: {result['ename']}: {result['evalue']}")
        return result["data"]["text/plain"]

    def wait_for(self, predicate, timeout: float = 60, what: str = "a message"):
        """Read iopub messages until `predicate(message)` is true; returns that message."""
        for message in self.log:
            if predicate(message):
                return message
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            message = self._drain(0.5)
            if message is not None and predicate(message):
                return message
        raise TimeoutError(f"no {what} within {timeout} s")

    def wait_until(self, expression: str, accept=lambda value: value == "True", timeout=120):
        """Poll `expression` (without running a cell) until `accept(its repr)`; returns the
        repr."""
        deadline = time.monotonic() + timeout
        while True:
            value = self.eval(expression)
            if accept(value):
                return value
            assert time.monotonic() < deadline, f"{expression} stayed {value}"
            self.pump(0.1)

    def click(self, model_id: str) -> None:
        """A click on the button widget `model_id`, sent the way a browser sends it."""
        message = self.client.session.msg(
            "comm_msg",
            {"comm_id": model_id, "data": {"method": "custom", "content": {"event": "click"}}},
        )
        self.client.shell_channel.send(message)

    def outputs(self, msg_id: str) -> list[dict]:
        """The outputs of the cell `msg_id` as a notebook saved now would hold them: its
        messages so far (also those after it ended) made into outputs by nbformat, each
        display update applied to the outputs of its display id."""
        import nbformat

        outputs: list[dict] = []
        ids: list[str | None] = []
        for message in self.log:
            if message["parent_header"].get("msg_id") != msg_id:
                continue
            kind, content = message["msg_type"], message["content"]
            display_id = content.get("transient", {}).get("display_id")
            if kind == "update_display_data":
                for index, shown in enumerate(ids):
                    if shown == display_id:
                        outputs[index]["data"] = content["data"]
                        outputs[index]["metadata"] = content["metadata"]
            elif kind in ("display_data", "execute_result", "stream", "error"):
                outputs.append(nbformat.v4.output_from_msg(message))
                ids.append(display_id)
        return outputs

    def pump(self, seconds: float) -> None:
        """Collect iopub messages for a while."""
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            self._drain(0.1)


def _kernel_with_nitro(cwd: Path) -> Kernel:
    """A kernel in `cwd`, which holds tiny_exp.py, with `%load_ext nitro` done."""
    (cwd / "tiny_exp.py").write_text(TINY_MODULE)
    k = Kernel(cwd)
    try:
        k.run(
            f"""
            import sys
            sys.path.insert(0, {str(cwd)!r})
            %load_ext nitro
            import nitro, nitro_ipython, tiny_exp
            """
        )
    except BaseException:
        k.close()
        raise
    k.cwd = cwd
    return k


_STARTER = ThreadPoolExecutor(1, thread_name_prefix="notebook-kernel")
_NEXT: dict[str, Future[Kernel]] = {}  # a later module's kernel, by module name, starting
_cleanup_registered = False  # whether the session closes the kernels no module took


def _close_unused() -> None:
    for started in _NEXT.values():
        if started.exception() is None:
            started.result().close()
    _NEXT.clear()


def _next_kernel_module(request: pytest.FixtureRequest) -> str | None:
    """The next module of the session that uses the `kernel` fixture, when only notebook
    modules (which start kernels and servers themselves) run before it; else None. None in a
    pytest-xdist worker too: the next module may be another worker's."""
    if hasattr(request.config, "workerinput"):
        return None
    modules: list[str] = []
    uses: set[str] = set()
    for item in request.session.items:
        name = item.module.__name__ if isinstance(item, pytest.Function) else ""
        if not modules or modules[-1] != name:
            modules.append(name)
        if "kernel" in getattr(item, "fixturenames", ()):
            uses.add(name)
    this = request.module.__name__
    if this not in modules:
        return None
    for name in modules[modules.index(this) + 1 :]:
        if name in uses:
            return name
        if not name.startswith("test_notebook_"):
            return None
    return None


@pytest.fixture(scope="module", name="kernel")
def kernel_fixture(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    """A kernel in a fresh directory holding tiny_exp.py, with `%load_ext nitro` done."""
    global _cleanup_registered
    if not _cleanup_registered:
        request.config.add_cleanup(_close_unused)
        _cleanup_registered = True
    started = _NEXT.pop(request.module.__name__, None)
    k = started.result() if started else _kernel_with_nitro(tmp_path_factory.mktemp("kernel"))
    following = _next_kernel_module(request)
    if following is not None and following not in _NEXT:
        _NEXT[following] = _STARTER.submit(_kernel_with_nitro, tmp_path_factory.mktemp("kernel"))
    try:
        yield k
    finally:
        k.close()
