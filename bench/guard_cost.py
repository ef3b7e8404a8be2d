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
new; the other forms cost more all the same.

    python bench/guard_cost.py [--steps 8] [--rounds 15]
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


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8, help="K steps per program call")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--calls", type=int, default=50, help="program calls per round")
    args = parser.parse_args(argv)
    k = args.steps
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
