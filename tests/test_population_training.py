"""Population training: pruning, each member's data order, accumulation, early stopping per
member, runs in steps and in the background, and the events a population reports.

Real JAX, Flax and Optax; members are checked against the same settings trained alone, and
against populations trained without the change under test.
"""

import json
import threading
from pathlib import Path

import jax
import jax.monitoring
import numpy as np
import pytest

import nitro
from nitro.examples.digits import Digits

SMALL = dict(width=64, batch_size=32)  # the tiny MLP: 64-64-10, batch 32 (39 steps an epoch)


def _weights(pop, index):
    return [np.asarray(leaf) for leaf in pop.member(index).state.variables.params]


def _alone(epochs, **keywords):
    n = nitro.Nitro(
        Digits(max_epochs=epochs, **SMALL),
        progress=False,
        checkpointer=None,
        logger=None,
        **keywords,
    )
    return n.train()


@pytest.mark.parametrize("check_divergence", [True, False])
def test_pruning_a_member_leaves_the_others_bitwise_equal(check_divergence):
    def population():
        return nitro.Population(
            Digits(max_epochs=2, **SMALL),
            learning_rate=[1e-3, 3e-3, 1e-2],
            check_divergence=check_divergence,
            progress=False,
        )

    plain = population().train()
    pruned = population()
    pruned.train(steps=20)  # mid-epoch
    frozen = _weights(pruned, 1)
    pruned.stop(1)
    pruned.train()
    assert pruned.stopped == {1: "stopped by pop.stop(1)"}
    for index in (0, 2):
        for a, b in zip(_weights(pruned, index), _weights(plain, index), strict=True):
            np.testing.assert_array_equal(a, b)
        np.testing.assert_array_equal(
            pruned.history().loc[index]["val_loss"], plain.history().loc[index]["val_loss"]
        )
    # the pruned member's variables stay as they were when it stopped
    for a, b in zip(_weights(pruned, 1), frozen, strict=True):
        np.testing.assert_array_equal(a, b)
    assert pruned.history().loc[1]["stopped"].iloc[-1] == "stopped by pop.stop(1)"
    assert pruned.best("val_loss").given_keywords["learning_rate"] != 3e-3


class _Rows:
    def __init__(self):
        self.rows = []

    def member_rows(self, rows):
        self.rows.append([(row["member"], row["epoch"], row["step"]) for row in rows])


def test_a_pruned_member_s_epoch_step_and_record_freeze_at_its_stop():
    shown = _Rows()
    pop = nitro.Population(
        Digits(max_epochs=3, **SMALL), learning_rate=[1e-3, 1e-2], progress=shown
    )
    pop.train(steps=20)  # mid-epoch 1 (39 steps an epoch)
    pop.stop(1)
    pop.train()
    assert pop.stopped_at == {1: 20} and (pop.epoch, pop.step) == (3, 117)
    history = pop.history()
    # its last row is the epoch it stopped in, at the step it stopped on; then no more
    assert history.loc[1].index.tolist() == [1] and history.loc[0].index.tolist() == [1, 2, 3]
    assert history.loc[(1, 1), "step"] == 20 and history.loc[(0, 1), "step"] == 39
    assert history.loc[(1, 1), "stopped"] == "stopped by pop.stop(1)"
    # what the reporters were shown: the stopped member's epoch never moved on
    assert shown.rows == [[(0, 1, 39), (1, 1, 20)], [(0, 2, 78)], [(0, 3, 117)]]
    # its logger's lines end at the stop, too
    logged = [
        json.loads(line)
        for line in (Path(pop.run_dir) / "member-1" / "metrics.jsonl").read_text().splitlines()
    ]
    assert max(line.get("epoch", 0) for line in logged) == 1
    assert "at epoch 1, step 20" in pop.member(1).weights_origin


def test_stop_refuses_a_member_out_of_range():
    pop = nitro.Population(Digits(max_epochs=1, **SMALL), seed=[0, 1], progress=False)
    with pytest.raises(IndexError, match="member 2 of a population of 2"):
        pop.stop(2)
    with pytest.raises(TypeError, match="member index"):
        pop.stop("1")  # type: ignore[arg-type]


def test_every_member_pruned_ends_the_run_and_train_says_so():
    pop = nitro.Population(Digits(max_epochs=2, **SMALL), seed=[0, 1], progress=False)
    pop.stop(0).stop(1)
    with pytest.raises(nitro.PopulationError, match="every member of this population has stopped"):
        pop.train()
    assert pop.step == 0


def test_members_of_other_seeds_read_their_own_data_order_and_equal_their_seeds_alone():
    pop = nitro.Population(Digits(max_epochs=2, **SMALL), seed=[0, 1], progress=False)
    assert pop.batches == "own"  # the seeds differ: each member reads its seed's order
    pop.train()
    shared = nitro.Population(
        Digits(max_epochs=2, **SMALL), seed=[0, 1], batches="shared", progress=False
    ).train()
    assert nitro.Population(Digits(), learning_rate=[1e-3, 1e-2]).batches == "shared"
    for index, seed in enumerate((0, 1)):
        solo = _alone(2, seed=seed)
        np.testing.assert_allclose(
            pop.history().loc[index]["val_loss"], solo.history()["val_loss"], rtol=0, atol=1e-6
        )
    # seed 1's own order is not seed 0's: on shared batches member 1 trains otherwise
    assert not np.allclose(
        pop.history().loc[1]["loss"], shared.history().loc[1]["loss"], rtol=0, atol=1e-6
    )
    with pytest.raises(nitro.PopulationError, match="batches='mine'.*'shared'.*'own'"):
        nitro.Population(Digits(), seed=[0, 1], batches="mine")


def test_accumulation_in_a_population_equals_each_member_alone():
    pop = nitro.Population(
        Digits(max_epochs=2, **SMALL), learning_rate=[1e-3, 1e-2], accum=2, progress=False
    ).train()
    for index, lr in enumerate((1e-3, 1e-2)):
        solo = _alone(2, learning_rate=lr, accum=2)
        mine = pop.history().loc[index]
        np.testing.assert_allclose(mine["val_loss"], solo.history()["val_loss"], rtol=0, atol=1e-6)
        assert mine["step"].tolist() == solo.history()["step"].tolist()  # 20 updates an epoch


def test_early_stopping_stops_each_member_as_it_would_alone():
    stop = nitro.EarlyStopping(patience=1)
    pop = nitro.Population(
        Digits(max_epochs=6, **SMALL), learning_rate=[1e-3, 0.5], early_stop=stop, progress=False
    ).train()
    solo = _alone(6, learning_rate=0.5, early_stop=stop)
    assert solo.stop_reason == "early_stop"
    assert set(pop.stopped) == {1}
    assert pop.stopped[1].startswith(f"early stop at epoch {solo.epoch}: val_loss")
    assert 0 not in pop.stopped and pop.epoch == 6  # the slow learner trains on
    np.testing.assert_allclose(
        pop.history().loc[1]["val_loss"].iloc[: solo.epoch],
        solo.history()["val_loss"],
        rtol=0,
        atol=1e-6,
    )


def test_training_in_steps_equals_training_straight():
    straight = nitro.Population(
        Digits(max_epochs=2, **SMALL), learning_rate=[1e-3, 1e-2], progress=False
    ).train()
    pieces = nitro.Population(
        Digits(max_epochs=2, **SMALL), learning_rate=[1e-3, 1e-2], progress=False
    )
    pieces.train(steps=7)
    assert (pieces.step, pieces.epoch) == (7, 0)
    pieces.train(steps=50)  # across the epoch's end
    assert (pieces.step, pieces.epoch) == (57, 1)
    pieces.train()
    assert (pieces.step, pieces.epoch) == (straight.step, 2)
    for index in (0, 1):
        for a, b in zip(_weights(pieces, index), _weights(straight, index), strict=True):
            np.testing.assert_array_equal(a, b)


class _Recorder:
    def __init__(self):
        self.steps, self.rows, self.calls = [], [], []
        self.first_call = threading.Event()
        self.release = threading.Event()

    def start_run(self, pop, target):
        self.calls.append(("start_run", target))

    def member_steps(self, first, losses):
        self.steps.append((first, np.array(losses)))
        self.first_call.set()
        self.release.wait(60)

    def member_rows(self, rows):
        self.rows.append(list(rows))

    def end_run(self, pop):
        self.calls.append(("end_run", pop.stop_reason))


def test_a_background_run_reports_every_members_steps_and_rows_and_prunes_live():
    recorder = _Recorder()
    pop = nitro.Population(
        Digits(max_epochs=2, **SMALL),
        learning_rate=[1e-3, 1e-2, 3e-2],
        steps_per_dispatch=1,
        progress=recorder,
    )
    pop.train(background=True)
    assert recorder.first_call.wait(120)
    assert pop.running and pop.background
    pop.stop(2)  # while it trains: taken between two calls
    recorder.release.set()
    pop.wait()
    assert not pop.running and pop.stop_reason == "completed"
    assert recorder.calls == [("start_run", 2), ("end_run", "completed")]
    firsts = [first for first, _ in recorder.steps]
    assert firsts == list(range(1, pop.step + 1))  # one event per call, steps from 1
    assert all(losses.shape == (3, 1) for _, losses in recorder.steps)
    stopped_at = next(first for first, losses in recorder.steps if np.isnan(losses[2, 0]))
    assert all(np.isnan(losses[2, 0]) for first, losses in recorder.steps if first >= stopped_at)
    assert all(np.isfinite(losses[:2]).all() for _, losses in recorder.steps)
    assert len(recorder.rows) == 2
    assert [row["member"] for row in recorder.rows[0]] == [0, 1, 2]
    assert recorder.rows[0][2]["learning_rate"] == 3e-2
    assert recorder.rows[0][2]["stopped"].startswith("stopped by pop.stop(2)")
    assert recorder.rows[0][2]["step"] == pop.stopped_at[2] == stopped_at - 1
    assert [row["member"] for row in recorder.rows[1]] == [0, 1]  # its record has ended


def test_one_compile_for_eight_members_counted_by_jax(fresh_cache):
    compiled = []

    def listen(event, duration, **kwargs):
        if event == "/jax/core/compile/backend_compile_duration":
            compiled.append(kwargs.get("fun_name"))

    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        pop = nitro.Population(
            Digits(max_epochs=2, **SMALL),
            learning_rate=[1e-3, 3e-3, 1e-2, 3e-2],
            seed=[0, 1],
            steps_per_dispatch=13,  # divides the epoch's 39 steps: one program per call
            progress=False,
        )
        pop.train()
    finally:
        jax.monitoring.unregister_event_duration_listener(listen)
    assert len(pop) == 8
    assert compiled.count("jit(population_train_step)") == 1
    assert compiled.count("jit(population_eval_forward)") == 1
    stats = nitro.cache_stats()
    assert [p["kind"] for p in stats.programs].count("population train step") == 1


@nitro.experiment
class _FineTune(Digits):
    def param_group(self, path):
        return "backbone" if path.startswith("hidden") else "head"


def test_parameter_groups_and_a_moving_average_per_member_equal_each_alone():
    groups = [{"backbone": 0.1}, {"backbone": 1.0}]
    pop = nitro.Population(
        _FineTune(max_epochs=2, **SMALL), group_lr=groups, ema=0.9, progress=False
    ).train()
    for index, group_lr in enumerate(groups):
        solo = nitro.Nitro(
            _FineTune(max_epochs=2, **SMALL),
            group_lr=group_lr,
            ema=0.9,
            progress=False,
            checkpointer=None,
            logger=None,
        ).train()
        np.testing.assert_allclose(
            pop.history().loc[index]["val_loss"], solo.history()["val_loss"], rtol=0, atol=1e-6
        )


def test_predict_gives_every_members_outputs_from_one_program(fresh_cache):
    from sklearn.datasets import load_digits

    x = (load_digits().data[:50] / 16.0).astype(np.float32)
    pop = nitro.Population(
        Digits(max_epochs=1, **SMALL), learning_rate=[1e-3, 1e-2, 3e-2], progress=False
    ).train()
    outputs = pop.predict({"x": x})
    assert outputs.shape == (3, 50, 10)
    for index in range(3):
        alone = pop.member(index).predict({"x": x})
        np.testing.assert_allclose(outputs[index], alone, rtol=0, atol=1e-5)
    kinds = [p["kind"] for p in nitro.cache_stats().programs]
    assert kinds.count("population eval forward") == 2  # validation's, and predict's width
    assert pop.evaluate("val").shape[0] == 3
    with pytest.raises(TypeError, match="dict of batch fields"):
        pop.predict(x)  # type: ignore[arg-type]


def test_a_training_population_refuses_what_would_read_its_donated_state():
    recorder = _Recorder()
    pop = nitro.Population(
        Digits(max_epochs=2, **SMALL), learning_rate=[1e-3, 1e-2], progress=recorder
    )
    pop.train(background=True)
    assert recorder.first_call.wait(120)
    try:
        for call in (pop.train, pop.validate, lambda: pop.member(0)):
            with pytest.raises(nitro.RunningError, match=r"pop\.stop\(\) stops it"):
                call()
    finally:
        recorder.release.set()
        pop.wait()
    assert pop.member(0).validate()["val_loss"] > 0  # idle again: it takes a member
