"""`spike=` in a population: a member's loss spike rolls that member back alone, leaving the
spiking call's batches out for it, while the other members train on untouched.

Real runs of tiny models, compared bit for bit (`==` on the history's floats,
`np.array_equal` on the parameters). Batch 5 of every epoch is marked; a member's Device
field `gain` scales the marked rows' inputs, so only the members with a large gain spike
there (a gain of 1 multiplies by one: the plain data). As for a single run
(tests/test_time_travel.py), the must-hold is that a member that rolled back over batch b
equals that member trained where its data never yielded b at that position. The reference
is the same population trained without `spike=` on the data without b (the same program, so
bit for bit, vmapped or unrolled): its member of the same settings is the one that rolled
back. With the member axis unrolled, a member computes as its run does, so there the member
also equals its settings trained alone, as a run, on the data without b: the single run's
test, member by member. A member that never spiked equals its twin in the same population
trained on the same data without `spike=`.
"""

from __future__ import annotations

import json
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import optax
import pytest
from lifecycle_toys import DropoutMLP
from toys import TinyMLP, X, Y

import nitro
from nitro import Device
from nitro.progress import TIMING_COLUMNS

POISONED = 5  # the marked batch: rows 40..47 of 64, 8 batches an epoch, not shuffled
SPIKE = nitro.Spike(rtol=1.0, window=2, max_rollbacks=5)
CALM = nitro.Spike(rtol=20.0, window=2, max_rollbacks=5)


@nitro.experiment
class Marked:
    """Batch 5 of every epoch marked; `dropped` > 0: the data without the last `dropped`
    batches up to batch 5 (what a run that left them out trained on)."""

    gain: Device[float] = 1.0
    max_epochs: int = 3
    dropped: int = 0
    dropout: bool = False  # a model whose dropout draws from random streams it keeps

    def build_data(self):
        mark = np.zeros((len(X), 1), np.float32)
        mark[POISONED * 8 : (POISONED + 1) * 8] = 1.0
        x, y = X, Y
        if self.dropped:
            keep = np.r_[0 : (POISONED + 1 - self.dropped) * 8, (POISONED + 1) * 8 : len(X)]
            x, y, mark = x[keep], y[keep], np.zeros_like(mark[keep])
        val = {"x": X[:16], "y": Y[:16], "mark": np.zeros((16, 1), np.float32)}
        return {
            "train": nitro.data.ArrayLoader({"x": x, "y": y, "mark": mark}, 8, shuffle=False),
            "val": nitro.data.ArrayLoader(val, 8, shuffle=False, drop_last=False),
        }

    def build_model(self, rngs):
        return DropoutMLP(rngs) if self.dropout else TinyMLP(5, 8, 2, rngs=rngs)

    def forward(self, model, *, x, mark):
        return model(jnp.where(mark > 0, x * self.gain, x))

    def loss(self, logits, *, y):
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


def member_history(pop, index):
    frame = pop.history().loc[index]
    return frame[[c for c in frame.columns if c not in (*TIMING_COLUMNS, "gain")]]


def same_weights(a, b) -> None:
    for x, y in zip(a.state.variables.params, b.state.variables.params, strict=True):
        assert np.array_equal(np.asarray(x), np.asarray(y))


# the learning rate falls with each step: a member that sat steps out is fed its own step's
SCHEDULE = {"learning_rate": optax.linear_schedule(3e-3, 1e-4, 30)}


@pytest.mark.filterwarnings("ignore:epoch 1. 3 of 8 training steps had a non-finite loss")
@pytest.mark.parametrize(
    ("gain", "keywords"),
    [
        (1e3, {}),
        (np.nan, {}),  # a non-finite loss: the guard had stopped its steps
        (np.nan, {"check_divergence": False}),  # no guard: its weights turned NaN
        (1e3, {"steps_per_dispatch": 2}),  # the call of batches 4 and 5 left out for member 1
        # the member axis vmapped (the CPU's "auto" unrolls a few members' steps)
        (1e3, {"steps_per_dispatch": 2, "vectorize": True}),
        (1e3, {"accum": 2}),  # the step of micro-batches 4 and 5 left out for member 1
        # a falling learning rate, and each member's own stream through dropout: only the
        # marked batch spikes (NaN), where the noisier losses stay under a higher rtol
        (np.nan, {"steps_per_dispatch": 2, "schedules": SCHEDULE, "spike": CALM}),
        (np.nan, {"batches": "own", "dropout": True, "spike": CALM}),
    ],
)
def test_a_spiking_member_rolls_back_alone_and_equals_itself_on_data_without_the_batch(
    gain, keywords
):
    keywords = {"steps_per_dispatch": 1, **keywords}
    fields = {"dropout": keywords.pop("dropout", False)}
    gains = [1.0, gain]
    spike = keywords.pop("spike", SPIKE)
    pop = nitro.Population(Marked(**fields), gain=gains, spike=spike, progress=False, **keywords)
    pop.train()
    dropped = 2 if keywords["steps_per_dispatch"] == 2 or "accum" in keywords else 1
    left_out = [[e, i] for e in (1, 2, 3) for i in range(6 - dropped, 6)]
    assert pop.skipped_batches(1)[["epoch", "index"]].values.tolist() == left_out
    assert pop.skipped_batches(0).empty
    assert pop.stopped == {}
    # the member that spiked: as in the population trained on the data without those batches
    clean = nitro.Population(
        Marked(dropped=dropped, **fields), gain=gains, progress=False, **keywords
    )
    clean.train()
    assert member_history(pop, 1).equals(member_history(clean, 1))
    same_weights(pop.member(1), clean.member(1))
    # the member that did not: as in the same population without spike=
    plain = nitro.Population(Marked(**fields), gain=gains, progress=False, **keywords).train()
    mine = member_history(pop, 0)  # (plain's member 1 diverged on NaN: a "stopped" column)
    assert mine.equals(member_history(plain, 0)[mine.columns])
    same_weights(pop.member(0), plain.member(0))


@pytest.mark.parametrize(
    "keywords",
    [{}, {"steps_per_dispatch": 2}, {"accum": 2}],
)
def test_an_unrolled_member_that_rolled_back_equals_its_settings_alone_on_data_without_it(
    keywords,
):
    keywords = {"steps_per_dispatch": 1, **keywords}
    pop = nitro.Population(
        Marked(), gain=[1.0, 1e3], spike=SPIKE, vectorize=False, progress=False, **keywords
    ).train()
    dropped = 2 if keywords["steps_per_dispatch"] == 2 or "accum" in keywords else 1
    alone = nitro.Nitro(
        Marked(gain=1e3, dropped=dropped), progress=False, checkpointer=None, **keywords
    ).train()
    history = alone.history()
    assert member_history(pop, 1).equals(history[[c for c in history if c not in TIMING_COLUMNS]])
    same_weights(pop.member(1), alone)


def test_past_max_rollbacks_only_that_member_stops_with_its_weights_from_before_the_spike():
    once = nitro.Spike(rtol=1.0, window=2, max_rollbacks=1)
    gains = [1.0, np.nan]
    pop = nitro.Population(
        Marked(), gain=gains, spike=once, steps_per_dispatch=1, progress=False
    ).train()
    assert list(pop.stopped) == [1]
    assert pop.stopped[1].startswith("spiked at step 13 (epoch 2, batch 5): a non-finite")
    assert "batches left out so far: epoch 1 batch 5 (step 6)" in pop.stopped[1]
    assert pop.stopped_at == {1: 12}  # its own steps: 7 in epoch 1, 5 in epoch 2
    assert member_history(pop, 1)["step"].tolist() == [7, 12]
    assert pop.skipped_batches()[["member", "epoch", "index"]].values.tolist() == [[1, 1, 5]]
    params = pop.member(1).state.variables.params
    assert all(np.isfinite(np.asarray(leaf)).all() for leaf in params)
    plain = nitro.Population(Marked(), gain=gains, steps_per_dispatch=1, progress=False)
    plain.train()
    mine = member_history(pop, 0)
    assert mine.equals(member_history(plain, 0)[mine.columns])  # member 0 trained on


def test_when_every_member_stops_on_its_spikes_the_run_raises_a_spike_error_naming_them():
    pop = nitro.Population(
        Marked(),
        gain=[np.nan, np.nan],
        spike=nitro.Spike(rtol=1.0, window=2, max_rollbacks=0),
        steps_per_dispatch=1,
        progress=False,
    )
    with pytest.raises(
        nitro.SpikeError,
        match=r"every member of the population stopped: member 0 \(gain=nan\): spiked at "
        r"step 6 \(epoch 1, batch 5\).*member 1 \(gain=nan\): spiked at step 6",
    ):
        pop.train()
    assert pop.stopped_at == {0: 5, 1: 5}


def test_a_member_s_skipped_batches_survive_a_resume(tmp_path):
    keywords = dict(gain=[1.0, 1e3], spike=SPIKE, steps_per_dispatch=1, progress=False)
    whole = nitro.Population(Marked(), run_dir=tmp_path / "whole", **keywords).train()
    first = nitro.Population(Marked(), run_dir=tmp_path / "cut", **keywords)
    first.train(steps=7)  # member 1 rolled back over batch 5 of epoch 1, one step after it
    assert first.skipped_batches(1)["index"].tolist() == [5]
    # its logger run marks the roll-back; member 0's has none
    lines = (Path(first.run_dir) / "member-1" / "metrics.jsonl").read_text().splitlines()
    marks = [json.loads(line)["value"] for line in lines if '"rewind/step_5"' in line]
    assert [(m["step"], m["reason"], m["steps"]) for m in marks] == [(5, "spike", 1)]
    assert "rewind/" not in (Path(first.run_dir) / "member-0" / "metrics.jsonl").read_text()
    first.close()
    resumed = nitro.Population(Marked(), run_dir=tmp_path / "cut", resume="auto", **keywords)
    assert resumed.step == 7
    assert resumed.skipped_batches().values.tolist() == first.skipped_batches().values.tolist()
    resumed.train()
    for index in (0, 1):
        assert member_history(resumed, index).equals(member_history(whole, index))
        same_weights(resumed.member(index), whole.member(index))
    assert resumed.skipped_batches().values.tolist() == whole.skipped_batches().values.tolist()


def test_a_population_refuses_rewind_and_fork_naming_what_can():
    pop = nitro.Population(Marked(max_epochs=1), gain=[1.0, 2.0], progress=False)
    with pytest.raises(nitro.PopulationError, match=r"pop.rewind\(3\): a population keeps no"):
        pop.rewind(3)
    with pytest.raises(nitro.PopulationError, match=r"pop.member\(i\) is a run that can fork"):
        pop.fork()


def test_a_member_that_rolled_back_counts_its_own_steps_in_python_and_over_the_tools():
    import anyio
    from agent_client import call, http_session

    from nitro.mcp import HttpServer, RunRegistry, ToolSession

    pop = nitro.Population(
        Marked(max_epochs=1), gain=[1.0, 1e3], spike=SPIKE, steps_per_dispatch=1, progress=False
    ).train()
    assert pop.skipped_batches(1)["index"].tolist() == [POISONED]
    assert pop.member_steps == [pop.step, pop.step - 1] == [8, 7]
    assert pop.history()["step"].tolist() == [8, 7]  # each member's row has its own
    server = HttpServer(ToolSession(registry=RunRegistry(), namespace={"pop": pop})).start()

    async def scenario():
        async with http_session(server.url, server.token) as session:
            return await call(session, "nitro_status", run_id="pop")

    try:
        status = anyio.run(scenario)
    finally:
        server.stop()
    assert [m["step"] for m in status["member_status"]] == [8, 7]
