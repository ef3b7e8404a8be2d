"""The optimizer: optax transformations composed in one place, their numeric hyperparameters
fed to every step.

```
gradient ─► clip by global norm ─► partition by param_group ─► per group: the optimizer
            (gradient_clip_norm)     (param_group, group_lr)      ─► decoupled weight decay
                                                                     (weight_decay, decay_to)
```

Each stage is there only when its switch is on: with every switch off the transformation is
`optax.inject_hyperparams(optimizer)(learning_rate=...)` alone, the same program as ever. An
`optimizer(self)` method (or the `optimizer` keyword) may return

- an optax factory such as `optax.adamw` or `functools.partial(optax.sgd, momentum=0.9)`:
  Nitro injects it with the resolved `learning_rate`;
- any GradientTransformation, used as given. Hyperparameters baked into it key the compile
  cache; only an `inject_hyperparams` transformation exposes them to schedules.

Every numeric hyperparameter of every `inject_hyperparams` state in the tree is fed to the
train step as one float32 vector (`OptimizerSetup.names` orders it), so a schedule or a new
constant never recompiles. Inside a parameter group a hyperparameter is fed as
`<group>/<name>` (`backbone/learning_rate`); a bare schedule key (`learning_rate`) moves that
hyperparameter in every group, the learning rate times the group's `group_lr` ratio.

The train step's contract (`nitro.optim.fed_optimizer.FedOptimizer`): `opt_state =
setup.inject(opt_state, hparams)`, then `updates, new_state = setup.tx.update(grads,
opt_state, params)`, then `new_state = setup.strip(new_state)`.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from nitro.errors import OptimizerError, ScheduleError
from nitro.optim import ranges
from nitro.optim.param_groups import (
    ParamGroup,
    group_labels,
    group_prefix,
    leaf_paths,
    param_groups,
)
from nitro.optim.weight_decay import (
    DecoupledDecayState,
    anchor_leaves,
    decay_flags,
    decoupled_weight_decay,
)

__all__ = [
    "FedHyperparameter",
    "FedValues",
    "OptimizerError",
    "OptimizerSettings",
    "OptimizerSetup",
    "ParamGroup",
    "build_optimizer",
]

# The transformations are built with these values, never the run's: the fed values replace
# them at every step, and a value captured in a closure would key the compiled program
# (`optax.partition` keeps its transformations' `init` functions, which hold the values).
_PLACEHOLDER = {"learning_rate": 1e-3, "weight_decay": 0.0, "gradient_clip_norm": 1.0}
_INJECTED = (optax.InjectHyperparamsState, optax.InjectStatefulHyperparamsState)


@dataclasses.dataclass(frozen=True)
class OptimizerSettings:
    """The run keywords and hooks that shape the optimizer."""

    # an optax factory or GradientTransformation; None: optax.adam (a user value: `_base` checks it)
    optimizer: optax.GradientTransformation | Callable[..., optax.GradientTransformation] | None = (
        None
    )
    learning_rate: float = 1e-3
    learning_rate_explicit: bool = False
    param_group: Callable[[str], str] | None = None  # the experiment's hook
    group_lr: Mapping[str, float] | None = None
    weight_decay: float | None = None
    decay_to: Any = "zero"
    decay_mask: Callable[[str, Any], bool] | None = None
    gradient_clip_norm: float | None = None
    scheduled: frozenset[str] = frozenset()  # schedule keys: the values they replace go unchecked


@dataclasses.dataclass(frozen=True)
class FedHyperparameter:
    """One entry of the vector fed to every step."""

    name: str  # as fed and scheduled: "learning_rate", "head/learning_rate"
    key: str  # the optax name: "learning_rate"
    group: str | None
    constant: float  # the value without a schedule
    scale: float  # multiplies a bare-key schedule (the group's ratio, for the learning rate)
    dtype: Any


class FedValues:
    """What both kinds of optimizer derive from their fed hyperparameters (`self.fed`)."""

    fed: tuple[FedHyperparameter, ...]

    @property
    def names(self) -> tuple[str, ...]:
        """The fed hyperparameters, in the order of the vector the train step receives."""
        return tuple(f.name for f in self.fed)

    @property
    def hyperparams(self) -> dict[str, float]:
        """Fed name -> the value a step uses without a schedule."""
        return {f.name: f.constant for f in self.fed}

    @property
    def dtypes(self) -> dict[str, Any]:
        return {f.name: f.dtype for f in self.fed}


@dataclasses.dataclass(frozen=True)
class OptimizerSetup(FedValues):
    """The run's optimizer: the composed transformation, the hyperparameters fed to every
    step (in the order of the fed vector), and the parameter groups."""

    tx: optax.GradientTransformation
    description: str
    fed: tuple[FedHyperparameter, ...]  # sorted by name
    slots: tuple[tuple[str, tuple[str, ...]], ...]  # per injected state: (prefix, its keys)
    uses_learning_rate: bool
    groups: tuple[ParamGroup, ...] = ()
    decayed: tuple[str, ...] = ()  # paths of the leaves that decay (weight_decay on)
    decay_to: str | None = None  # "zero", "init", "given"; None: no decoupled decay
    gradient_clip_norm: float | None = None

    @property
    def schedulable(self) -> dict[str, float]:
        """Names a schedule key can bind to: every fed name and, with parameter groups, each
        bare name (which moves it in every group)."""
        names = self.hyperparams
        for f in self.fed:
            if f.group is not None:
                names.setdefault(f.key, f.constant)
        return names

    def sources(self) -> dict[str, tuple[str, float]]:
        """Fed name -> (the bare name whose schedule also reaches it, the factor applied)."""
        return {f.name: (f.key, f.scale) for f in self.fed}

    def check_schedules(self, keys: Iterable[str]) -> None:
        """Refuse a group's learning rate given both as a `group_lr` ratio and as the group's
        own schedule."""
        keys = set(keys)
        for group in self.groups:
            name = f"{group.name}/learning_rate"
            if group.lr_ratio is not None and name in keys:
                raise ScheduleError(
                    f"group {group.name!r} has a learning rate twice: group_lr gives it "
                    f"{group.lr_ratio:g} x learning_rate, and schedules[{name!r}] gives its own. "
                    f"Keep one: drop {group.name!r} from group_lr, or the {name!r} schedule."
                )

    def updates(self) -> dict[str, Callable[..., Any]]:
        """The update function the train step runs, which keys the compiled step."""
        return {"optimizer update": self.tx.update}

    def inject(self, opt_state: Any, hparams: Any) -> Any:
        """Inside the trace: put this step's hyperparameters (`hparams[i]` is `names[i]`)
        into every injected state the update reads."""
        if not self.slots:
            return opt_state
        index = {name: i for i, name in enumerate(self.names)}
        dtypes = self.dtypes
        slots = iter(self.slots)

        def fill(node):
            prefix, keys = next(slots)
            return node._replace(
                hyperparams={k: hparams[index[prefix + k]].astype(dtypes[prefix + k]) for k in keys}
            )

        return _map_injected(opt_state, fill)

    def strip(self, opt_state: Any) -> Any:
        """Inside the trace: drop the injected hyperparameters from the new state (they are
        fed again next step; carrying them would only add outputs to every step)."""
        if not self.slots:
            return opt_state
        return _map_injected(opt_state, lambda node: node._replace(hyperparams={}))


def _is_injected(node: Any) -> bool:
    return isinstance(node, _INJECTED)


def _map_injected(tree: Any, fn: Callable[[Any], Any]) -> Any:
    leaves, treedef = jax.tree.flatten(tree, is_leaf=_is_injected)
    return jax.tree.unflatten(treedef, [fn(x) if _is_injected(x) else x for x in leaves])


def _numeric(hyperparams: Mapping[str, Any]) -> dict[str, Any]:
    return {
        name: value
        for name, value in hyperparams.items()
        if hasattr(value, "dtype") and jnp.issubdtype(value.dtype, jnp.number)
    }


def _describe_factory(factory: Callable) -> str:
    if isinstance(factory, functools.partial):
        kwargs = ", ".join(f"{k}={v!r}" for k, v in factory.keywords.items())
        return (
            f"{_describe_factory(factory.func)}({kwargs})"
            if kwargs
            else _describe_factory(factory.func)
        )
    module = getattr(factory, "__module__", "") or ""
    prefix = "optax." if module.startswith("optax") else ""
    return prefix + getattr(factory, "__qualname__", repr(factory))


def _multi_steps_refused(every_k: Callable[[int], Any] | None) -> OptimizerError:
    """`optax.MultiSteps` accumulates inside the optimizer: Nitro's `accum=` does that.
    `every_k`: its k as a schedule of the step (None: unknown, the example says 4)."""
    k = 4
    try:
        k = int(np.asarray(every_k(0))) if every_k is not None else k
    except Exception:  # noqa: BLE001 - a schedule that needs a traced step: the example's k
        pass
    return OptimizerError(
        f"optimizer is an optax.MultiSteps, which accumulates gradients inside the optimizer; "
        f"Nitro accumulates them itself with the accum= run keyword (the same updates as "
        f"MultiSteps, and schedules, checkpoints and n.step count optimizer steps). Pass the "
        f"inner optimizer and accum: Nitro(..., optimizer=optax.adam, accum={k})"
    )


def _states(opt_state: Any) -> list[Any]:
    """Every optax state in the tree, nested ones included."""
    found = []

    def visit(node: Any) -> None:
        found.append(node)
        if isinstance(node, tuple):  # chain's tuple, and NamedTuple states with inner states
            for child in node:
                visit(child)
        elif isinstance(node, Mapping):  # optax.partition's inner states
            for child in node.values():
                visit(child)

    visit(opt_state)
    return found


# ---------------------------------------------------------------------------------------------
# the stages


def global_norm_clip(gradient_clip_norm: float) -> optax.GradientTransformation:
    """`optax.clip_by_global_norm`, with its bound named as the run keyword that sets it."""
    return optax.clip_by_global_norm(gradient_clip_norm)


def _base(settings: OptimizerSettings):
    """(a function building the optimizer stage, its description (None for a given
    transformation: described once its state shows what it injects), whether the run's
    learning rate reaches it)."""
    spec = settings.optimizer
    if spec is None:
        spec = optax.adam
    if isinstance(spec, optax.MultiSteps):
        raise _multi_steps_refused(spec._every_k_schedule)
    if isinstance(spec, optax.GradientTransformation):
        return (lambda: spec), None, settings.learning_rate_explicit
    if not callable(spec):
        raise OptimizerError(
            f"optimizer must be an optax GradientTransformation or an optax factory such as "
            f"optax.adamw; got {type(spec).__name__}"
        )
    description = _describe_factory(spec)

    def make() -> optax.GradientTransformation:
        try:
            tx = optax.inject_hyperparams(spec)(learning_rate=_PLACEHOLDER["learning_rate"])
        except TypeError as error:
            raise OptimizerError(
                f"optimizer factory {description} cannot be called with learning_rate: {error}"
            ) from None
        if not isinstance(tx, optax.GradientTransformation):
            raise OptimizerError(
                f"optimizer factory {description} returned {type(tx).__name__}, not an optax "
                f"GradientTransformation"
            )
        return tx

    return make, f"{description}(learning_rate={settings.learning_rate:g})", True


def _decayed(settings: OptimizerSettings, paths, leaves) -> tuple[bool, ...] | None:
    """Each leaf's decay flag, or None with weight decay off (then its settings are errors)."""
    if settings.weight_decay is None:
        for name, given in (
            ("decay_to", not (isinstance(settings.decay_to, str) and settings.decay_to == "zero")),
            ("decay_mask", settings.decay_mask is not None),
        ):
            if given:
                raise OptimizerError(
                    f"{name} is set, but weight decay is off: give weight_decay= (e.g. "
                    f"weight_decay=1e-4) to turn on decoupled weight decay"
                )
        return None
    return decay_flags(settings.decay_mask, paths, leaves)


def _group_anchors(by_group: Mapping[str, str], labels: Sequence[str] | None, params: Any) -> Any:
    """`decay_to={"backbone": "init", "head": "zero"}`: each group's anchor, as a tree shaped
    like the parameters (a group not named pulls toward zero)."""
    if labels is None:
        raise OptimizerError(
            f"decay_to={dict(by_group)!r} names parameter groups, and this run has none: define "
            f"param_group(self, path) on the experiment, or give decay_to='zero' or 'init'"
        )
    known = sorted(set(labels))
    for group, toward in by_group.items():
        if group not in known:
            raise OptimizerError(
                f"decay_to[{group!r}]: no such parameter group; the groups are {', '.join(known)}"
            )
        if toward not in ("zero", "init"):
            raise OptimizerError(
                f"decay_to[{group!r}]={toward!r}: a group's anchor is 'zero' or 'init' (the "
                f"weights the run starts from)"
            )
    anchors = [
        jnp.array(leaf, copy=True) if by_group.get(label) == "init" else jnp.zeros_like(leaf)
        for label, leaf in zip(labels, jax.tree.leaves(params), strict=True)
    ]
    return jax.tree.unflatten(jax.tree.structure(params), anchors)


def _write_anchor(state: Any, leaves: list, decayed, labels) -> Any:
    """Replace the anchors `init` copied from the parameters with the given ones."""

    def fill(path, node):
        if not isinstance(node, DecoupledDecayState):
            return node
        group = group_prefix(path).removesuffix("/") or None
        return node._replace(
            anchor=tuple(
                leaf
                for i, leaf in enumerate(leaves)
                if decayed[i] and (labels is None or labels[i] == group)
            )
        )

    is_decay = lambda x: isinstance(x, DecoupledDecayState)  # noqa: E731
    flat, treedef = jax.tree_util.tree_flatten_with_path(state, is_leaf=is_decay)
    return jax.tree.unflatten(treedef, [fill(path, node) for path, node in flat])


# ---------------------------------------------------------------------------------------------
# composition


def build_optimizer(settings: OptimizerSettings, params: Any) -> tuple[OptimizerSetup, Any]:
    """The composed transformation and its initial state (hyperparameters still in it; the
    caller strips them)."""
    make_base, description, uses_lr = _base(settings)
    paths, leaves = leaf_paths(params), jax.tree.leaves(params)
    labels = group_labels(settings.param_group, settings.group_lr, paths)
    decayed = _decayed(settings, paths, leaves)
    decay_to = settings.decay_to
    if (
        isinstance(decay_to, Mapping)
        and decay_to
        and all(isinstance(v, str) for v in decay_to.values())
    ):
        decay_to = _group_anchors(decay_to, labels, params)
    toward = decay_to if isinstance(decay_to, str) else "given"

    def stage(group: str | None) -> optax.GradientTransformation:
        base = make_base()
        in_group = [labels is None or label == group for label in labels or paths]
        if decayed is None or not any(d and g for d, g in zip(decayed, in_group, strict=True)):
            return base
        decay = optax.inject_hyperparams(decoupled_weight_decay, static_args=("decayed", "toward"))(
            learning_rate=_PLACEHOLDER["learning_rate"],
            weight_decay=_PLACEHOLDER["weight_decay"],
            decayed=decayed,
            toward="zero" if toward == "zero" else "init",
        )
        return optax.chain(base, decay)

    if labels is None:
        body = stage(None)
    else:
        body = optax.partition(
            {group: stage(group) for group in sorted(set(labels))},
            lambda tree: jax.tree.unflatten(jax.tree.structure(tree), labels),
        )
    tx = body
    if settings.gradient_clip_norm is not None:
        clip = optax.inject_hyperparams(global_norm_clip)(
            gradient_clip_norm=_PLACEHOLDER["gradient_clip_norm"]
        )
        tx = optax.chain(clip, body)
    opt_state = tx.init(params)
    if any(isinstance(node, optax.MultiStepsState) for node in _states(opt_state)):
        raise _multi_steps_refused(None)
    if toward == "given":
        opt_state = _write_anchor(opt_state, anchor_leaves(decay_to, params), decayed, labels)
    fed, slots = _fed(settings, opt_state, labels, uses_lr)
    if description is None:  # a given transformation
        own = {
            "gradient_clip_norm": settings.gradient_clip_norm,
            "weight_decay": settings.weight_decay,
        }
        keys = sorted({f.key for f in fed if own.get(f.key) is None})
        if settings.learning_rate_explicit and "learning_rate" not in keys:
            raise OptimizerError(
                "learning_rate was given, but the optimizer is a GradientTransformation with "
                "its own baked-in rate. Return the factory instead (e.g. `return optax.adamw`) "
                "so Nitro injects the rate, or wrap it in optax.inject_hyperparams."
            )
        description = f"inject_hyperparams({', '.join(keys)})" if keys else "GradientTransformation"
    _check_values(settings, fed, description)
    groups = (
        () if labels is None else param_groups(labels, paths, leaves, settings.group_lr, decayed)
    )
    decayed_paths = (
        () if decayed is None else tuple(p for p, d in zip(paths, decayed, strict=True) if d)
    )
    setup = OptimizerSetup(
        tx=tx,
        description=description,
        fed=fed,
        slots=slots,
        uses_learning_rate=uses_lr,
        groups=groups,
        decayed=decayed_paths,
        decay_to=None if decayed is None else toward,
        gradient_clip_norm=settings.gradient_clip_norm,
    )
    return setup, opt_state


def _check_values(
    settings: OptimizerSettings, fed: tuple[FedHyperparameter, ...], description: str
) -> None:
    """Refuse a hyperparameter of the optimizer's own out of its range (`b1=1.5`, `eps=-1`),
    naming it and the optimizer, before anything compiles. The run keywords' own values
    (`learning_rate`, `weight_decay`, `gradient_clip_norm`) were checked when resolved; a
    scheduled value is never fed, and its schedule's values are checked instead."""
    spec = settings.optimizer or optax.adam
    for f in fed:
        bound = ranges.of(f.key)
        if bound.admits(f.constant) or {f.name, f.key} & settings.scheduled:
            continue  # a scheduled value is checked as the schedule gives it
        example = ranges.show(bound.example) if bound.example is not None else "..."
        if isinstance(spec, functools.partial):
            kwargs = {**spec.keywords, f.key: bound.example}
            given = ", ".join(
                f"{k}={ranges.show(v) if isinstance(v, float) else repr(v)}"
                for k, v in kwargs.items()
            )
            fix = f"optimizer=functools.partial({_describe_factory(spec.func)}, {given})"
        elif isinstance(spec, optax.GradientTransformation):
            fix = f"build the transformation with {f.key}={example}"
        else:
            fix = f"give the factory {f.key}={example}"
        ranges.check(f"{f.key} of the optimizer {description}", f.constant, bound, fix=fix)


def _fed(settings: OptimizerSettings, opt_state: Any, labels, uses_lr: bool):
    """The fed hyperparameters (name, constant, dtype) and each injected state's slot."""
    slots: list[tuple[str, tuple[str, ...]]] = []
    owned: dict[str, Any] = {}  # values the run's keywords set: fed name -> value
    given: dict[str, Any] = {}  # values the optimizer's own states hold
    dtypes: dict[str, Any] = {}
    ratios = dict(settings.group_lr or {})
    flat = jax.tree_util.tree_flatten_with_path(opt_state, is_leaf=_is_injected)[0]
    for path, node in flat:
        if not _is_injected(node):
            continue
        prefix = group_prefix(path)
        hyperparams = _numeric(node.hyperparams)
        slots.append((prefix, tuple(sorted(hyperparams))))
        is_decay = isinstance(node.inner_state, DecoupledDecayState)
        for key, value in hyperparams.items():
            name = prefix + key
            dtypes[name] = value.dtype
            if is_decay and key == "weight_decay":
                owned[name] = settings.weight_decay
            elif key == "gradient_clip_norm" and not prefix:
                owned[name] = settings.gradient_clip_norm
            elif not is_decay:
                number = np.asarray(value).item()
                if name in given and given[name] != number:
                    raise OptimizerError(
                        f"the optimizer injects {key!r} twice with different values "
                        f"({given[name]:g} and {number:g}); Nitro feeds one value per name. "
                        f"Give the hyperparameters different names, or use parameter groups "
                        f"(param_group) for different values."
                    )
                given[name] = number
    for name in owned:
        if name in given:
            key = name.rpartition("/")[2]
            raise OptimizerError(
                f"the {key} run keyword adds Nitro's own {key}, but the optimizer has a "
                f"hyperparameter {key!r} of its own (e.g. optax.adamw's decay). Use one: drop "
                f"{key}= or choose an optimizer without it (optax.adam for optax.adamw)."
            )
    fed = []
    for name in sorted(dtypes):
        prefix, _, key = name.rpartition("/")
        group = prefix or None
        scale = (
            float(ratios.get(group, 1.0)) if key == "learning_rate" and group is not None else 1.0
        )
        if key == "learning_rate":
            if name not in given:
                raise OptimizerError(
                    "weight_decay is scaled by the optimizer's learning rate, but the "
                    "optimizer is a GradientTransformation that does not inject one. Return "
                    "a factory (e.g. optax.adam) or wrap it in optax.inject_hyperparams."
                )
            base = settings.learning_rate if uses_lr else given[name]
            constant = base * scale
        elif name in owned:
            constant = owned[name]
        else:
            constant = given[name]
        fed.append(FedHyperparameter(name, key, group, float(constant), scale, dtypes[name]))
    if ratios and not any(f.key == "learning_rate" for f in fed):
        raise OptimizerError(
            "group_lr scales the learning rate, but the optimizer is a GradientTransformation "
            "that does not inject one. Return a factory (e.g. optax.adam) or wrap it in "
            "optax.inject_hyperparams."
        )
    return tuple(fed), tuple(slots)
