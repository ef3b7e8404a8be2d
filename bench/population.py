"""Population runs: 8 members trained by one vmapped program against 8 sequential Nitro runs
and against one run.

Models (`--models`): the digits MLPs of bench/dispatch.py (`small`, `medium`), and the CNN
and the transformer LM of bench/peers.py (`cnn`: digits as 8x8x1 images, batch 128; `lm`: the
generated token sequences, batch 32).

For each model, in one process, alternating rounds, medians of the seconds one epoch takes
(compiles excluded: every program is warmed by an epoch first, and trained on until its
`steps_per_dispatch="auto"` has decided):

- one run: `nitro.Nitro(e)` with its defaults (`steps_per_dispatch="auto"`);
- 8 sequential runs: 8 handles at 8 learning rates, one epoch each, one after another (they
  share one compiled program);
- a population: `nitro.Population(e, learning_rate=[8 values])`, one epoch of all 8, and the
  same population with the other member axis (`vectorize=`: vmapped, or each member's step
  unrolled in the program) than its default `"auto"` picked;
- 8 sequential Keras 3 `fit` runs (the JAX backend, one model each), when keras is installed.

`--spike` adds the same population under `spike=nitro.Spike(rtol=1e6)` at the steps per
call the population chose (its calls keep their input variables, not donated, to roll a
spiking member back; only a non-finite loss spikes, so no member rolls back), timed in the
same alternating rounds: what keeping the input costs against the population without it, in
wall time and in the process's CPU time (which other work on the machine moves less).

`--n-devs D` runs the population on a mesh of D devices (on CPU, D fake devices over the
same cores: XLA_FLAGS is set before JAX starts), its members split across the devices
(`--mesh-axis members`) or each batch (`--mesh-axis batch`).

Printed: seconds per epoch, the population's time against one run's (8 members for the cost
of that many runs) and the sequential runs' against the population's, and members x epochs
per second. Ratios only mean something within one process on one machine: other work on it
moves every figure.

    python bench/population.py [--rounds 5] [--members 8] [--tile 4] [--models small,cnn,lm]
                               [--n-devs 2 --mesh-axis members|batch] [--spike]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))
os.environ.setdefault("KERAS_BACKEND", "jax")  # before anything imports keras
if "--n-devs" in sys.argv:  # fake CPU devices: only before JAX starts
    _devices = sys.argv[sys.argv.index("--n-devs") + 1]
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={_devices}"
    )

import jax  # noqa: E402
from dispatch import MODELS as DIGITS  # noqa: E402
from loops import WithNitro, experiment_for, keras_loop  # noqa: E402
from overhead import train_arrays  # noqa: E402
from peers import MODELS as PEERS  # noqa: E402

import nitro  # noqa: E402

# name -> (spec, its train arrays for `--tile T`)
MODELS = {
    **{name: (spec, train_arrays) for name, spec in DIGITS.items()},
    "cnn": (PEERS["cnn"][0], train_arrays),  # with its Keras twin
    "lm": PEERS["lm"][:2],  # `--tile` x 256 generated token sequences
}


def rates(members: int) -> list[float]:
    """`members` learning rates on a log grid from 1e-4 to 1e-2."""
    if members == 1:
        return [1e-3]
    return [float(10 ** (-4 + 2 * i / (members - 1))) for i in range(members)]


def settle(train, choice, most: int = 60) -> None:
    """Train an epoch at a time until the dispatch `choice()` has decided (at most `most`)."""
    for _ in range(most):
        decided = choice()
        if decided is None or not (decided.probing or decided.checking):
            return
        train()


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def bench_model(
    name: str,
    members: int,
    rounds: int,
    tile: int,
    n_devs: int = 1,
    mesh_axis: str = "members",
    spike: bool = False,
) -> None:
    nitro.cache_reset()  # count this model's programs alone
    spec, data = MODELS[name]
    arrays = data(tile)
    one = WithNitro(spec, arrays)
    sequential = [WithNitro(spec, arrays, learning_rate=lr) for lr in rates(members)]

    def make(**keywords):
        return nitro.Population(
            experiment_for(spec, arrays),
            learning_rate=rates(members),
            progress=False,
            n_devs=n_devs,
            mesh_axis=mesh_axis,
            **keywords,
        )

    population = make()
    other = make(vectorize=not population.vectorized)  # the member axis "auto" did not pick
    keras = [keras_loop(spec, arrays) for _ in range(members)]
    keras = [k for k in keras if k is not None]
    # warm every program with one epoch each, and train on until "auto" has decided: the
    # rounds time what a run settles at (the measurement's own cost is bounded apart, a
    # share of the run's work: docs/performance.md)
    one.run(1)
    for run in sequential:
        run.run(1)
    population.train(epochs=1)
    other.train(epochs=1)
    settle(lambda: one.run(1), lambda: one.handle.dispatch)
    settle(lambda: population.train(epochs=1), lambda: getattr(population, "dispatch", None))
    settle(lambda: other.train(epochs=1), lambda: getattr(other, "dispatch", None))
    spiked = None  # `--spike`: the same population, each call's input kept for a roll-back
    if spike:  # at the steps per call the population chose: the same calls, timed
        spiked = make(
            steps_per_dispatch=population.steps_per_call or 1,
            vectorize=population.vectorized,
            spike=nitro.Spike(rtol=1e6),  # only a non-finite loss spikes: no roll-back
        )
        spiked.train(epochs=1)
    for run in keras:
        run.run(1)
    times: dict[str, list[float]] = {"one": [], "sequential": [], "population": [], "other": []}
    if keras:
        times["keras"] = []
    if spiked is not None:
        times["spike"] = []
    cpu: dict[str, list[float]] = {"population": [], "spike": []}  # `--spike`: CPU seconds

    def both(key: str, train) -> None:
        """One epoch of `train`, its wall time into `times` and, under `--spike`, the
        process's CPU time into `cpu` (less moved by other work on the machine)."""
        begin = time.process_time()
        times[key].append(timed(train))
        cpu[key].append(time.process_time() - begin)

    for _ in range(rounds):
        times["one"].append(timed(lambda: one.run(1)))
        times["sequential"].append(timed(lambda: [run.run(1) for run in sequential]))
        both("population", lambda: population.train(epochs=1))
        times["other"].append(timed(lambda: other.train(epochs=1)))
        if keras:
            times["keras"].append(timed(lambda: [run.run(1) for run in keras]))
        if spiked is not None:
            both("spike", lambda: spiked.train(epochs=1))
    median = {k: statistics.median(v) for k, v in times.items()}
    batches = one.batches
    placed = f", on {n_devs} devices by {mesh_axis}" if n_devs > 1 else ""
    print(
        f"\n{spec.description}: {batches} steps an epoch, {members} members, {rounds} rounds"
        f"{placed}"
    )
    shape = "vmapped" if population.vectorized else "unrolled"
    print(
        f"  steps per call: one run {one.handle.dispatch.steps}, "
        f"population {population.steps_per_call} (members {shape}: vectorize='auto')"
    )
    for key, label in (
        ("one", "one run"),
        ("sequential", f"{members} sequential Nitro runs"),
        ("population", f"population of {members}"),
        ("other", f"  {'vmapped' if other.vectorized else 'unrolled'} instead"),
        ("keras", f"{members} sequential Keras fits"),
        ("spike", "population, spike="),
    ):
        if key not in median:
            continue
        runs = 1 if key == "one" else members
        print(
            f"  {label:<28} {median[key] * 1e3:8.1f} ms an epoch, "
            f"{runs / median[key]:7.1f} member-epochs/s"
        )
    print(
        f"  population / one run: {median['population'] / median['one']:.2f}x the time for "
        f"{members} members"
    )
    print(
        f"  sequential / population: {median['sequential'] / median['population']:.2f}x "
        f"(the population's speed-up over {members} runs one after another)"
    )
    print(
        f"  {'vmapped' if other.vectorized else 'unrolled'} / {shape}: "
        f"{median['other'] / median['population']:.2f}x the time"
    )
    if "keras" in median:
        print(f"  Keras sequential / population: {median['keras'] / median['population']:.2f}x")
    if spiked is not None:
        size = sum(x.nbytes for x in jax.tree.leaves(one.handle.state.variables))
        used = {k: statistics.median(v) for k, v in cpu.items()}
        print(
            f"  spike= / population: {median['spike'] / median['population']:.3f}x the time, "
            f"{used['spike'] / used['population']:.3f}x the CPU time "
            f"(steps per call {spiked.steps_per_call}; each call's input kept, not donated: "
            f"{members * size / 2**20:.2f} MiB of variables with the optimizer state; "
            f"roll-backs taken: {len(spiked.skipped_batches())} batches)"
        )
    kinds = [p["kind"] for p in nitro.cache_stats().programs]
    print(
        f"  population train-step programs compiled: {kinds.count('population train step')} "
        f"(both populations)"
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--members", type=int, default=8)
    parser.add_argument("--tile", type=int, default=4, help="data size multiplier")
    parser.add_argument("--models", default="small", help="of " + ",".join(MODELS))
    parser.add_argument("--n-devs", type=int, default=1, help="devices of the population's mesh")
    parser.add_argument("--mesh-axis", default="members", choices=("members", "batch"))
    parser.add_argument(
        "--spike", action="store_true", help="also time the population under spike=nitro.Spike()"
    )
    args = parser.parse_args(argv)
    unknown = [name for name in args.models.split(",") if name not in MODELS]
    if unknown:
        parser.error(f"--models: unknown {', '.join(unknown)}; choose from {', '.join(MODELS)}")
    for name in args.models.split(","):
        bench_model(
            name, args.members, args.rounds, args.tile, args.n_devs, args.mesh_axis, args.spike
        )


if __name__ == "__main__":
    main()
