"""The programs a handle runs, as traceable functions plus the specs that key them.

Each program takes the run's `Variables` (flat leaf lists, so a call flattens nothing but
lists), merges the NNX model inside the trace, and gives hooks a `TraceView` of the
experiment. Programs:

- train step (`train_step.py`): forward, loss, gradient, optimizer update and (device) train
  metrics, fused into one program over donated variables; K of them in one program through
  `lax.scan` (multi-step train).
- eval forward: forward and the per-sample loss of an evaluation batch, masked to the real
  samples (the final short batch is padded to the compiled width).
- predict: forward alone.
- device metrics: a metrics hook traced on device.

`ProgramSet` holds the programs one handle uses, each looked up in the module-level cache
once; a population's (`members=N`) are the same programs vmapped over a leading member axis
(`nitro.programs.population`).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from nitro.core.metrics import split_modes
from nitro.core.run_setup import RunSetup
from nitro.core.train_state import EvalOutput, Variables
from nitro.experiments.routing import select
from nitro.optim.precision import FLOAT32
from nitro.programs import tracing
from nitro.programs.compile_cache import (
    CACHE,
    Opaque,
    Program,
    ProgramKind,
    ProgramSpec,
    Traced,
)
from nitro.programs.population import population_eval_spec, population_train_spec
from nitro.programs.train_step import TRAIN_UNITS, train_step_spec

__all__ = [
    "PROGRAM_UNITS",
    "PendingProgram",
    "ProgramSet",
    "abstract_arguments",
    "device_metrics_spec",
    "eval_spec",
    "programs_using",
]

# The code each program kind runs: hooks, the model's classes, the optimizer's update.
PROGRAM_UNITS: dict[ProgramKind, tuple[str, ...]] = {
    ProgramKind.TRAIN_STEP: TRAIN_UNITS,
    ProgramKind.MULTI_STEP: TRAIN_UNITS,
    ProgramKind.EVAL_FORWARD: ("forward", "loss", "model"),
    ProgramKind.PREDICT: ("forward", "model"),
    ProgramKind.DEVICE_METRICS: ("metrics",),
    ProgramKind.POPULATION_STEP: TRAIN_UNITS,
    ProgramKind.POPULATION_EVAL: ("forward", "loss", "model"),
}


def programs_using(unit: str) -> tuple[ProgramKind, ...]:
    """The program kinds whose code includes `unit` (a hook name, "model" or "optimizer")."""
    return tuple(kind for kind, units in PROGRAM_UNITS.items() if unit in units)


# ---------------------------------------------------------------------------------------------
# eval forward and predict


def eval_spec(
    setup: RunSetup,
    fields: Mapping[str, tuple[str, ...]],
    *,
    with_loss: bool,
    return_outputs: bool,
    batches: int = 1,
) -> ProgramSpec:
    """Eval forward (`with_loss`) or predict (forward alone); with `batches > 1`, that many
    stacked evaluation batches in one call (`lax.scan`), each with its real sample count."""
    model = setup.model
    precision = setup.precision or FLOAT32

    def build(reads: set[str]):
        def evaluate(variables: Variables, device, batch, n_real) -> EvalOutput:
            params, rest = tracing.unflatten(setup, variables)
            view = tracing.view(setup, device, reads)
            # in the compute dtype, as the train step (precision=); outputs float32
            module = nnx.merge(model.graphdef_eval, precision.cast_compute(params), rest, copy=True)
            inputs = select(batch, fields["forward"])
            compute_view = tracing.view(setup, precision.cast_compute(device), reads)
            outputs = tracing.call(
                setup, "forward", compute_view, module, **precision.cast_compute(inputs)
            )
            outputs = precision.cast_output(outputs)
            loss_sum = losses = None
            if return_outputs:
                tracing.check_batch_axis(outputs, inputs)
            if with_loss:
                loss_sum, losses = _masked_loss_sum(
                    setup, view, outputs, select(batch, fields["loss"]), n_real
                )
            if not return_outputs:
                return EvalOutput(loss_sum=loss_sum)
            return EvalOutput(loss_sum=loss_sum, outputs=outputs, losses=losses)

        if batches == 1:
            return evaluate

        def evaluate_block(variables: Variables, device, batch, n_real) -> EvalOutput:
            def one(carry, inputs):
                return carry, evaluate(variables, device, *inputs)

            return jax.lax.scan(one, None, (batch, n_real))[1]

        return evaluate_block

    kind = ProgramKind.EVAL_FORWARD if with_loss else ProgramKind.PREDICT
    hooks = ("forward", "loss") if with_loss else ("forward",)
    return ProgramSpec(
        kind=kind,
        owner=setup.owner,
        build=build,
        code=tracing.fingerprint(setup, *PROGRAM_UNITS[kind]),
        static={
            "model structure": Opaque(model.structure),
            "returns outputs": return_outputs,
            "fields": tracing.fields_key(fields, hooks),
            "batches per call": batches,
            "precision": precision.compute,
        },
        graphconst=setup.experiment.graphconst,
        arg_names=("variables", "device fields", "batch", "real samples"),
        leaf_labels=tracing.leaf_labels(
            setup,
            "batch",
            fields,
            ("variables.params", "parameter"),
            ("variables.model_state", "model state"),
        ),
    )


def _masked_loss_sum(setup, view, outputs, fields, n_real):
    """Sum of per-sample losses over the real samples of a (padded) batch, and the
    per-sample losses (None when the loss couples samples).

    Each sample's loss is the `loss` hook applied to a batch of one, which is exact for a loss
    that is a mean of per-sample terms; the padded rows are masked out. A loss that couples
    samples cannot be split per sample: it is then applied to the whole batch and weighted by
    the real count (exact for every full batch).
    """
    width = jax.tree.leaves(fields or outputs)[0].shape[0]
    mask = jnp.arange(width) < n_real

    def one(sample_outputs, sample_fields):
        expand = lambda a: a[None]  # noqa: E731
        return tracing.check_scalar_loss(
            tracing.call(
                setup,
                "loss",
                view,
                jax.tree.map(expand, sample_outputs),
                **jax.tree.map(expand, sample_fields),
            )
        )

    try:
        per_sample = jax.vmap(one)(outputs, fields).astype(jnp.float32)
        return jnp.sum(jnp.where(mask, per_sample, 0.0)), per_sample
    except (TypeError, ValueError, IndexError):
        whole = tracing.check_scalar_loss(tracing.call(setup, "loss", view, outputs, **fields))
        return whole.astype(jnp.float32) * n_real, None


# ---------------------------------------------------------------------------------------------
# device metrics


def device_metrics_spec(setup: RunSetup, fields: Mapping[str, tuple[str, ...]]) -> ProgramSpec:
    def build(reads: set[str]):
        traced = Traced()

        def metrics(outputs, device, batch):
            view = tracing.view(setup, device, reads)
            values = tracing.call(setup, "metrics", view, outputs, **batch)
            traced.metric_specs, leaves = split_modes(values, "metrics")
            return leaves

        metrics.nitro_traced = traced
        return metrics

    return ProgramSpec(
        kind=ProgramKind.DEVICE_METRICS,
        owner=setup.owner,
        build=build,
        code=tracing.fingerprint(setup, *PROGRAM_UNITS[ProgramKind.DEVICE_METRICS]),
        static={"fields": tracing.fields_key(fields, ("metrics",))},
        graphconst=setup.experiment.graphconst,
        arg_names=("outputs", "device fields", "batch"),
    )


# ---------------------------------------------------------------------------------------------
# one handle's programs


class ProgramSet:
    """The programs one handle uses. Each slot is looked up in the module cache once; later
    calls reuse the program the slot holds. Each slot also keeps how its spec is made from a
    setup and the abstract arguments it was compiled for, so `for_setup` can make the same
    programs for edited code (a live edit) without a call.

    `members=N` (a population): every program is the run's, vmapped over a leading member
    axis of N; `own_batches`: each member's batches carry that axis too; `vectorize`: the
    member axis vmapped (else each member's step unrolled, one after another)."""

    def __init__(
        self,
        setup: RunSetup,
        members: int | None = None,
        own_batches: bool = False,
        vectorize: bool = True,
    ):
        self.setup = setup
        self.members = members
        self.own_batches = own_batches
        self.vectorize = vectorize
        self._slots: dict[tuple, Program] = {}
        self._makers: dict[tuple, tuple[Callable[[RunSetup], ProgramSpec], Any]] = {}
        self._without_remat: dict[tuple, int | None] = {}  # `scratch_without_remat`'s figures

    def _eval(self, spec: ProgramSpec) -> ProgramSpec:
        if self.members is None:
            return spec
        return population_eval_spec(spec, self.members, self.vectorize)

    def _get(self, slot: tuple, make_spec: Callable[[RunSetup], ProgramSpec], args) -> Program:
        program = self._slots.get(slot)
        if program is None:
            make_spec = functools.partial(_optioned, make_spec, slot[0])
            program = CACHE.lookup(make_spec(self.setup), args)
            self._makers[slot] = (make_spec, abstract_arguments(args))  # before the slot:
            self._slots[slot] = program  # `for_setup` on another thread reads both
        return program

    def train_step(self, args, steps: int = 1, micro: int = 1, restore: bool = False) -> Program:
        """The train step (`steps == 1`), or `steps` of them fused in one program; each step
        accumulates `micro` micro-batches. `restore`: steps whose guard only checks, over
        variables not donated, which the loop restores (`train_step_spec`)."""
        members, own = self.members, self.own_batches

        def make(setup: RunSetup) -> ProgramSpec:
            spec = train_step_spec(setup, setup.splits["train"].hook_fields, steps, micro, restore)
            if members is None:
                return spec
            stacked = steps > 1 or micro > 1
            guarded = setup.check_divergence
            keep = setup.keywords["spike"].value is not None  # a member's roll-back reads it
            return population_train_spec(
                spec,
                members,
                stacked=stacked,
                own_batches=own,
                guarded=guarded,
                vectorize=self.vectorize,
                keep_input=keep,
            )

        return self._get(("train", steps, micro, restore), make, args)

    def eval_forward(
        self, split: str, args, *, with_loss: bool, return_outputs: bool, batches: int = 1
    ) -> Program:
        info = self.setup.splits[split]
        return self._get(
            ("eval", split, info.width, batches, return_outputs),
            lambda setup: self._eval(
                eval_spec(
                    setup,
                    setup.splits[split].hook_fields,
                    with_loss=with_loss,
                    return_outputs=return_outputs,
                    batches=batches,
                )
            ),
            args,
        )

    def device_metrics(self, split: str, args) -> Program:
        width = jax.tree.leaves(args[0])[0].shape[0]
        return self._get(
            ("metrics", split, width),
            lambda setup: device_metrics_spec(setup, setup.splits[split].hook_fields),
            args,
        )

    def predict(self, width: int, fields: tuple[str, ...], args) -> Program:
        return self._get(
            ("predict", width, fields),
            lambda setup: self._eval(
                eval_spec(setup, {"forward": fields}, with_loss=False, return_outputs=True)
            ),
            args,
        )

    def held(self) -> list[str]:
        """Titles of the programs this handle holds, sorted."""
        return sorted({p.title for p in list(self._slots.values())})

    def for_setup(self, setup: RunSetup) -> tuple[ProgramSet, list[PendingProgram]]:
        """The programs of this set for `setup` (the same experiment with edited code): a
        new set holding every program whose code and settings the edit leaves as they were,
        and the programs it still has to compile (`compile_pending`)."""
        new = ProgramSet(setup, self.members, self.own_batches, self.vectorize)
        pending = []
        for slot, program in list(self._slots.items()):  # the loop may add slots meanwhile
            make, arguments = self._makers[slot]
            spec = make(setup)
            new._makers[slot] = (make, arguments)
            if spec.code.digest == program.code.digest and dict(spec.static) == program.static:
                new._slots[slot] = program
            else:
                pending.append(PendingProgram(slot, spec, arguments, program))
        return new, pending

    def scratch_without_remat(self) -> list[tuple[str, int | None, int | None]]:
        """For `remat=`: (title, scratch bytes, the scratch bytes it has without remat) of
        each train program held, from XLA's memory analysis. The program without remat is
        compiled for it once, outside the cache (its figure is kept)."""
        rows = []
        for slot, program in sorted(self._slots.items(), key=lambda item: str(item[0])):
            if slot[0] != "train" or self.setup.remat is None:
                continue
            if slot not in self._without_remat:
                make, arguments = self._makers[slot]
                spec = make(dataclasses.replace(self.setup, remat=None))
                jitted = jax.jit(spec.build(set()), donate_argnums=spec.donate_argnums)
                options = dict(spec.compile_options) or None
                compiled = jitted.lower(*arguments).compile(compiler_options=options)
                memory = compiled.memory_analysis()
                self._without_remat[slot] = getattr(memory, "temp_size_in_bytes", None)
            rows.append((program.title, program.cost().temp_bytes, self._without_remat[slot]))
        return rows

    def compile_pending(self, pending: list[PendingProgram], warm: bool = False) -> list[Program]:
        """Compile (or find in the cache) each pending program into its slot; with `warm`,
        run each once on zeros (`warm_up`), so its first real call costs what later ones do."""
        compiled = []
        for item in pending:
            program = CACHE.lookup(item.spec, item.arguments)
            self._slots[item.slot] = program
            compiled.append(program)
            if warm:
                warm_up(program, item.arguments)
        return compiled


def _optioned(make_spec: Callable[[RunSetup], ProgramSpec], kind: str, setup: RunSetup):
    """`make_spec`'s spec for `setup`, compiled with the XLA options `compile_options=` gives
    programs of `kind` (a slot's first name: train, eval, predict, metrics)."""
    options = setup.compile_options
    return make_spec(setup).with_options(options.for_kind(kind) if options else {})


@dataclasses.dataclass(frozen=True)
class PendingProgram:
    """A program `ProgramSet.for_setup` has to compile: its slot, its spec for the new
    setup, the abstract arguments of the program it replaces, and that program."""

    slot: tuple
    spec: ProgramSpec
    arguments: Any
    replaces: Program


def _abstract(leaf: Any) -> Any:
    if isinstance(leaf, jax.Array):
        return jax.ShapeDtypeStruct(
            leaf.shape,
            leaf.dtype,
            sharding=leaf.sharding,
            weak_type=bool(getattr(leaf, "weak_type", False)),  # a key array has none
        )
    if isinstance(leaf, np.ndarray):
        return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype)
    return leaf


WARM_UP_BYTES = 256 * 2**20  # larger arguments are not copied to zeros for a warm-up call


def _zeros(leaf: Any) -> Any:
    if not isinstance(leaf, jax.ShapeDtypeStruct):
        return leaf
    return jax.device_put(np.zeros(leaf.shape, leaf.dtype), leaf.sharding)


def _is_key(leaf: Any) -> bool:
    return isinstance(leaf, jax.ShapeDtypeStruct) and jnp.issubdtype(
        leaf.dtype, jax.dtypes.prng_key
    )


def warm_up(program: Program, arguments: Any) -> None:
    """Run a freshly compiled program once on zeros of its arguments' shapes, unless they
    are large: an executable's first call sets up what later calls reuse (milliseconds a
    train step), which a live edit does beside the run rather than at the swap. Nothing is
    counted; a failure only leaves the first real call to do it."""
    leaves = jax.tree.leaves(arguments)
    if any(_is_key(x) for x in leaves):
        return  # typed random keys have no zeros; the first real call sets it up
    size = sum(
        int(np.prod(x.shape)) * np.dtype(x.dtype).itemsize
        for x in leaves
        if isinstance(x, jax.ShapeDtypeStruct)
    )
    if size > WARM_UP_BYTES:
        return
    try:
        outputs = program.compiled(*jax.tree.map(_zeros, arguments))
        jax.block_until_ready(outputs)
        for leaf in jax.tree.leaves(outputs):
            if isinstance(leaf, jax.Array):
                leaf.delete()
    except Exception:  # noqa: BLE001 - an optimization only
        pass


def abstract_arguments(args: Any) -> Any:
    """Arguments as shapes, dtypes and shardings (Python scalars as they are), enough to
    compile a program for them later without holding their buffers."""
    return jax.tree.map(_abstract, args)
