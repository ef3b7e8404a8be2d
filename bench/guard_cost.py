"""What a divergence guard costs inside a fused program, outside Nitro: a hand-written `lax.scan`
of K Adam steps of the tiny MLP (64-64-10, batch 32), params and optimizer state donated, in
these forms:

- unguarded: no check at all (XLA drops an unused finiteness check, so this is the ceiling);
- checked: the finiteness of the loss and gradients reduced and carried, nothing kept (what a
  guard cannot do without: the floor of any guard);
- select: a select of every leaf each step (what `nitro.optim.guard.keep` does, Nitro's rule);
- cond: a `lax.cond` around the update;
- pipelined: a `lax.while_loop` that applies a step's update only once its gradient was found
  finite (the gradient carried into the next iteration, which also computes the next step's),
  ending at the first non-finite step, one select a call at the end;
- optimistic: every step unguarded, one select a call at the end against the call's input
  (a divergence would then rerun the call's good steps one at a time).

Prints microseconds a step (medians of alternating rounds) and each compiled program's counts of
fusions, copies and selects, from `compiled.as_text()`: the select each step makes XLA copy the
optimizer moments at the top of each iteration, because it needs their old values beside the
new.

`--nitro` measures Nitro itself instead: live handles of the same MLP on the tiled digits, each
round one `train(epochs=2)` per handle at `--steps` steps per call, alternating, as steps/s
over a handle with `check_divergence=False`:

- restored by the loop (Nitro's default for fused calls of a model under
  `nitro.engine.loop.RESTORE_BYTES`): the program checks each step and keeps nothing, over
  variables it does not donate; at a non-finite step the loop goes back to the call's input;
- a select per step (what Nitro does above that size, and for one step per call).

    python bench/guard_cost.py [--steps 8] [--rounds 15] [--nitro]
"""

from __future__ import annotations

import argparse
import collections
import functools
import re
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx


class MLP(nnx.Module):
    def __init__(self, *, rngs: nnx.Rngs):
        self.hidden = nnx.Linear(64, 64, rngs=rngs)
        self.out = nnx.Linear(64, 10, rngs=rngs)

    def __call__(self, x):
        return self.out(nnx.relu(self.hidden(x)))


def programs(k: int):
    graphdef, params = nnx.split(MLP(rngs=nnx.Rngs(0)), nnx.Param)
    tx = optax.adam(1e-3)

    def loss_of(p, x, y):
        logits = nnx.merge(graphdef, p)(x)
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    def finite(tree):
        return jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree)]))

    def update(p, o, g):
        u, o = tx.update(g, o, p)
        return optax.apply_updates(p, u), o

    def make(form: str):
        def body(carry, batch):
            p, o, healthy = carry
            loss, g = jax.value_and_grad(loss_of)(p, *batch)
            ok = healthy & jnp.isfinite(loss) & finite(g)
            if form == "unguarded":
                return (*update(p, o, g), healthy), loss
            if form == "select":
                p2, o2 = update(p, o, g)
                p2 = jax.tree.map(lambda n, old: jnp.where(ok, n, old), p2, p)
                o2 = jax.tree.map(lambda n, old: jnp.where(ok, n, old), o2, o)
                return (p2, o2, ok), loss
            p2, o2 = jax.lax.cond(ok, update, lambda p, o, g: (p, o), p, o, g)
            return (p2, o2, ok), loss

        @functools.partial(jax.jit, donate_argnums=(0, 1))
        def run(p, o, x, y):
            (p, o, _), losses = jax.lax.scan(body, (p, o, jnp.bool_(True)), (x, y))
            return p, o, losses

        return run

    def gradient(p, x, y):
        loss, g = jax.value_and_grad(loss_of)(p, x, y)
        return loss, g, jnp.isfinite(loss) & finite(g)

    def kept(ok, new, old):
        return jax.tree.map(lambda n, o: jnp.where(ok, n, o), new, old)

    @functools.partial(jax.jit, donate_argnums=(0, 1))
    def pipelined(p, o, x, y):
        loss, g, ok = gradient(p, x[0], y[0])
        losses = jnp.full((k,), jnp.nan).at[0].set(loss)

        def more(carry):
            i, _, _, _, ok, _ = carry
            return (i < k - 1) & ok

        def body(carry):
            i, p, o, g, _, losses = carry
            p, o = update(p, o, g)  # step i was finite
            loss, g, ok = gradient(p, x[i + 1], y[i + 1])
            return i + 1, p, o, g, ok, losses.at[i + 1].set(loss)

        _, p, o, g, ok, losses = jax.lax.while_loop(more, body, (0, p, o, g, ok, losses))
        p2, o2 = update(p, o, g)
        return kept(ok, p2, p), kept(ok, o2, o), losses

    def scanned(keep_at_end: bool):
        @functools.partial(jax.jit, donate_argnums=(0, 1))
        def run(p, o, x, y):
            def body(carry, batch):
                p, o, healthy = carry
                loss, g, ok = gradient(p, *batch)
                return (*update(p, o, g), healthy & ok), loss

            (p2, o2, ok), losses = jax.lax.scan(body, (p, o, jnp.bool_(True)), (x, y))
            if keep_at_end:
                return kept(ok, p2, p), kept(ok, o2, o), losses
            return p2, o2, jnp.where(ok, losses, jnp.nan)

        return run

    forms = {f: make(f) for f in ("unguarded", "select", "cond")}
    forms = {"unguarded": forms["unguarded"], "checked": scanned(False), **forms}
    forms.update(pipelined=pipelined, optimistic=scanned(True))
    return params, tx.init(params), forms


def nitro_forms(k: int, rounds: int) -> None:
    import os
    import sys

    sys.path.insert(0, os.path.dirname(__file__))
    import loops
    from overhead import train_arrays

    import nitro.engine.loop

    spec = loops.ModelSpec("mlp", lambda rngs: loops.MLP((64, 64, 10), rngs=rngs), 32, "")
    arrays = train_arrays(16)
    restore_bytes = nitro.engine.loop.RESTORE_BYTES
    forms = {  # name -> (handle, RESTORE_BYTES while it trains)
        "restored by the loop": (loops.WithNitro(spec, arrays, steps=k), restore_bytes),
        "a select per step": (loops.WithNitro(spec, arrays, steps=k), 0),
        "no guard": (loops.WithNitro(spec, arrays, steps=k, check_divergence=False), 0),
    }
    rates: dict[str, list[float]] = {name: [] for name in forms}
    for r in range(rounds + 2):
        for name in forms if r % 2 else reversed(forms):
            handle, limit = forms[name]
            nitro.engine.loop.RESTORE_BYTES = limit  # read as each train() call begins
            steps, seconds = handle.run(2)
            if r >= 2:  # two warm-up rounds: the compiles
                rates[name].append(steps / seconds)
    nitro.engine.loop.RESTORE_BYTES = restore_bytes
    print(
        f"Nitro, tiny MLP, Adam, {k} steps per call, {jax.devices()[0].platform}, {rounds} rounds"
    )
    print(f"{'guard':<22}{'steps/s':>9}{'vs no guard':>13}")
    for name in forms:
        ratio = statistics.median(
            a / b for a, b in zip(rates[name], rates["no guard"], strict=True)
        )
        print(f"{name:<22}{statistics.median(rates[name]):>9.0f}{ratio:>12.2f}x")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8, help="K steps per program call")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--calls", type=int, default=50, help="program calls per round")
    parser.add_argument("--nitro", action="store_true", help="Nitro's handles, not hand-written")
    args = parser.parse_args(argv)
    k = args.steps
    if args.nitro:
        nitro_forms(k, args.rounds)
        return
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(k, 32, 64)).astype(np.float32))
    y = jnp.asarray(rng.integers(0, 10, (k, 32)))
    params, opt, forms = programs(k)
    state = {f: (jax.tree.map(jnp.copy, params), jax.tree.map(jnp.copy, opt)) for f in forms}
    counts = {}
    for form, run in forms.items():
        text = run.lower(*state[form], x, y).compile().as_text()
        ops = collections.Counter(re.findall(r"= \S+ (\w+)\(", text))
        counts[form] = (ops["fusion"], ops["copy"], ops["select"])
        p, o, losses = run(*state[form], x, y)
        losses.block_until_ready()
        state[form] = (p, o)
    times: dict[str, list[float]] = {f: [] for f in forms}
    for r in range(args.rounds):
        order = list(forms) if r % 2 else list(reversed(forms))
        for form in order:
            p, o = state[form]
            start = time.perf_counter()
            for _ in range(args.calls):
                p, o, losses = forms[form](p, o, x, y)
            losses.block_until_ready()
            times[form].append((time.perf_counter() - start) / (args.calls * k) * 1e6)
            state[form] = (p, o)
    base = statistics.median(times["unguarded"])
    print(f"tiny MLP, Adam, {k} steps per call, {jax.devices()[0].platform}")
    print(
        f"{'form':<11}{'us/step':>9}{'vs unguarded':>14}{'fusions':>9}{'copies':>8}{'selects':>9}"
    )
    for form in forms:
        median = statistics.median(times[form])
        fusions, copies, selects = counts[form]
        print(f"{form:<11}{median:>9.2f}{median / base:>13.2f}x{fusions:>9}{copies:>8}{selects:>9}")


if __name__ == "__main__":
    main()
