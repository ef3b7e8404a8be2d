"""The curves a run and a population draw, read off the real matplotlib figures: whole-number
ticks, legends clear of the data, edit labels inside the figure, axes that stay readable when
one member diverges, a population's metrics plotted per member as a run's are."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("matplotlib")

from matplotlib.text import Text  # noqa: E402

from nitro_ipython.curves import CurveData, CurveFigure  # noqa: E402


def _run(epochs: int, steps_per_epoch: int = 20) -> CurveData:
    data = CurveData()
    for step in range(1, epochs * steps_per_epoch + 1):
        data.add_step(step, 2.0 / step**0.5)
        if step % steps_per_epoch == 0:
            epoch = step // steps_per_epoch
            data.add_row(
                {"epoch": epoch, "step": step, "loss": 2.0 / epoch, "val_loss": 2.1 / epoch}
                | {"acc": 1 - 0.5 / epoch, "val_acc": 1 - 0.6 / epoch}
            )
    return data


def _inside(inner, outer, slack: float = 0.5) -> bool:
    return (
        inner.x0 >= outer.x0 - slack
        and inner.y0 >= outer.y0 - slack
        and inner.x1 <= outer.x1 + slack
        and inner.y1 <= outer.y1 + slack
    )


def _points(ax) -> np.ndarray:
    """Every plotted point of `ax`'s curves, in display pixels."""
    xy = [np.column_stack(line.get_data()) for line in ax.get_lines() if len(line.get_xdata())]
    return ax.transData.transform(np.concatenate(xy).astype(float))


def test_a_one_epoch_run_ticks_whole_epochs_and_steps_only():
    figure = CurveFigure()
    assert figure.png(_run(epochs=1)) is not None
    loss, acc = figure.figure.axes
    for ax in (loss, acc):
        ticks = [t for t in ax.get_xticks() if ax.get_xlim()[0] <= t <= ax.get_xlim()[1]]
        assert ticks and all(float(t).is_integer() for t in ticks), ticks
    assert 1.0 in acc.get_xticks()


def test_the_legends_sit_above_the_plots_clear_of_every_point():
    figure = CurveFigure()
    figure.png(_run(epochs=6))
    for ax in figure.figure.axes:
        legend, box = ax.get_legend(), ax.get_window_extent()
        extent = legend.get_window_extent()
        assert extent.y0 >= box.y1 - 1  # above the plot area, where no point is drawn
        assert _inside(extent, figure.figure.bbox)
        assert not any(extent.contains(x, y) for x, y in _points(ax))
        (title,) = [
            t
            for t in ax.get_children()
            if isinstance(t, Text) and t.get_text() == ax.get_title("left")
        ]
        assert title.get_window_extent().x1 <= extent.x0  # the title left, the legend right


def test_an_edit_at_the_last_step_is_labelled_inside_the_plot_and_clear_of_the_legend():
    data = _run(epochs=4)
    data.add_marker({"step": 3, "changed": ["loss"], "status": "swapped"})
    data.add_marker({"step": 80, "changed": ["metrics"], "status": "swapped"})
    figure = CurveFigure()
    figure.png(data)
    loss = figure.figure.axes[0]
    labels = [t for t in loss.texts if "edit:" in t.get_text()]
    assert [t.get_text().strip() for t in labels] == ["edit: loss", "edit: metrics"]
    legend = loss.get_legend().get_window_extent()
    for label in labels:
        extent = label.get_window_extent()
        assert _inside(extent, loss.get_window_extent()), label.get_text()
        assert not extent.overlaps(legend)
    early, late = labels
    assert early.get_horizontalalignment() == "left" and late.get_horizontalalignment() == "right"


def _population(diverged: int | None, members: int = 6, steps: int = 200) -> CurveData:
    curves = CurveData(members)
    rng = np.random.default_rng(0)
    t = np.arange(1, steps + 1)
    losses = np.stack([2.3 * (1 + m / 10) / t**0.3 for m in range(members)])
    losses += rng.uniform(0, 0.02, losses.shape)
    if diverged is not None:
        losses[diverged] = 2.3 * np.exp(t / 19)  # to about 83,000 at the last step
    curves.add_steps(1, losses)
    return curves


def test_a_diverged_member_leaves_the_population_plot_readable_and_is_named_above_it():
    labels = [f"learning_rate={lr:g}" for lr in (1e-4, 3e-4, 1e-3, 3e-3, 1e-2, 3)]
    calm = CurveFigure(labels)
    calm.png(_population(diverged=None))
    wild = CurveFigure(labels)
    wild.png(_population(diverged=5))
    (calm_ax,) = [ax for ax in calm.figure.axes if ax.get_lines()]
    (wild_ax,) = [ax for ax in wild.figure.axes if ax.get_lines()]
    low, high = wild_ax.get_ylim()
    assert high < 10  # not 83,000: the others' range, where their curves can be read
    assert high == pytest.approx(calm_ax.get_ylim()[1], rel=0.2)
    assert low == pytest.approx(calm_ax.get_ylim()[0], abs=0.2)
    said = " ".join(t.get_text() for t in wild_ax.texts)
    assert "member 5" in said and "above the plot" in said
    assert not any("above the plot" in t.get_text() for t in calm_ax.texts)


def test_a_population_plots_each_metric_per_member_beside_its_loss_as_a_run_does():
    """A run's metric plots (acc with val_acc by epoch) work for a population: one curve per
    member in its colour, keyed by kind above the plot, and a last plot naming the members."""
    labels = ["learning_rate=0.001", "learning_rate=0.01", "learning_rate=0.1"]
    data = CurveData(len(labels))
    data.add_steps(1, np.linspace(2.0, 0.5, 3 * 40).reshape(3, 40))
    for epoch in (1, 2):
        for member in range(3):
            acc = 0.5 + 0.1 * epoch + 0.05 * member
            row = {"epoch": epoch, "step": 20 * epoch, "loss": 1.0, "val_loss": 1.1}
            data.add_row(row | {"acc": acc, "val_acc": acc - 0.02}, member)
    data.add_row({"epoch": 3, "step": 40, "val_loss": 0.9, "stopped": "pruned"}, 1)
    data.add_row({"epoch": 4, "step": 60, "val_loss": 0.8}, 1)  # after its stop: not drawn
    figure = CurveFigure(labels)
    images = figure.pngs(data)
    loss, acc, members = figure.figure.axes
    assert len(images) == 3 and figure.css_width == 3 * 380
    assert acc.get_title("left") == "acc" and members.get_title("left") == "members"
    colours = {line.get_color() for line in acc.get_lines() if len(line.get_xdata())}
    assert len(colours) == 3  # each member's acc and val_acc, in its colour
    assert len([line for line in acc.get_lines() if len(line.get_xdata()) == 2]) == 6
    shown = [t.get_text() for t in acc.get_legend().get_texts()]
    assert shown == ["acc", "val_acc"]  # one key per kind, not per member
    named = [t.get_text() for t in members.get_legend().get_texts()]
    assert named == [f"{i}: {label}" for i, label in enumerate(labels)]
    val = [line for line in loss.get_lines() if line.get_label() == "val_loss"]
    assert [list(line.get_xdata()) for line in val] == [[20, 40], [20, 40, 40], [20, 40]]


def test_each_plot_is_its_own_image_cut_where_no_plot_crosses():
    """The live panel shows one image per plot, wrapping them under each other where it is
    narrow: each image is one plot's slice of the figure, with all of that plot in it."""
    from io import BytesIO

    from PIL import Image

    figure = CurveFigure()
    images = [Image.open(BytesIO(png)) for png in figure.pngs(_run(epochs=3))]
    assert [image.size for image in images] == [(2 * 380, 2 * 230)] * 2
    width = 2 * 380
    for index, ax in enumerate(figure.figure.axes):
        extent = ax.get_tightbbox()  # the plot with its ticks, labels, title and legend
        assert index * width <= extent.x0 and extent.x1 <= (index + 1) * width, index
    whole = np.asarray(Image.open(BytesIO(figure.png(_run(epochs=3)))).convert("RGBA"))
    joined = np.concatenate([np.asarray(image.convert("RGBA")) for image in images], axis=1)
    assert joined.shape == whole.shape
    assert np.abs(joined.astype(int) - whole.astype(int)).mean() < 1  # the same picture


def test_a_rewind_dims_the_abandoned_branch_and_marks_where_the_run_went_back_to():
    data = _run(epochs=3)
    data.rewind({"step": 30, "from_step": 60})
    assert data.steps[-1] == 30 and [r["epoch"] for r in data.rows[0]] == [1]
    ((steps, losses, rows),) = data.branches()
    assert (steps[0], steps[-1], [r["epoch"] for r in rows]) == (31, 60, [2, 3])
    for step in range(31, 41):  # trained on from there
        data.add_step(step, 1.0)
    figure = CurveFigure()
    figure.png(data)
    loss = figure.figure.axes[0]
    dimmed = [line for line in loss.get_lines() if line.get_alpha() == 0.25]
    assert dimmed and max(max(line.get_xdata()) for line in dimmed) == 60
    labels = [t.get_text().strip() for t in loss.texts]
    assert "rewound from 60" in labels


def test_a_population_search_marks_its_exploits_and_rungs_on_the_loss_plot():
    data = CurveData(members=4)
    data.add_steps(1, np.linspace(1.0, 0.5, 40)[None, :] * np.arange(1, 5)[:, None])
    data.add_mark(18, "PBT: 0<-3")
    data.add_mark(36, "halving: 4 -> 2")
    figure = CurveFigure()
    figure.png(data)
    loss = figure.figure.axes[0]
    labels = {t.get_text().strip(): t.get_color() for t in loss.texts}
    assert labels.get("PBT: 0<-3") == labels.get("halving: 4 -> 2") == "#27ae60"


def test_a_forks_parent_is_drawn_dimmed_beneath_it_from_the_fork_step():
    data = _run(epochs=2)
    parent = [{"epoch": 3, "step": 60, "loss": 0.5, "val_loss": 0.55, "acc": 0.9, "val_acc": 0.8}]
    data.overlay(parent)
    data.add_mark(40, "forked from run-a")
    figure = CurveFigure()
    figure.png(data)
    dimmed = [
        line
        for ax in figure.figure.axes
        for line in ax.get_lines()
        if line.get_alpha() == 0.25 and len(line.get_xdata())
    ]
    assert dimmed and {max(line.get_xdata()) for line in dimmed} <= {60, 3}
    assert "forked from run-a" in [t.get_text().strip() for t in figure.figure.axes[0].texts]
