"""Where a step's time goes: `n.profile()` of the digits demo, of the transformer language model
of `bench/peers.py`, and of the digits demo fed by a slow source.

Each handle first trains a few epochs as users run it (compiles, `steps_per_dispatch="auto"`
deciding its K), then `n.profile(steps=N)` trains N more under `jax.profiler` and the script
prints its report: a call's parts (waiting for data, host-side Python, the device program, the
readback), each program's FLOPs, memory and FLOP/s against the device's peak, and the advice
for the part that dominates. Run directories (and the traces) go to a temporary directory
unless `--keep DIR`.

    python bench/step_profile.py [--models digits,lm,slow] [--steps 40] [--keep DIR]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(__file__))

import jax  # noqa: E402
from loops import WithNitro  # noqa: E402
from peers import MODELS  # noqa: E402

import nitro  # noqa: E402
from nitro.examples.digits import Digits  # noqa: E402


@nitro.experiment
class SlowDigits(Digits):
    """The digits demo, its batches built by a source that takes `delay` seconds each."""

    delay: float = 0.002

    def build_data(self):
        splits = super().build_data()
        splits["train"] = Slow(splits["train"], self.delay)
        return splits


class Slow:
    """A source that waits `delay` seconds before each batch of `source`."""

    def __init__(self, source, delay: float):
        self.source, self.delay = source, delay

    def __len__(self):
        return len(self.source)

    def __iter__(self):
        for batch in self.source:
            time.sleep(self.delay)
            yield batch


def handle_for(name: str) -> tuple[nitro.Nitro, int]:
    """A handle for model `name` and the epochs to train before profiling it."""
    if name == "digits":
        return nitro.Nitro(Digits(), seed=0, progress=False), 5
    if name == "slow":
        return nitro.Nitro(SlowDigits(), seed=0, progress=False, prefetch="inline"), 2
    spec, data, _ = MODELS[name]
    return WithNitro(spec, data(1), lean=False).handle, 4


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="digits,lm,slow")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--keep", help="write the run directories (and traces) here")
    args = parser.parse_args(argv)
    device = jax.devices()[0]
    print(
        f"bench/step_profile.py: jax {jax.__version__} on {device.platform} ({device.device_kind}), "
        f"{os.cpu_count()} cpus, load average {os.getloadavg()[0]:.1f}\n"
    )
    with contextlib.ExitStack() as stack:
        where = args.keep or stack.enter_context(tempfile.TemporaryDirectory())
        os.makedirs(where, exist_ok=True)
        stack.enter_context(contextlib.chdir(where))
        for name in args.models.split(","):
            handle, epochs = handle_for(name)
            handle.train(epochs=epochs)
            print(f"--- {name}: after {epochs} epochs, steps per call {handle.dispatch.describe()}")
            print(
                handle.history()[["epoch_seconds", "data_wait_frac", "host_ms", "device_ms"]]
                .tail(2)
                .round(3)
                .to_string()
            )
            print(handle.profile(steps=args.steps))
            print()
            handle.close()


if __name__ == "__main__":
    main()
