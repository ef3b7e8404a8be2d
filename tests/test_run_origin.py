"""Where a run comes from: run.json and an export's manifest record the git state of the code
that defines the experiment (commit, branch, remote, tree, dirty flag, the uncommitted diff as
`working_tree.patch`, cut at a size it says), the packages' versions and the resolved
configuration. Real git repositories made in temporary directories, real runs of digits."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import nitro
import nitro.bundle
from nitro.runs.run_origin import PATCH_LIMIT

MODULE = '''
import nitro
from nitro.examples.digits import Digits


@nitro.experiment
class InRepo(Digits):
    """Digits, defined in a module of a git repository."""
'''
TINY = {"preset": "small", "width": 8, "max_epochs": 1, "progress": False}


def git(repo: Path, *args: str) -> str:
    done = subprocess.run(
        ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@example.com", *args],
        check=True,
        capture_output=True,
        text=True,
    )
    return done.stdout.strip()


def experiment_in(directory: Path, *, repo: bool = True):
    """`InRepo`, from a module written in `directory` (a new git repository with it
    committed on branch main, unless `repo` is False)."""
    directory.mkdir()
    source = directory / f"origin_{directory.name}.py"
    source.write_text(MODULE)
    (directory / "notes.txt").write_text("first line\n")
    if repo:
        git(directory, "init", "--quiet", "--initial-branch=main")
        git(directory, "add", ".")
        git(directory, "commit", "--quiet", "-m", "the experiment")
    spec = importlib.util.spec_from_file_location(source.stem, source)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[source.stem] = module  # inspect finds its source through it
    spec.loader.exec_module(module)
    return module.InRepo


def run_json(n) -> dict:
    return json.loads(Path(n.run_dir, "run.json").read_text())


def test_a_clean_repository_records_commit_branch_remote_and_tree_and_writes_no_patch(tmp_path):
    InRepo = experiment_in(tmp_path / "clean")
    git(tmp_path / "clean", "remote", "add", "origin", "https://me:secret@example.com/lab/exp.git")
    n = nitro.Nitro(InRepo, checkpointer=None, **TINY).train()
    assert run_json(n)["git"] == {
        "commit": git(tmp_path / "clean", "rev-parse", "HEAD"),
        "branch": "main",
        "remote": "https://example.com/lab/exp.git",  # the credentials left out
        "tree": git(tmp_path / "clean", "rev-parse", "HEAD^{tree}"),
        "dirty": False,
        "root": str(tmp_path / "clean"),
    }
    assert not Path(n.run_dir, "working_tree.patch").exists()


def test_a_dirty_repository_writes_the_uncommitted_diff_beside_run_json_as_a_patch(tmp_path):
    repo = tmp_path / "dirty"
    InRepo = experiment_in(repo)
    (repo / "notes.txt").write_text("first line\nan edit not committed\n")
    n = nitro.Nitro(InRepo, checkpointer=None, **TINY).train()
    recorded = run_json(n)["git"]
    patch = Path(n.run_dir, "working_tree.patch")
    assert (recorded["dirty"], recorded["patch"]) == (True, "working_tree.patch")
    assert recorded["patch_bytes"] == patch.stat().st_size and "patch_cut" not in recorded
    assert "+an edit not committed" in patch.read_text()
    git(repo, "apply", "--check", "--reverse", str(patch))  # it is the working tree's diff
    git(repo, "checkout", "--", ".")
    git(repo, "apply", str(patch))  # and applied to the commit, gives the working tree back
    assert (repo / "notes.txt").read_text() == "first line\nan edit not committed\n"


def test_a_diff_longer_than_the_cap_is_cut_there_and_run_json_says_so(tmp_path):
    repo = tmp_path / "long"
    InRepo = experiment_in(repo)
    (repo / "notes.txt").write_text("".join(f"line {i}\n" for i in range(PATCH_LIMIT // 6)))
    n = nitro.Nitro(InRepo, checkpointer=None, **TINY).train()
    recorded = run_json(n)["git"]
    assert Path(n.run_dir, "working_tree.patch").stat().st_size == PATCH_LIMIT
    assert recorded["patch_bytes"] == PATCH_LIMIT == 1_048_576
    assert recorded["patch_cut"] == (
        f"the uncommitted diff is longer than 1,048,576 bytes: working_tree.patch holds its "
        f"first 1,048,576 (`git diff HEAD` in {repo} shows it whole)"
    )


def test_a_detached_head_records_no_branch_and_a_repository_without_remote_no_remote(tmp_path):
    repo = tmp_path / "detached"
    InRepo = experiment_in(repo)
    git(repo, "checkout", "--quiet", "--detach")
    n = nitro.Nitro(InRepo, checkpointer=None, **TINY).train()
    recorded = run_json(n)["git"]
    assert (recorded["branch"], recorded["remote"], recorded["dirty"]) == (None, None, False)
    assert recorded["commit"] == git(repo, "rev-parse", "HEAD")


def test_outside_a_repository_or_without_git_the_run_records_git_as_absent(tmp_path, monkeypatch):
    InRepo = experiment_in(tmp_path / "plain", repo=False)
    outside = nitro.Nitro(InRepo, checkpointer=None, **TINY).train()
    assert run_json(outside)["git"] is None and outside.step == 19
    InRepo = experiment_in(tmp_path / "unseen")
    monkeypatch.setenv("PATH", str(tmp_path / "no-programs-here"))  # no git to run
    without = nitro.Nitro(InRepo, checkpointer=None, **TINY).train()
    assert run_json(without)["git"] is None and without.step == 19


def test_run_json_records_the_installed_packages_and_the_resolved_configuration(tmp_path):
    InRepo = experiment_in(tmp_path / "packages")
    n = nitro.Nitro(InRepo, checkpointer=None, seed=3, **TINY).train()
    info = run_json(n)
    packages = ("jax", "jaxlib", "flax", "optax", "orbax-checkpoint", "numpy")
    assert info["packages"] == {
        **{name: importlib.metadata.version(name) for name in packages},
        "nitro": nitro.__version__,
    }
    assert info["preset"] == "small"
    assert info["config"]["fields"] == {"width": 8, "scale": 1.0, "batch_size": 64, "max_epochs": 2}
    keywords = info["config"]["keywords"]
    assert (keywords["seed"], keywords["max_epochs"], keywords["learning_rate"]) == (3, 1, 0.001)
    assert (keywords["checkpointer"], keywords["precision"]) == (None, "Precision('float32')")
    # every run keyword, resolved, but how the session shows and logs the run
    assert list(keywords) == [k for k in n.keywords if k not in ("progress", "logger")]


def test_an_export_holds_the_patch_and_its_manifest_the_git_state_and_the_packages(tmp_path):
    repo = tmp_path / "exported"
    InRepo = experiment_in(repo)
    (repo / "notes.txt").write_text("first line\nexported with this edit\n")
    n = nitro.Nitro(InRepo, checkpointer=None, **TINY).train()
    n.export(str(tmp_path / "bundle"))
    bundle = nitro.bundle.load(tmp_path / "bundle")  # its checksums hold, the patch's too
    provenance = bundle.manifest["provenance"]
    assert provenance["git"] == run_json(n)["git"]
    assert provenance["versions"] == run_json(n)["packages"]
    assert (provenance["preset"], provenance["config"]) == ("small", run_json(n)["config"])
    assert (
        bundle.manifest["files"]["working_tree.patch"]["bytes"] == provenance["git"]["patch_bytes"]
    )
    patch = (tmp_path / "bundle" / "working_tree.patch").read_bytes()
    assert patch == Path(n.run_dir, "working_tree.patch").read_bytes()
    assert sorted(os.listdir(tmp_path / "bundle")) == [
        "manifest.json",
        "program.jaxexport",
        "weights.safetensors",
        "working_tree.patch",
    ]


def test_a_population_records_the_git_state_once_and_each_member_its_configuration(tmp_path):
    repo = tmp_path / "population"
    InRepo = experiment_in(repo)
    (repo / "notes.txt").write_text("first line\nmembers trained with this edit\n")
    pop = nitro.Population(InRepo, learning_rate=[1e-3, 1e-2], checkpointer=None, **TINY)
    pop.train()
    info = json.loads(Path(pop.run_dir, "run.json").read_text())
    assert (info["preset"], info["git"]["dirty"]) == ("small", True)
    assert "+members trained with this edit" in Path(pop.run_dir, "working_tree.patch").read_text()
    assert "learning_rate" not in info["config"]["keywords"]  # an axis: the members say it
    rates = []
    for member in ("member-0", "member-1"):
        member_info = json.loads(Path(pop.run_dir, member, "run.json").read_text())
        assert member_info["preset"] == "small"
        rates.append(member_info["config"]["keywords"]["learning_rate"])
    assert rates == [1e-3, 1e-2]
