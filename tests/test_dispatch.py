"""Fused multi-step dispatch: K training steps per program call, identical to one at a time."""

from __future__ import annotations

import collections
import itertools
import math
import os
import signal
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from system import child_env
from toys import TinyMLP, Toy, ToyWithMetrics, X, Y

import nitro
import nitro.engine.loop
import nitro.engine.swaps
from nitro.data import ArrayLoader

X9, Y9 = np.resize(X, (144, 5)), np.resize(Y, 144)  # 9 batches of 16


@nitro.experiment
class Nine(ToyWithMetrics):
    """9 training batches per epoch (a count 3 divides and 8 does not)."""

    def build_data(self):
        splits = super().build_data()
        splits["train"] = ArrayLoader({"x": X9, "y": Y9}, 16)
        return splits

    def train_metrics(self, logits, *, y):
        return {"hit": (logits.argmax(-1) == y).mean()}


SCHEDULES = {
    "learning_rate": lambda step: 1e-2 * (1.0 + (step % 5) / 5),
    "scale": lambda step: 1.0 + 0.25 * (step % 3),
}


def trained(steps_per_dispatch, epochs=3, **keywords):
    n = nitro.Nitro(
        Nine(max_epochs=epochs),
        steps_per_dispatch=steps_per_dispatch,
        schedules=SCHEDULES,
        progress=False,
        **keywords,
    )
    n.train()
    return n


def params_of(n):
    return [np.asarray(a) for a in n.state.variables.params]


def test_three_epochs_with_k_1_3_8_are_bitwise_identical_with_schedules(fresh_cache):
    one = trained(1)
    history = one.history()[["loss", "hit", "val_loss"]]
    for k in (3, 8):
        fused = trained(k)
        assert fused.step == one.step == 27
        for a, b in zip(params_of(one), params_of(fused), strict=True):
            np.testing.assert_array_equal(a, b)
        assert fused.history()[["loss", "hit", "val_loss"]].equals(history)


def test_compile_counts_are_exact_and_a_remainder_runs_one_step_per_call(fresh_cache):
    def compiled():
        return sorted((p["program"], p["calls"]) for p in nitro.cache_stats().programs)

    trained(3, epochs=2)  # 9 = 3 x 3: the fused program alone
    assert compiled() == [("eval forward", 4), ("multi-step train", 6)]
    nitro.cache_reset()
    trained(8, epochs=2)  # 9 = 8 + 1: the fused program, and one step for the remainder
    assert compiled() == [("eval forward", 4), ("multi-step train", 2), ("train step", 2)]
    nitro.cache_reset()
    trained(64, epochs=2)  # capped by the epoch: 9 per call
    assert compiled() == [("eval forward", 4), ("multi-step train", 2)]
    reasons = [r.reason for r in nitro.explain_compiles()]
    assert reasons[0] == "new program"


def test_a_schedule_change_recompiles_nothing_with_fused_steps(fresh_cache):
    trained(3, epochs=1)
    before = nitro.cache_stats().misses
    n = nitro.Nitro(
        Nine(max_epochs=1),
        steps_per_dispatch=3,
        schedules={"learning_rate": optax.cosine_decay_schedule(1e-2, 9), "scale": 0.5},
        progress=False,
    )
    n.train()
    assert nitro.cache_stats().misses == before


@nitro.experiment
class Gated(Toy):
    """A gradient that is NaN at one step (sqrt at 0), with a finite loss."""

    gate: nitro.Device[float] = 1.0
    with_val: bool = False

    def build_data(self):
        return {"train": ArrayLoader({"x": X9, "y": Y9}, 16, shuffle=False)}

    def build_model(self, rngs):
        return TinyMLP(5, 8, 2, rngs=rngs)

    def loss(self, logits, *, y):
        ce = optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
        return ce + 0.0 * jnp.sqrt(self.gate * jnp.sum(logits**2))


def gated_run(bad_step, steps_per_dispatch, **keywords):
    """A `Gated` run whose gradient is NaN at `bad_step` (counted from 0): the handle, and
    the DivergenceError it stopped with."""
    n = nitro.Nitro(
        Gated(max_epochs=3),
        steps_per_dispatch=steps_per_dispatch,
        schedules={"gate": lambda step: 0.0 if step == bad_step else 1.0},
        progress=False,
        **keywords,
    )
    with pytest.raises(nitro.DivergenceError) as raised:
        n.train()
    return n, raised.value


# the loop restores a fused call of a small model (its program keeps nothing); the select per
# step keeps it when the variables are over RESTORE_BYTES
@pytest.mark.parametrize("keeps", ["the loop", "the select"])
@pytest.mark.parametrize("bad_step", [13, 12, 14], ids=["mid-call", "first", "last"])
def test_the_guard_stops_at_the_exact_step_inside_a_fused_call(monkeypatch, keeps, bad_step):
    if keeps == "the select":
        monkeypatch.setattr(nitro.engine.loop, "RESTORE_BYTES", 0)
    # the 13th-15th steps: the second fused call of epoch 2
    n, error = gated_run(bad_step, 3)
    assert "a gradient is non-finite" in str(error)
    assert f"at step {bad_step + 1} (epoch 2, batch {bad_step - 9 + 1})" in str(error)
    assert n.step == bad_step and n.epoch == 1
    # the same steps one at a time, stopped before the bad one, hold the same weights
    same, _ = gated_run(bad_step, 1)
    assert same.step == bad_step
    for a, b in zip(params_of(n), params_of(same), strict=True):
        np.testing.assert_array_equal(a, b)
    # trained again, it stops at the same step, from the same weights
    kept = params_of(n)
    with pytest.raises(nitro.DivergenceError):
        n.train()
    assert n.step == bad_step
    for a, b in zip(kept, params_of(n), strict=True):
        np.testing.assert_array_equal(a, b)


def test_a_fused_call_of_accumulated_steps_is_restored_to_the_step_before_the_bad_one():
    # accum=2: 9 batches are 4 steps of 2 and one of 1 an epoch; 2 steps per call
    n, error = gated_run(6, 2, accum=2)
    assert "at step 7" in str(error) and n.step == 6
    same, _ = gated_run(6, 1, accum=2)
    for a, b in zip(params_of(n), params_of(same), strict=True):
        np.testing.assert_array_equal(a, b)


def test_per_step_losses_reach_reporters_and_a_stop_lands_on_a_call_boundary():
    seen = []

    class Steps:
        def __init__(self):
            self.handle = None

        def step(self, step, loss):
            seen.append((step, loss))
            if step == 5 and self.handle is not None:
                self.handle.stop()

    reporter = Steps()
    n = nitro.Nitro(Nine(max_epochs=3), steps_per_dispatch=3, progress=reporter)
    reporter.handle = n
    n.train()
    # the stop arrives while call 2 (steps 4-6) is read back; call 3 (steps 7-9) is already
    # in flight, so the run stops after step 9, a call boundary, and reports every step
    assert n.stop_reason == "requested" and n.step == 9
    assert [s for s, _ in seen] == list(range(1, 10))
    assert all(np.isfinite(loss) for _, loss in seen)
    n.train()  # resumes mid-epoch and finishes
    assert n.step == 27 and n.epoch == 3


@pytest.mark.serial  # auto's choice is a measurement of this machine
@pytest.mark.parametrize("prefetch", ["inline", "threads"])
def test_auto_measures_then_fuses_and_says_why_in_the_binding_report(
    monkeypatch, prefetch, fresh_cache
):
    monkeypatch.setattr(nitro.dispatch, "PROBE_SHARE", math.inf)  # however fast this machine is
    x, y = np.resize(X, (16 * 200, 5)), np.resize(Y, 16 * 200)

    def lean(epochs, **keywords):  # 200 batches an epoch, nothing written
        data = {"train": ArrayLoader({"x": x, "y": y}, 16)}
        experiment = Toy(max_epochs=epochs, with_val=False)
        return nitro.Nitro(
            experiment, data=data, progress=False, checkpointer=None, logger=None, **keywords
        )

    n = lean(20, prefetch=prefetch)
    assert "steps per dispatch: auto (the first 9 steps run one at a time" in str(
        n.binding_report()
    )
    n.train()
    plan = n.dispatch
    assert plan.steps is not None and plan.steps > 1 and not plan.checking, plan.describe()
    assert plan.steps in plan.candidates and 1 <= len(plan.candidates) <= 3
    assert all(200 % k == 0 for k in plan.candidates)  # divisors of the epoch: no remainder
    report = str(n.binding_report())
    # the figures it decided by: a step alone, then every fused size timed beside it
    assert f"steps per dispatch: {plan.steps} (auto: {plan.steps} steps per call ran" in report
    assert "(ms a step: 1: " in plan.reason and "rounds side by side" in plan.reason
    for k in plan.candidates:
        assert f", {k}: " in plan.reason, plan.reason
    # one program for single steps, one for each size timed: nothing else compiled
    programs = [p["program"] for p in nitro.cache_stats().programs if p["owner"] == n.owner]
    assert programs.count("multi-step train") == len(plan.candidates), programs
    assert programs.count("train step") == 1
    assert n.step == 20 * 200  # every step ran once, across the changes of call size
    # a handle that continues the choice runs its K at once, without measuring again
    again = lean(1, steps_per_dispatch=plan)
    singles = single_step_calls()
    again.train()
    assert again.dispatch == plan and again.step == 200
    assert single_step_calls() == singles  # no step ran alone: no probe, no timing


def single_step_calls():
    return sum(p["calls"] for p in nitro.cache_stats().programs if p["program"] == "train step")


def _drive(plan, batches, epochs, work=None):
    """Feed `plan` the calls a training loop would make from its `blocks()`: each stream an
    epoch (reopened where the plan changes its call sizes), each call a little work (or
    `work(size)`), a size's first call checked as the loop does (its steps alike, its time
    what the copy's call took). Returns the call sizes run."""
    clock = nitro.engine.dispatch.time  # the plan's clock
    calls, step, total = [], 0, batches * epochs
    for _ in range(epochs):
        position = 0
        while position < batches:
            plan.start_stream()
            blocks = plan.blocks(batches, position)
            sizes = itertools.repeat(blocks) if isinstance(blocks, int) else iter(blocks)
            for index, size in enumerate(sizes):
                size = size if size <= batches - position else 1  # the epoch's remainder
                if index == 0 and plan.measuring:
                    plan.began()
                first, begin = size > 1 and plan.unchecked(size), clock.perf_counter()
                if work is None:
                    np.linalg.qr(np.ones((8 * size, 8)))  # some work, more for more steps
                else:
                    work(size)
                position, step = position + size, step + size
                calls.append(size)
                switch = first and plan.checked(size, True, 0.0, clock.perf_counter() - begin)
                switch = switch or (
                    plan.measuring and plan.completed(size, batches, lambda left=total - step: left)
                )
                if switch or position >= batches:
                    break
    return calls


@pytest.mark.parametrize("processes", [1, 2])
def test_auto_times_each_candidate_size_and_keeps_one_of_them_or_one_step(monkeypatch, processes):
    # a target of 4 steps (the least), and up to 64 (epochs of 256): a middle size of 16
    monkeypatch.setattr(nitro.dispatch, "TARGET_SECONDS", 0.0)
    monkeypatch.setattr(nitro.dispatch, "PROBE_SHARE", math.inf)
    agree = (lambda values: list(values)) if processes > 1 else None  # process 0's figures
    plan = nitro.dispatch.DispatchPlan(nitro.dispatch.DispatchChoice.of("auto"), agree)
    calls = _drive(plan, 256, 40)
    choice = plan.choice
    assert choice.candidates == (4, 16, 64), choice
    assert not choice.checking and choice.steps in (1, 4, 16, 64), choice
    assert set(calls) == {1, 4, 16, 64}
    for k in choice.candidates:
        assert f", {k}: " in choice.reason, choice.reason
    if agree is not None:  # processes time every round there may be, then decide together
        assert "medians of 11 rounds side by side" in choice.reason, choice.reason
    # the last epoch's calls are all of the K kept
    last = list(itertools.accumulate(reversed(calls))).index(256) + 1
    assert set(calls[-last:]) == {choice.steps}


class Clock:
    """A step clock for the plan: each call takes the seconds a step of its size is given."""

    def __init__(self, seconds_a_step: dict[int, float]):
        self.now, self.seconds_a_step = 0.0, seconds_a_step

    def perf_counter(self) -> float:
        return self.now

    def work(self, size: int) -> None:
        self.now += size * self.seconds_a_step[size]


@pytest.mark.parametrize(
    ("sixty_four", "kept"),
    [(0.59e-3, 64), (0.65e-3, 16)],
    ids=["within the tie: the largest", "beyond it: the fastest"],
)
def test_of_fused_sizes_timed_as_fast_as_each_other_the_largest_is_kept(
    monkeypatch, sixty_four, kept
):
    monkeypatch.setattr(nitro.dispatch, "TARGET_SECONDS", 0.0)
    monkeypatch.setattr(nitro.dispatch, "PROBE_SHARE", math.inf)
    clock = Clock({1: 1e-3, 4: 0.7e-3, 16: 0.58e-3, 64: sixty_four})
    monkeypatch.setattr(nitro.engine.dispatch, "time", clock)  # the plan's clock, not a machine's
    plan = nitro.dispatch.DispatchPlan(nitro.dispatch.DispatchChoice.of("auto"))
    _drive(plan, 256, 40, clock.work)
    choice = plan.choice
    assert choice.candidates == (4, 16, 64) and not choice.checking, choice
    assert choice.steps == kept, choice
    assert ("the largest so" in choice.reason) == (kept == 64), choice.reason
    assert "16: 0.580" in choice.reason and "1: 1.000" in choice.reason, choice.reason


class SlowFirst(Clock):
    """A clock on which the first `slowed` calls of size 4 take `slow` seconds a step (the
    first compiles, untimed: a pair is its second and third), as under a busy neighbour or
    the run's first checkpoint write; the later ones take what `seconds_a_step` gives."""

    def __init__(self, seconds_a_step: dict[int, float], slow: float, slowed: int):
        super().__init__(seconds_a_step)
        self.slow, self.slowed, self.fours = slow, slowed, 0

    def work(self, size: int) -> None:
        if size == 4:
            self.fours += 1
            if self.fours <= self.slowed:
                self.now += size * self.slow
                return
        super().work(size)


@pytest.mark.parametrize(
    ("slow", "slowed", "candidates", "kept"),
    [
        (90e-3, 3, (4, 8), 8),  # one slow pair: 8 a call would take 0.72 s, under twice 0.5 s
        (90e-3, 10**9, (4,), 1),  # two slow pairs: 8 is dropped, and 4 does not pay
        (140e-3, 3, (4,), 4),  # one pair of 8 a call over 1 s: dropped at once
    ],
    ids=["one slow pair", "every pair slow", "one pair far too slow"],
)
def test_a_larger_size_is_dropped_on_a_pair_only_when_it_reads_far_too_slow(
    monkeypatch, slow, slowed, candidates, kept
):
    # a 40 ms step in epochs of 16 batches: 4 and 8 are timed (a pair of 8 fills an epoch)
    clock = SlowFirst({1: 40e-3, 4: 28e-3, 8: 26e-3}, slow, slowed)
    monkeypatch.setattr(nitro.engine.dispatch, "time", clock)  # the plan's clock, not a machine's
    monkeypatch.setattr(nitro.dispatch, "PROBE_SHARE", math.inf)
    plan = nitro.dispatch.DispatchPlan(nitro.dispatch.DispatchChoice.of("auto"))
    _drive(plan, 16, 60, clock.work)
    choice = plan.choice
    assert not choice.checking and choice.candidates == candidates, choice
    assert choice.steps == kept, choice
    assert ("8 dropped" in choice.reason) == (candidates == (4,)), choice.reason
    assert ("faster of 2 pairs" in choice.reason) == (slowed > 3), choice.reason


def test_a_population_may_fuse_as_many_steps_as_its_members_calls_would_take(monkeypatch):
    # a 140 ms step (eight members of a small language model), faster fused, as XLA's CPU
    # backend runs it: a run keeps a stop waiting at most 0.5 s, so it times 4 steps a call
    # at most; a population of 8 may keep it 8 times as long, and fuses half an epoch
    seconds = {1: 140e-3, 4: 80e-3, 8: 75e-3, 32: 70e-3}
    monkeypatch.setattr(nitro.dispatch, "PROBE_SHARE", math.inf)
    chosen = {}
    for members in (1, 8):
        clock = Clock(seconds)
        monkeypatch.setattr(nitro.engine.dispatch, "time", clock)  # the plan's clock
        plan = nitro.dispatch.DispatchPlan(nitro.dispatch.DispatchChoice.of("auto"))
        plan.for_members(members)
        _drive(plan, 64, 60, clock.work)
        assert not plan.choice.checking, plan.choice
        chosen[members] = plan.choice
    assert chosen[1].candidates == (4,) and chosen[1].steps == 4, chosen[1]
    assert chosen[8].candidates == (4, 8, 32) and chosen[8].steps == 32, chosen[8]
    assert "over 4 s" not in chosen[8].reason and "32: 70.000" in chosen[8].reason


def test_an_epoch_of_prime_length_is_split_evenly_not_left_to_single_steps(monkeypatch):
    # 157 batches (the digits at batch 32) has no divisor to fuse by: each size timed splits
    # the epoch into calls of one size, with fewer single steps left over than calls
    monkeypatch.setattr(nitro.dispatch, "PROBE_SHARE", math.inf)
    clock = Clock(collections.defaultdict(lambda: 0.5e-3, {1: 1e-3}))
    monkeypatch.setattr(nitro.engine.dispatch, "time", clock)  # the plan's clock
    plan = nitro.dispatch.DispatchPlan(nitro.dispatch.DispatchChoice.of("auto"))
    calls = _drive(plan, 157, 40, clock.work)
    choice = plan.choice
    assert not choice.checking and max(choice.candidates) == 52, choice
    for k in choice.candidates:
        assert 157 % k < 157 // k, (k, choice)
    last = list(itertools.accumulate(reversed(calls))).index(157) + 1
    assert sorted(calls[-last:], reverse=True) == [choice.steps] * (157 // choice.steps) + [1] * (
        157 % choice.steps
    )


def test_timing_stops_once_it_cost_its_share_of_the_run(monkeypatch):
    # fused steps three times as slow as single ones: every timed pair loses time, and a run
    # of 256 x 8 steps of 1 ms (2 s) gives the probe 5 % of it, 0.1 s
    clock = Clock({1: 1e-3, 4: 3e-3, 8: 3e-3, 16: 3e-3, 64: 3e-3})
    monkeypatch.setattr(nitro.engine.dispatch, "time", clock)  # the plan's clock, not a machine's
    monkeypatch.setattr(nitro.dispatch, "TARGET_SECONDS", 0.0)
    plan = nitro.dispatch.DispatchPlan(nitro.dispatch.DispatchChoice.of("auto"))
    calls = _drive(plan, 256, 8, clock.work)
    choice = plan.choice
    assert choice.steps == 1 and not choice.checking, choice
    assert "5% of the run's work" in choice.reason, choice.reason
    # 64 was not timed: its first call showed that its rounds would cost more than that
    assert "64 dropped, as a call of 64 took 192.000 ms (3.00x" in choice.reason, choice.reason
    # what the timed pairs lost against single steps stays within the share and one pair
    lost = lost_in_pairs(calls)
    assert lost <= 0.05 * 256 * 8 * 1e-3 + 2 * 64 * 2e-3, lost
    unbounded = nitro.dispatch.DispatchPlan(nitro.dispatch.DispatchChoice.of("auto"))
    monkeypatch.setattr(nitro.dispatch, "PROBE_SHARE", math.inf)
    assert lost_in_pairs(_drive(unbounded, 256, 8, clock.work)) > 2 * lost


def lost_in_pairs(calls):
    """The seconds the fused calls after each size's first lost to single steps (2 ms each)."""
    seen: set[int] = set()
    lost = 0.0
    for size in calls:
        if size > 1 and size in seen:
            lost += 2e-3 * size
        seen.add(size)
    return lost


def test_a_second_handle_of_the_same_program_reuses_the_choice_and_compiles_nothing(
    monkeypatch, fresh_cache
):
    monkeypatch.setattr(nitro.dispatch, "PROBE_SHARE", math.inf)  # time however short the run
    first = lean_handle(Nine(max_epochs=30)).train()
    assert not first.dispatch.probing and not first.dispatch.checking, first.dispatch
    assert "reused" not in first.dispatch.reason
    misses, singles = nitro.cache_stats().misses, single_step_calls()
    second = lean_handle(Nine(max_epochs=30)).train()
    assert second.dispatch.steps == first.dispatch.steps
    assert "reused: measured by an earlier handle of the same train program" in str(
        second.binding_report()
    )
    assert nitro.cache_stats().misses == misses  # no program compiled, no probe timed
    if second.dispatch.steps > 1:  # its first call, then single steps up to a multiple of K
        assert single_step_calls() - singles == second.dispatch.steps
    params = zip(params_of(first), params_of(second), strict=True)
    assert all(np.array_equal(a, b) for a, b in params)


def test_a_pair_of_fused_calls_is_timed_in_an_epoch_just_long_enough_for_it(monkeypatch):
    monkeypatch.setattr(nitro.dispatch, "PROBE_SHARE", math.inf)
    plan = nitro.dispatch.DispatchPlan(nitro.dispatch.DispatchChoice.of("auto"))
    calls = _drive(plan, 16, 60)
    choice = plan.choice
    assert not choice.checking, choice
    assert max(choice.candidates) == 8  # a pair of 8 is a whole epoch of 16 batches
    assert "8: " in choice.reason, choice.reason
    assert [8, 8] in [calls[i : i + 2] for i in range(len(calls) - 1)]


def test_auto_is_undecided_while_the_work_left_pays_for_no_fused_compile(monkeypatch):
    monkeypatch.setattr(nitro.dispatch, "PROBE_SHARE", 0.0)
    plan = nitro.dispatch.DispatchPlan(nitro.dispatch.DispatchChoice.of("auto"))
    calls = _drive(plan, 64, 2)
    assert set(calls) == {1} and plan.steps is None and "undecided" in plan.describe()


class TinyConv(nnx.Module):
    def __init__(self, rngs):
        self.conv1 = nnx.Conv(1, 16, kernel_size=(3, 3), rngs=rngs)
        self.conv2 = nnx.Conv(16, 32, kernel_size=(3, 3), rngs=rngs)
        self.drop = nnx.Dropout(0.25, rngs=rngs)
        self.out = nnx.Linear(8 * 8 * 32, 10, rngs=rngs)

    def __call__(self, x):
        x = nnx.relu(self.conv1(x.reshape(x.shape[0], 8, 8, 1)))
        x = nnx.relu(self.conv2(x))
        return self.out(self.drop(x.reshape(x.shape[0], -1)))


@nitro.experiment
class Convolutional:
    """Digits-shaped images through two convolutions and a dropout, as a port of the Keras
    MNIST convnet: XLA's CPU backend compiles a convolution inside a loop body otherwise than
    alone (about ten times slower, and rounding differently in the last bit)."""

    max_epochs: int = 20
    batches: int = 120

    def build_data(self):
        rng = np.random.default_rng(0)
        rows = 32 * self.batches
        x = rng.normal(size=(rows, 64)).astype(np.float32)
        return {"train": ArrayLoader({"x": x, "y": rng.integers(0, 10, rows)}, 32)}

    def build_model(self, rngs):
        return TinyConv(rngs)

    def forward(self, model, *, x):
        return model(x)

    def loss(self, logits, *, y):
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


def lean_handle(experiment, **keywords):
    return nitro.Nitro(experiment, progress=False, checkpointer=None, logger=None, **keywords)


def test_runs_whose_auto_choices_differ_end_bitwise_equal_to_one_step_per_call(monkeypatch):
    monkeypatch.setattr(nitro.dispatch, "PROBE_SHARE", math.inf)  # time however short the run
    for experiment in (Convolutional(max_epochs=1), Nine(max_epochs=30)):
        expected = lean_handle(experiment, steps_per_dispatch=1).train()
        choices = []
        for keep_below in (0.0, 100.0):  # timings that never, or always, find fusing pays
            monkeypatch.setattr(nitro.dispatch, "KEEP_BELOW", keep_below)
            nitro.cache_reset()  # no choice of an earlier handle to reuse
            n = lean_handle(experiment).train()
            assert not n.dispatch.probing and not n.dispatch.checking, n.dispatch
            choices.append(n.dispatch.steps)
            assert n.step == expected.step
            for a, b in zip(params_of(expected), params_of(n), strict=True):
                np.testing.assert_array_equal(a, b)
        if isinstance(experiment, Convolutional):
            # its fused calls round differently: the first one, run on a copy, shows it, and
            # the run keeps one step per call whatever the timings would have said
            assert choices == [1, 1]
            assert "did not compute bit for bit as" in n.dispatch.reason, n.dispatch.reason
            programs = [p["program"] for p in nitro.cache_stats().programs]
            assert programs.count("multi-step train") == 1, programs  # no other size compiled
        else:  # the same steps, in fused calls or not, as the timings said
            assert choices[0] == 1 and choices[1] > 1, choices


def test_variables_too_large_to_copy_for_the_check_keep_one_step_per_call(monkeypatch):
    monkeypatch.setattr(nitro.dispatch, "PROBE_SHARE", math.inf)  # time however short the run
    monkeypatch.setattr(nitro.engine.swaps, "PROBATION_COPY_BYTES", 0)  # every model is large
    expected = lean_handle(Nine(max_epochs=30), steps_per_dispatch=1).train()
    nitro.cache_reset()
    n = lean_handle(Nine(max_epochs=30)).train()
    assert n.dispatch.steps == 1 and not n.dispatch.checking, n.dispatch
    assert "too large to check a fused call of" in n.dispatch.reason, n.dispatch.reason
    for a, b in zip(params_of(expected), params_of(n), strict=True):
        np.testing.assert_array_equal(a, b)


RESUME = textwrap.dedent(
    """
    import math, sys
    from pathlib import Path
    import numpy as np, nitro
    from lifecycle_toys import KillAt
    from test_dispatch import Convolutional
    nitro.dispatch.PROBE_SHARE = math.inf  # "auto" times its sizes however short the run
    mode, run_dir = sys.argv[1:3]
    keywords = dict(run_dir=run_dir, checkpointer=nitro.Checkpointer(budget=None), logger=None)
    if mode == "crash":  # killed in epoch 3 of 16 steps, once epoch 2 is saved
        progress = KillAt(2 * 16 + 5, Path(run_dir) / "checkpoints" / "32")
        nitro.Nitro(Convolutional(max_epochs=4, batches=16), progress=progress, **keywords).train()
        raise SystemExit("the run was not killed")
    n = nitro.Nitro(
        Convolutional(max_epochs=4, batches=16), resume="auto", progress=False, **keywords
    )
    print("resumed at step", n.step, flush=True)
    n.train()
    np.savez(sys.argv[3], *[np.asarray(p) for p in n.state.variables.params])
    """
)


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="children train on the CPU")
def test_a_killed_cnn_run_resumed_with_the_defaults_ends_bitwise_equal(
    tmp_path, monkeypatch, fresh_cache
):
    """`steps_per_dispatch="auto"` (the default) times its sizes in the run killed and again
    in the new process that resumes it: the result is the uninterrupted run's, bit for bit."""
    monkeypatch.setattr(nitro.dispatch, "PROBE_SHARE", math.inf)
    full = nitro.Nitro(
        Convolutional(max_epochs=4, batches=16),
        run_dir=tmp_path / "full",
        checkpointer=nitro.Checkpointer(budget=None),
        logger=None,
        progress=False,
    ).train()
    assert not full.dispatch.probing, full.dispatch  # it timed fused calls in this run
    run_dir, out = str(tmp_path / "run"), str(tmp_path / "resumed.npz")
    for mode in ("crash", "resume"):
        done = subprocess.run(
            [sys.executable, "-c", RESUME, mode, run_dir, out],
            env=child_env(),
            capture_output=True,
            text=True,
            timeout=600,
            cwd=tmp_path,
        )
        if mode == "crash":
            assert done.returncode == -signal.SIGKILL, done.stderr[-3000:]
        else:
            assert done.returncode == 0, done.stderr[-3000:]
            assert "resumed at step 32" in done.stdout, done.stdout
    resumed = np.load(out)
    expected = params_of(full)
    assert len(resumed.files) == len(expected)
    for i, a in enumerate(expected):
        np.testing.assert_array_equal(a, resumed[f"arr_{i}"])


def test_a_short_run_keeps_one_step_per_call_and_decides_again_later(fresh_cache):
    n = nitro.Nitro(Nine(max_epochs=1), progress=False)
    n.train()
    assert n.dispatch.steps is None
    assert "undecided" in n.dispatch.describe()
    # 270 steps of a tiny model are a fraction of a second: 5 % of it pays for no compile
    n = lean_handle(Nine(max_epochs=30)).train()
    assert n.dispatch.steps is None and "would cost over 5% of the" in n.dispatch.reason
    programs = [p["program"] for p in nitro.cache_stats().programs]
    assert "multi-step train" not in programs, programs


def test_a_live_edit_compiles_exactly_the_programs_the_run_calls(tmp_path, fresh_cache):
    from test_live_edits import Module, apply, wait_until

    module = Module(tmp_path)
    n = module.handle(steps_per_dispatch=3, max_epochs=10_000, progress=False)
    assert len(n.splits["train"]) % 3 == 0  # 39 batches: calls of 3 and nothing else
    n.predict({"x": module.module.ARRAYS["val"]["x"][:8]})  # a predict program held
    n.train(steps=5)  # a call of 3, then single steps to stop at step 5: the train step held
    n.train(background=True)
    wait_until(lambda: n.epoch >= 1, "the first validation (eval forward held)")
    held = {p["program"] for p in nitro.cache_stats().programs if p["owner"] == n.owner}
    assert held == {"predict", "train step", "multi-step train", "eval forward"}, held
    # a model edit reaches every program; the run calls fused calls of 3 and evaluates
    edit = apply(n, module, "nnx.relu(", "nnx.tanh(")
    assert edit.status == "swapped", edit
    called = {"multi-step train", "eval forward"}
    assert set(edit.programs) == set(edit.record["compiled"]) == called, edit.record
    n.stop().wait()
    assert n.predict({"x": module.module.ARRAYS["val"]["x"][:8]}).shape == (8, 10)  # compiles now


def test_steps_per_dispatch_is_checked():
    with pytest.raises(ValueError, match="steps_per_dispatch must be 'auto' or an int >= 1"):
        nitro.Nitro(Toy(), steps_per_dispatch=0, progress=False)


MESH = textwrap.dedent(
    """
    import os, sys
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
    sys.path.insert(0, {tests!r})
    import numpy as np, nitro
    from test_dispatch import Nine, SCHEDULES
    out = []
    for k in (1, 3):
        n = nitro.Nitro(Nine(max_epochs=2, batch_size=16), n_devs=4, steps_per_dispatch=k,
                        schedules=SCHEDULES, progress=False, checkpointer=None, logger=None)
        n.train()
        out.append([np.asarray(p) for p in n.state.variables.params])
        print("loss", k, n.history()["loss"].tolist())
    print("max difference", max(np.abs(a - b).max() for a, b in zip(*out)))
    from test_dispatch import _long_validation
    long = _long_validation(16 * 40 + 5)
    scores = [nitro.Nitro(long, n_devs=4, steps_per_dispatch=k, progress=False,
                          checkpointer=None, logger=None).validate() for k in (1, 4)]
    print("validation", scores[0] == scores[1], scores)
    """
)


def test_fused_steps_on_a_mesh_match_one_at_a_time(tmp_path):
    script = MESH.format(tests=os.path.dirname(__file__))
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=300, cwd=tmp_path
    )
    assert done.returncode == 0, done.stderr[-3000:]
    lines = dict(line.split(" ", 1) for line in done.stdout.splitlines())
    assert float(lines["max"].split()[-1]) <= 1e-6
    assert lines["validation"].startswith("True"), lines["validation"]  # fused on the mesh too


def _long_validation(rows):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(rows, 5)).astype(np.float32)
    y = rng.integers(0, 2, rows)

    @nitro.experiment
    class LongValidation(ToyWithMetrics):
        def build_data(self):
            return {
                "train": ArrayLoader({"x": x[:64], "y": y[:64]}, 16),
                "val": ArrayLoader({"x": x, "y": y}, 16, shuffle=False, drop_last=False),
            }

    return LongValidation()


def eval_programs(n):
    return [
        p
        for p in nitro.cache_stats().programs
        if p["owner"] == n.owner and p["program"] == "eval forward"
    ]


def test_evaluation_fuses_with_the_training_k_and_matches_one_batch_per_call(fresh_cache):
    experiment = _long_validation(16 * 40 + 5)  # 41 batches, the last one of 5 samples
    one = nitro.Nitro(experiment, steps_per_dispatch=1, progress=False, checkpointer=None)
    fused = nitro.Nitro(experiment, steps_per_dispatch=4, progress=False, checkpointer=None)
    expected = one.validate()
    assert len(eval_programs(one)) == 1
    assert fused.validate() == expected  # host metrics and the padded batch, bitwise
    assert fused.evaluate(split="val", weights="current") == expected
    # 10 calls of 4 batches, then 1 of one (the one-batch program is shared with `one`)
    assert sorted(p["calls"] for p in eval_programs(fused)) == [10 + 10, 1 + 1 + 41]


def test_a_short_split_is_evaluated_one_batch_per_call(fresh_cache):
    fused = nitro.Nitro(
        _long_validation(16 * 10), steps_per_dispatch=4, progress=False, checkpointer=None
    )
    fused.validate()  # 10 batches: fewer than 4 calls of 4
    assert len(eval_programs(fused)) == 1
