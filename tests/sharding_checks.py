"""Runs in a subprocess with 8 fake CPU devices (XLA_FLAGS is set by tests/test_sharding.py
before JAX starts) and prints one JSON object of results for the tests to assert on: each
sharded run beside the replicated (data-parallel) run of the same experiment."""

from __future__ import annotations

import json
import math
import os
import sys

import jax
import numpy as np
import optax
from flax import nnx

import nitro
from nitro.data import ArrayLoader

RNG = np.random.default_rng(0)
X = RNG.normal(size=(128, 16)).astype(np.float32)
Y = (X[:, 0] + X[:, 1] > 0).astype(np.int32)
QUIET = dict(checkpointer=None, logger=None, progress=False)


class Net(nnx.Module):
    def __init__(self, *, rngs: nnx.Rngs):
        self.hidden = nnx.Linear(16, 64, rngs=rngs)
        self.mid = nnx.Linear(64, 24, rngs=rngs)  # 24: divisible by 8 on its last axis only
        self.out = nnx.Linear(24, 2, rngs=rngs)  # bias (2,): no axis divides, replicated

    def __call__(self, x):
        return self.out(nnx.relu(self.mid(nnx.relu(self.hidden(x)))))


@nitro.experiment
class Toy:
    batch_size: int = 32
    poison: nitro.Device[float] = 1.0

    def build_data(self):
        return {
            "train": ArrayLoader({"x": X, "y": Y}, self.batch_size, seed=3),
            "val": ArrayLoader({"x": X[:64], "y": Y[:64]}, 32, shuffle=False),
        }

    def build_model(self, rngs: nnx.Rngs):
        return Net(rngs=rngs)

    def forward(self, model, *, x):
        return model(x)

    def loss(self, logits, *, y):
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean() * self.poison

    def metrics(self, logits, *, y):
        return {"acc": (logits.argmax(-1) == y).mean()}


@nitro.experiment
class Grouped(Toy):
    def param_group(self, path):
        return "body" if path.startswith("hidden") else "head"


@nitro.experiment
class Manual(Toy):
    def build_model(self, rngs: nnx.Rngs):
        return {"net": Net(rngs=rngs)}

    def forward(self, models, *, x):
        return models["net"](x)

    def train_step(self, step, *, x, y):
        def objective(models):
            logits = models["net"](x)
            return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

        loss, grads = step.grad("net", objective)
        step.apply("net", grads)
        return {"loss": loss}


# the transformer of bench/peers.py, small
VOCAB, CONTEXT, WIDTH, LAYERS, HEADS = 32, 16, 32, 2, 4
sys.path.insert(
    0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench")
)
from peers import TinyLM as PeersLM  # noqa: E402


def TinyLM(*, rngs):  # noqa: N802 - stands for the class
    return PeersLM(VOCAB, CONTEXT, WIDTH, LAYERS, HEADS, rngs=rngs)


def tokens(sequences: int) -> dict[str, np.ndarray]:
    start = RNG.integers(0, VOCAB, (sequences, 1))
    walk = np.cumsum(RNG.integers(1, 4, (sequences, CONTEXT)), axis=1)
    seq = (np.concatenate([start, start + walk], axis=1) % VOCAB).astype(np.int32)
    return {"x": seq[:, :-1], "y": seq[:, 1:]}


LM_DATA = tokens(64)

# Megatron: the projections into heads / the MLP's width split their output over "model"
# (columns), the projections back split their input (rows)
MEGATRON = {
    r"attention\.(query|key|value)\.kernel": (None, "model", None),
    r"attention\.(query|key|value)\.bias": ("model", None),
    r"attention\.out\.kernel": ("model", None, None),
    r"up\.kernel": (None, "model"),
    r"up\.bias": ("model",),
    r"down\.kernel": ("model", None),
}


@nitro.experiment
class LM:
    batch_size: int = 16

    def build_data(self):
        return {"train": ArrayLoader(LM_DATA, self.batch_size, seed=1)}

    def build_model(self, rngs: nnx.Rngs):
        return TinyLM(rngs=rngs)

    def optimizer(self):
        # not Adam: an attention key's bias has a true gradient of zero (softmax ignores a
        # shift), and Adam's normalization turns its rounding noise into steps of the learning
        # rate, so any change of reduction order (even 1 device -> 8) moves it by ~1e-3
        return optax.sgd(0.1, momentum=0.9)

    def forward(self, model, *, x):
        return model(x)

    def loss(self, logits, *, y):
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


class Annotated(nnx.Module):
    def __init__(self, *, rngs: nnx.Rngs):
        init = nnx.initializers.lecun_normal()
        # logical names, translated by the Variable's own rules (Flax's sharding_rules)
        logical = nnx.with_partitioning(
            init, ("embed", "mlp"), sharding_rules=(("embed", None), ("mlp", "model"))
        )
        self.hidden = nnx.Linear(16, 64, kernel_init=logical, rngs=rngs)
        self.out = nnx.Linear(
            64, 2, kernel_init=nnx.with_partitioning(init, ("model", None)), rngs=rngs
        )

    def __call__(self, x):
        return self.out(nnx.relu(self.hidden(x)))


@nitro.experiment
class AnnotatedToy(Toy):
    def build_model(self, rngs: nnx.Rngs):
        return Annotated(rngs=rngs)


def host(leaves):
    return [np.asarray(x).tolist() for x in leaves]


def spec(x) -> list:
    """A leaf's spec, trailing Nones dropped (P('model', None) lays out as P('model',))."""
    entries = list(x.sharding.spec)
    while entries and entries[-1] is None:
        entries.pop()
    return [list(e) if isinstance(e, tuple) else e for e in entries]


def per_device(leaves) -> int:
    return int(sum(x.addressable_shards[0].data.nbytes for x in leaves))


def run(experiment, epochs: int, **keywords):
    n = nitro.Nitro(experiment, max_epochs=epochs, **QUIET, **keywords)
    n.train()
    return n


def record(n, **extra) -> dict:
    variables = n.state.variables
    return {
        "loss": n.history()["loss"].tolist(),
        "params": host(variables.params),
        "paths": list(n.setup.model.leaf_paths["parameter"]),
        "specs": [spec(x) for x in variables.params],
        "opt_paths": list(n.setup.model.leaf_paths["optimizer state"]),
        "opt_specs": [spec(x) for x in variables.opt_state],
        "opt_bytes": per_device(variables.opt_state),
        "param_bytes": per_device(variables.params),
        "describe": n.placement.describe(),
        **extra,
    }


def refused(make) -> str:
    try:
        make()
    except Exception as error:  # the message is what the tests read
        return f"{type(error).__name__}: {error}"
    return "not refused"


def fsdp_checks(out: dict) -> None:
    for name, keywords in (("replicated", {}), ("fsdp", {"sharding": "fsdp"})):
        n = run(Toy(), 3, **keywords)
        batch = {"x": X[:24]}
        out[name] = record(
            n,
            val=n.evaluate("val"),
            predict=np.asarray(n.predict(batch)).tolist(),
            predict_type=type(n.predict(batch)).__name__,
            report=str(n.binding_report()),
            ema_specs=None,
        )
        n.close()


def rules_checks(out: dict) -> None:
    lm = {}
    for name, keywords in (
        ("replicated", {}),
        ("rules", {"mesh": {"data": 4, "model": 2}, "sharding": MEGATRON}),
    ):
        n = run(LM(), 2, **keywords)
        lm[name] = record(n, report=str(n.binding_report()))
        n.close()
    n = nitro.Nitro(
        AnnotatedToy(), mesh={"data": 4, "model": 2}, sharding="rules", max_epochs=1, **QUIET
    )
    n.train()
    lm["annotated"] = record(n)
    n.close()
    n = run(AnnotatedToy(), 1)  # replicated: annotations are not applied
    lm["annotated_replicated"] = record(n)
    n.close()
    out["lm"] = lm


FEATURES = dict(
    steps_per_dispatch=2,
    accum=2,
    group_lr={"body": 0.5},
    weight_decay=0.1,
    gradient_clip_norm=0.05,
    ema=0.9,
    sam=0.05,
    schedules={"learning_rate": optax.cosine_decay_schedule(1e-2, 8)},
)


def feature_checks(out: dict) -> None:
    features = {}
    for name, keywords in (("replicated", {}), ("fsdp", {"sharding": "fsdp"})):
        n = run(Grouped(), 2, **FEATURES, **keywords)
        found = record(
            n,
            ema=host(n.state.variables.ema),
            ema_specs=[spec(x) for x in n.state.variables.ema],
            dispatch=n.dispatch.setting,
        )
        before = host(n.state.variables.params)
        n.set_device(poison=math.nan)
        found["guard"] = refused(lambda n=n: n.train(epochs=1))
        found["kept"] = host(n.state.variables.params) == before
        found["kept_specs"] = [spec(x) for x in n.state.variables.params]
        n.close()
        features[name] = found
    out["features"] = features
    manual = {}
    for name, keywords in (("replicated", {}), ("fsdp", {"sharding": "fsdp"})):
        n = run(Manual(), 2, **keywords)
        manual[name] = record(n)
        n.close()
    out["manual"] = manual


def refusal_checks(out: dict) -> None:
    mesh = {"data": 4, "model": 2}
    out["refused"] = {
        "unmatched": refused(
            lambda: nitro.Nitro(
                Toy(), sharding={r"hidden\.kernel": "data", r"decoder\.": (None,)}, **QUIET
            )
        ),
        "indivisible": refused(
            lambda: nitro.Nitro(
                Toy(),
                mesh={"data": 2, "model": 4},
                sharding={r"out\.kernel": (None, "model")},
                **QUIET,
            )
        ),
        "unknown_axis": refused(
            lambda: nitro.Nitro(
                Toy(), mesh=mesh, sharding={r"hidden\.kernel": ("tensor",)}, **QUIET
            )
        ),
        "rank": refused(
            lambda: nitro.Nitro(
                Toy(), mesh=mesh, sharding={r"hidden\.bias": ("model", None)}, **QUIET
            )
        ),
        "too_large": refused(lambda: nitro.Nitro(Toy(), mesh={"data": 8, "model": 2}, **QUIET)),
        "n_devs_conflict": refused(lambda: nitro.Nitro(Toy(), mesh=mesh, n_devs=4, **QUIET)),
        "no_data_axis": refused(lambda: nitro.Nitro(Toy(), mesh={"model": 8}, **QUIET)),
        "bad_strategy": refused(lambda: nitro.Nitro(Toy(), sharding="zero3", **QUIET)),
        "no_annotations": refused(lambda: nitro.Nitro(Toy(), mesh=mesh, sharding="rules", **QUIET)),
        "population": refused(
            lambda: nitro.Population(Toy(), seed=[0, 1], sharding="fsdp", **QUIET).train()
        ),
    }


def main() -> None:
    out: dict = {"devices": jax.device_count()}
    refusal_checks(out)
    fsdp_checks(out)
    rules_checks(out)
    feature_checks(out)
    json.dump(out, sys.stdout)


if __name__ == "__main__":
    main()
