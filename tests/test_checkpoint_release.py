"""Checkpoints written by Nitro 0.3 resume with today's code: a run and a population of two
members of digits, two of four epochs saved (tests/fixtures/release-0.3/, written by
tests/fixtures/make_release_0_3.py), resumed here for the last two epochs. Both reach the
losses and weights that Nitro 0.3 itself reached when it resumed them (expected.json). The
saved steps are read back with plain orbax too."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import jax
import numpy as np
import orbax.checkpoint as ocp

import nitro
from nitro.examples.digits import Digits

FIXTURES = Path(__file__).parent / "fixtures" / "release-0.3"
EXPECTED = json.loads((FIXTURES / "expected.json").read_text())
SMALL = dict(width=8, batch_size=128, max_epochs=4)
LEARNING_RATES = [1e-3, 1e-2]


def copied(name: str) -> str:
    shutil.copytree(FIXTURES / name, name)
    return name


def weight_sums(params) -> list[float]:
    return [float(np.asarray(leaf, np.float64).sum()) for leaf in jax.tree.leaves(params)]


def plain(run_dir: str) -> tuple[int, dict]:
    options = ocp.CheckpointManagerOptions(read_only=True)
    with ocp.CheckpointManager(Path(run_dir, "checkpoints").absolute(), options=options) as m:
        args = ocp.args.Composite(meta=ocp.args.JsonRestore(), state=ocp.args.StandardRestore())
        return m.latest_step(), m.restore(m.latest_step(), args=args)


def test_a_run_saved_by_release_0_3_resumes_and_continues_as_0_3_did():
    run_dir = copied("run")
    step, saved = plain(run_dir)
    assert step == 18 and saved["meta"]["epoch"] == 2 and saved["meta"]["nitro"] == "0.2.0"
    assert saved["state"]["params"]["out"]["kernel"].shape == (8, 10)
    run = nitro.Nitro(Digits(**SMALL), resume=run_dir, progress=False)
    assert (run.epoch, run.step) == (2, 18)
    assert list(run.history().index) == [1, 2]
    run.train()
    expected = EXPECTED["run"]
    assert (run.epoch, run.step) == (expected["epoch"], expected["step"]) == (4, 36)
    np.testing.assert_allclose(list(run.history()["loss"]), expected["loss"], rtol=1e-5)
    np.testing.assert_allclose(
        weight_sums(run.state.variables.params), expected["weights"], rtol=1e-4, atol=1e-5
    )
    run.close()


def test_a_population_saved_by_release_0_3_resumes_and_continues_as_0_3_did():
    run_dir = copied("population")
    step, saved = plain(run_dir)
    assert step == 18 and saved["meta"]["kind"] == "population"
    assert [m["member"] for m in saved["meta"]["members"]] == [0, 1]
    pop = nitro.Population(
        Digits(**SMALL), resume=run_dir, progress=False, learning_rate=LEARNING_RATES
    )
    assert (pop.epoch, pop.step) == (2, 18)
    pop.train().wait()
    expected = EXPECTED["population"]
    assert (pop.epoch, pop.step) == (expected["epoch"], expected["step"]) == (4, 36)
    history = pop.history()
    for i in range(2):
        np.testing.assert_allclose(list(history.loc[i]["loss"]), expected["loss"][i], rtol=1e-5)
        np.testing.assert_allclose(
            weight_sums(pop.member(i).state.variables.params),
            expected["weights"][i],
            rtol=1e-4,
            atol=1e-5,
        )
    pop.close()
