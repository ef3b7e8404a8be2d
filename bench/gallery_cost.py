"""What the live panel's gallery costs training: steps per second of the digits demo (which
has a `visualize` hook) with the gallery's reporter against without it, the same handle
settings, in alternating calls of `train(epochs=2)` on two live handles (warm: compiled once).

The reporter is the panel's path without a notebook: validation hands it its first call
(`val_samples`), it copies the samples when the gallery will draw them, and
`nitro_ipython.sample_gallery.GalleryRenderer` draws them on its own thread within its share of the
run's time (default 1%). Printed: the median call time each way, their ratio (the cost: at
most 1.02 is the aim), the galleries drawn and the share of the time spent drawing them.

    python bench/gallery_cost.py [--calls 40] [--share 0.01]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time


class GalleryReporter:
    """The panel reporter's gallery path, shown into nothing."""

    def __init__(self, share: float):
        from nitro_ipython.sample_gallery import GalleryRenderer

        self.handle = None
        self.gallery = GalleryRenderer(lambda png: None, print, share=share)

    def start_run(self, handle, target_epoch):
        self.handle = handle

    def val_samples(self, samples):
        handle = self.handle
        if handle is None or samples.split != "val" or not self.gallery.wants():
            return
        title = f"Digits · 'val' · step {handle.step}"
        self.gallery.take(handle.experiment, handle.setup.split("val").hook_fields, samples, title)


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--calls", type=int, default=40)
    parser.add_argument("--share", type=float, default=0.01)
    args = parser.parse_args()

    import matplotlib

    matplotlib.use("Agg")
    import io

    from matplotlib.figure import Figure

    warm = Figure(layout="constrained")  # a panel has drawn its curves: matplotlib is warm
    warm.subplots(2, 2)[0, 0].imshow([[0.0, 1.0]])
    warm.suptitle("warm")
    warm.savefig(io.BytesIO(), format="png")
    import nitro
    from nitro.examples.digits import Digits

    reporter = GalleryReporter(args.share)
    with tempfile.TemporaryDirectory() as root:
        common = {"logger": None, "checkpointer": None}
        handles = {
            "off": nitro.Nitro(Digits(), run_dir=f"{root}/off", progress=False, **common),
            "on": nitro.Nitro(Digits(), run_dir=f"{root}/on", progress=reporter, **common),
        }
        for n in handles.values():
            n.train(epochs=1)  # compile and warm up
        seconds: dict[str, list[float]] = {name: [] for name in handles}
        began = time.perf_counter()
        for call in range(args.calls):
            order = list(handles.items())
            for name, n in order if call % 2 else order[::-1]:  # neither always goes first
                start = time.perf_counter()
                n.train(epochs=2)
                seconds[name].append(time.perf_counter() - start)
        elapsed = time.perf_counter() - began
        reporter.gallery.stop()
    off, on = statistics.median(seconds["off"]), statistics.median(seconds["on"])
    total_off, total_on = sum(seconds["off"]), sum(seconds["on"])
    gallery = reporter.gallery
    print(f"train(epochs=2) on the digits demo, {args.calls} calls on each live handle:")
    print(f"  without the gallery  {off * 1e3:8.2f} ms a call (median), {total_off:.2f} s in all")
    print(f"  with the gallery     {on * 1e3:8.2f} ms a call (median), {total_on:.2f} s in all")
    print(f"  ratio with/without   {total_on / total_off:8.3f}  in all (the aim: at most 1.02)")
    print(
        f"  galleries drawn      {gallery.drawn:8d}  in {gallery.seconds:.2f} s, "
        f"{gallery.seconds / elapsed:.2%} of the {elapsed:.1f} s both handles trained"
    )


if __name__ == "__main__":
    main()
