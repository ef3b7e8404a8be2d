"""The live panel's gallery: the first validation samples with the current predictions, drawn
by the experiment's `visualize` hook (or the default views) after a validation, on a thread
of its own, within a budget of the run's time.

The training thread only copies the first batch's samples to the host, at a validation, and
only when the gallery will draw them: the drawing thread draws one gallery at a time, and
after a drawing that took `t` seconds it takes no new one for `t / SHARE` seconds (1%: a
drawing of 0.3 s waits 30 s), so its share of the run's time, the time it holds Python's
lock, stays within `SHARE`. A validation that comes earlier is skipped; the gallery says the
step it shows. Its PNG goes into the panel, its stand-in and its static record.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import jax

from nitro.gallery import Roles, Shown, Visualizer, draw_grid

__all__ = ["GalleryRenderer"]

SHARE = 0.01  # the most of the run's wall time drawing the gallery may take
SAMPLES = 16  # samples a gallery shows by default


class GalleryRenderer:
    """Draws galleries on its own thread; `show(png)` receives each (from that thread)."""

    def __init__(
        self,
        show: Callable[[bytes], None],
        say: Callable[[str], None],
        samples: int = SAMPLES,
        share: float | None = None,
    ):
        self.samples, self.share = samples, SHARE if share is None else share
        self._show, self._say = show, say
        self._condition = threading.Condition()
        self._job: tuple | None = None
        self._busy = False
        self._ready_at = 0.0
        self._thread: threading.Thread | None = None
        self._stopping = False
        self.visualizer = Visualizer()
        self.png: bytes | None = None  # the latest gallery
        self.drawn = 0  # galleries drawn
        self.seconds = 0.0  # spent drawing them

    def wants(self) -> bool:
        """Whether a validation now would be drawn (else it is skipped: not even copied)."""
        with self._condition:
            idle = not self._busy and self._job is None and not self._stopping
            return idle and time.monotonic() >= self._ready_at

    def take(self, experiment: Any, hook_fields: Any, samples: Any, title: str) -> None:
        """Copy the first samples of validation's first call (`ValSamples`) to the host and
        have them drawn (the training thread; cheap)."""
        rows = samples.rows()
        count = min(self.samples, rows.rows)
        shown = [
            Shown(
                i,
                {k: v[i] for k, v in rows.fields.items()},
                None if rows.outputs is None else jax.tree.map(lambda a, i=i: a[i], rows.outputs),
                None if rows.losses is None else float(rows.losses[i]),
            )
            for i in range(count)
        ]
        with self._condition:
            self._job = (shown, Roles.of(hook_fields), experiment, title)
            self._condition.notify()
            if self._thread is None:
                self._stopping = False
                self._thread = threading.Thread(target=self._run, name="nitro-gallery", daemon=True)
                self._thread.start()

    def _run(self) -> None:
        while True:
            with self._condition:
                while self._job is None and not self._stopping:
                    self._condition.wait()
                if self._job is None:
                    return
                job, self._job, self._busy = self._job, None, True
            began = time.perf_counter()
            png = None
            try:
                shown, roles, experiment, title = job
                png = draw_grid(
                    shown, roles, title, experiment, self.visualizer, self._say, pyplot=False
                ).png()
            except Exception as error:  # noqa: BLE001 - the gallery never stops a run
                self._say(f"the gallery could not be drawn: {type(error).__name__}: {error}")
            elapsed = time.perf_counter() - began
            if png is not None:
                self.png = png
                self.drawn += 1
                self._show(png)
            with self._condition:
                self.seconds += elapsed
                self._busy = False
                self._ready_at = time.monotonic() + elapsed / self.share
                self._condition.notify_all()

    def stop(self, timeout: float = 60.0) -> None:
        """Finish the drawing under way (a gallery queued is drawn too), then end the thread."""
        with self._condition:
            self._stopping = True
            self._condition.notify_all()
            thread, self._thread = self._thread, None
        if thread is not None:
            thread.join(timeout)
