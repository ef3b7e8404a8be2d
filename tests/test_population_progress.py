"""What a population shows outside a notebook: a line per epoch naming its best member and how
many members still train, a tqdm bar over each epoch's steps on a terminal, and the factory a
notebook extension installs for populations."""

from __future__ import annotations

import io
import re

import pytest
from toys import ToyWithMetrics

import nitro
from nitro.progress import LineReporter, TqdmReporter, ranked_members


def _population(progress, **shared):
    return nitro.Population(
        ToyWithMetrics(max_epochs=2),
        learning_rate=[1e-3, 3e-2, 1e-1],
        progress=progress,
        **shared,
    )


def _best_by_val_loss(pop, epoch: int) -> int:
    rows = pop.history().xs(epoch, level="epoch")
    return int(rows["val_loss"].idxmin())


def test_the_default_reporter_prints_a_line_per_epoch_with_the_best_member(capsys):
    pop = _population(True)
    assert type(pop.reporter) is LineReporter  # captured output is not a terminal
    pop.train()
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("epoch")]
    assert len(lines) == 2
    for epoch, line in enumerate(lines, start=1):
        best = _best_by_val_loss(pop, epoch)
        rate = pop.members[best]["learning_rate"]
        assert re.match(
            rf"epoch {epoch}/2  best member {best} \(learning_rate={rate:g}\): loss [\d.]+  "
            rf"val_loss [\d.]+  val_acc [\d.]+  3 of 3 members training  \([\d.]+ s\)$",
            line,
        ), line


def test_a_pruned_member_is_counted_out_and_never_named_best(capsys):
    pop = _population("lines")
    pop.train(epochs=1)
    best = _best_by_val_loss(pop, 1)
    pop.stop(best)
    capsys.readouterr()
    pop.train(epochs=1)
    (line,) = [x for x in capsys.readouterr().err.splitlines() if x.startswith("epoch")]
    assert "2 of 3 members training" in line
    assert f"best member {best} " not in line


def test_on_a_terminal_a_bar_runs_over_the_epoch_s_steps():
    stream = io.StringIO()
    pop = _population(TqdmReporter(stream=stream, min_interval=0.0), steps_per_dispatch=1)
    pop.train()
    shown = stream.getvalue()
    assert "epoch 1/2:" in shown and "epoch 2/2:" in shown  # the bar of each epoch
    assert re.search(r"4/4 \[.*best loss [\d.]+", shown)  # its steps, the best step loss
    assert re.search(r"\repoch 2/2  best member \d", shown)  # the line that ends the bar


def test_a_population_factory_is_installed_apart_from_the_runs():
    made = []

    def factory():
        made.append(LineReporter())
        return made[-1]

    nitro.progress.set_default_factory(factory, population=True)
    try:
        pop = _population(True)
        run = nitro.Nitro(ToyWithMetrics(), checkpointer=None, logger=None)
    finally:
        nitro.progress.set_default_factory(None, population=True)
    assert made == [pop.reporter] and run.reporter is not pop.reporter
    assert type(_population(True).reporter) is LineReporter  # the default again


def test_members_rank_by_val_loss_else_loss_and_unfinite_values_go_last():
    rows = [
        {"member": 0, "loss": 0.3, "val_loss": float("nan")},
        {"member": 1, "loss": 0.2, "val_loss": 0.5},
        {"member": 2, "loss": 0.9, "val_loss": 0.4},
    ]
    metric, order = ranked_members(rows)
    assert metric == "val_loss" and [r["member"] for r in order] == [2, 1, 0]
    metric, order = ranked_members([{k: v for k, v in r.items() if k != "val_loss"} for r in rows])
    assert metric == "loss" and [r["member"] for r in order] == [1, 0, 2]
    metric, order = ranked_members([{**r, "val_acc": r["member"] / 10} for r in rows], "val_acc")
    assert [r["member"] for r in order] == [2, 1, 0]  # "max" for a metric not named like a loss
    with pytest.raises(ValueError, match="mode must be 'min' or 'max', got 'lowest'"):
        ranked_members(rows, mode="lowest")
