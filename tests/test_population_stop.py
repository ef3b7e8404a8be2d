"""Pruning a member from another thread while a population's run starts."""

from __future__ import annotations

import threading

from toys import ToyWithMetrics

import nitro


class HeldStart:
    """A reporter that holds the run's thread in `start_run` until released: the run has
    started, and has not stacked its members yet."""

    def __init__(self):
        self.started, self.release = threading.Event(), threading.Event()

    def start_run(self, population, target_epoch):
        self.started.set()
        assert self.release.wait(60)


def test_a_member_stopped_before_the_run_stacks_its_members_stops_at_the_first_call():
    held = HeldStart()
    pop = nitro.Population(
        ToyWithMetrics(max_epochs=2), learning_rate=[1e-3, 3e-2, 1e-1], progress=held
    )
    pop.train(background=True)
    assert held.started.wait(60) and pop.running
    pop.stop(1, "pruned at the start")
    held.release.set()
    pop.wait()
    assert pop.stopped == {1: "pruned at the start"} and pop.stopped_at == {1: 0}
    history = pop.history()
    assert history.loc[(0, 2), "val_loss"] != history.loc[(0, 1), "val_loss"]  # trained on
    assert sorted(history.index.get_level_values("member")) == [0, 0, 2, 2]  # 1 never trained


@nitro.experiment
class LossFails(ToyWithMetrics):
    def loss(self, logits, *, y):
        raise RuntimeError("the loss hook failed")


def test_a_population_s_background_run_that_fails_keeps_its_error_as_a_run_does():
    runs = [
        nitro.Nitro(LossFails(max_epochs=1), progress=False, checkpointer=None, logger=None),
        nitro.Population(LossFails(max_epochs=1), learning_rate=[1e-3, 1e-2], progress=False),
    ]
    for run in runs:
        run.train(background=True)
        try:
            run.wait()
        except RuntimeError as error:
            raised = error
        else:
            raise AssertionError("wait() re-raises the run's error")
        assert "the loss hook failed" in str(raised)
        assert run.error is raised and run.phase == "failed" and run.stop_reason == "error"
        assert not run.running and run.step == 0
