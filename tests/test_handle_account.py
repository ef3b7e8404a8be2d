"""The handle's own account of itself: the rich display (run, preset, elapsed, groups, batch,
accumulation), the history thinned for a long run with its best epoch marked, and the plot's
best-epoch mark."""

from __future__ import annotations

import re
from html import unescape

import numpy as np
from toys import Toy

import nitro


class Grouped(Toy):
    def param_group(self, path: str) -> str:
        return "hidden" if path.startswith("hidden") else "out"


def shown_html(handle) -> str:
    """What a notebook shows for `handle`: IPython's own formatters' HTML."""
    from IPython.core.formatters import format_display_data

    return format_display_data(handle)[0]["text/html"]


def text(html: str) -> str:
    return " ".join(unescape(re.sub("<[^>]+>", " ", html)).split())


def test_the_display_names_the_run_and_how_it_trains(tmp_path):
    n = nitro.Nitro(Grouped(), run_dir=tmp_path, accum=2, group_lr={"hidden": 0.1}, progress=False)
    n.train()
    shown = text(shown_html(n))
    assert f"run {n.run_id} in {tmp_path}" in shown
    assert "batch size 16" in shown and "accumulation 2 micro-batches a step" in shown
    assert re.search(r"parameter groups hidden \(\d+\), out \(\d+\)", shown)
    assert f"elapsed {n.elapsed:.1f} s" in shown


def test_a_long_history_is_thinned_and_its_best_epoch_marked_in_the_table_and_the_plot():
    n = nitro.Nitro(Toy(max_epochs=15), learning_rate=1.0, checkpointer=None, progress=False)
    n.train()
    history = n.history()
    best = int(history["val_loss"].to_numpy().argmin()) + 1
    assert n.best_by == ("val_loss", "min")
    html = shown_html(n).split("nitro-history", 1)[1]
    assert f"{best} ★ best val_loss" in text(html)
    left_out = [int(k) for k in re.findall(r"\.\.\. (\d+) epochs \.\.\.", text(html))]
    shown = html.count("<tr") - 1 - len(left_out)  # less the header and the gaps' rows
    assert left_out and shown < 15 and sum(left_out) + shown == 15
    figure = n.plot()
    marks = [line for ax in figure.axes for line in ax.lines if line.get_gid() == "best-epoch"]
    assert marks and all(np.asarray(line.get_xdata()).tolist() == [best, best] for line in marks)
