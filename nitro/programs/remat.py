"""Rematerialization (`remat=`): which of the model's modules recompute their activations in
the train step's backward pass instead of keeping them from the forward pass, and with which
`jax.checkpoint` policy.

A policy is `"full"` (keep nothing: each module keeps only its inputs), `"dots"` (keep the
matrix products, `jax.checkpoint_policies.dots_saveable`), or a `jax.checkpoint` policy
callable. Given alone it applies to the model's composite modules, the ones holding modules of
their own (a transformer's blocks and the attention inside each), or to every module when none
holds others. Module paths (`"blocks"`, `"blocks.0.attention"`, a
list of them, or a dict path -> policy) name the modules instead; a path naming a list applies
to each module in it. Inside the traced train step each named module's `__call__` runs under
`nnx.remat`; the values computed are the same, only what the backward pass keeps changes.
"""

from __future__ import annotations

import dataclasses
import functools
import types
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
from flax import nnx

from nitro.experiments.fingerprint import callable_token

__all__ = ["POLICIES", "Remat", "remat_options"]

# the named policies; a `jax.checkpoint` policy callable is taken as it is
POLICIES: dict[str, Callable[..., bool]] = {
    "full": jax.checkpoint_policies.nothing_saveable,
    "dots": jax.checkpoint_policies.dots_saveable,
}
_LAYERS = ""  # a rule's path meaning "the model's composite modules"
_EXAMPLE = "remat='full', remat=['blocks'] or remat={'blocks': 'dots'}"

Policy = str | Callable[..., Any]


def _policy(value: Any, where: str) -> Policy:
    if (isinstance(value, str) and value in POLICIES) or (
        callable(value) and not isinstance(value, type)
    ):
        return value
    raise ValueError(
        f"{where} must be a policy: one of {sorted(POLICIES)} or a jax.checkpoint policy "
        f"(jax.checkpoint_policies.*); got {value!r}. E.g. {_EXAMPLE}"
    )


def _path(value: Any) -> str:
    if not isinstance(value, str) or not value.strip("."):
        raise ValueError(
            f"remat= module paths must be non-empty strings such as 'blocks' or "
            f"'blocks.0.attention'; got {value!r}. E.g. {_EXAMPLE}"
        )
    return value.strip(".")


@dataclasses.dataclass(frozen=True)
class Remat:
    """The `remat=` keyword: `rules` as given ((module path, or "" for the model's composites;
    policy)), and once resolved against the model, `modules`: each module's path with its
    policy."""

    rules: tuple[tuple[str, Policy], ...]
    modules: tuple[tuple[str, Policy], ...] = ()

    @classmethod
    def of(cls, value: Any) -> Remat | None:
        """The keyword's value checked for its form (the paths are checked against the model
        at setup, `resolve`); None for no rematerialization."""
        if value is None or value == "none" or isinstance(value, Remat):
            return value if isinstance(value, Remat) else None
        if isinstance(value, str) and value in POLICIES or callable(value):
            return cls(
                (
                    (
                        _LAYERS,
                        _policy(value, "remat="),
                    ),
                )
            )
        if isinstance(value, str):
            return cls(((_path(value), "full"),))
        if isinstance(value, Mapping):
            rules = tuple(
                (_path(path), _policy(policy, f"remat={{{path!r}: ...}}"))
                for path, policy in value.items()
                if policy != "none"
            )
            return cls(rules) if rules else None
        if isinstance(value, Sequence) and value:
            return cls(tuple((_path(path), "full") for path in value))
        raise ValueError(
            f"remat= takes 'none', a policy ({', '.join(map(repr, POLICIES))} or a "
            f"jax.checkpoint policy), module paths, or a dict path -> policy; got {value!r}. "
            f"E.g. {_EXAMPLE}"
        )

    def resolve(self, model: Any) -> Remat:
        """These rules applied to `model`: the modules each names. A path the model does not
        have is refused, listing the paths it has."""
        if not isinstance(model, nnx.Module):
            raise ValueError(
                f"remat= applies to Flax NNX modules; this model is a {type(model).__name__}"
            )
        modules, lists = module_paths(model)
        chosen: dict[str, Policy] = {}
        for path, policy in self.rules:
            if path == _LAYERS:
                found = _composites(modules)
                if not found:
                    raise ValueError(
                        f"remat={_show(policy)} applies to the model's modules, and "
                        f"{type(model).__name__} has no submodules: name none, or build it "
                        f"of modules"
                    )
            elif path in lists:
                found = lists[path]
            elif path in modules:
                found = [path]
            else:
                raise ValueError(
                    f"remat= names the module path {path!r}, which "
                    f"{type(model).__name__} does not have; its module paths: "
                    f"{_listed([*lists, *modules])}"
                )
            chosen.update(dict.fromkeys(found, policy))
        return dataclasses.replace(self, modules=tuple(chosen.items()))

    @property
    def program_key(self) -> str:
        """What the train step is keyed by: each module's path and its policy's name (a
        callable by its code and closure values)."""
        return "; ".join(f"{path}: {_key(policy)}" for path, policy in self.modules)

    def describe(self) -> str:
        """`'full' on blocks.0, blocks.1`, grouped by policy (before `resolve`: the rules, the
        model's composite modules as `the model`)."""
        by_policy: dict[str, list[str]] = {}
        for path, policy in self.modules or self.rules:
            by_policy.setdefault(_show(policy), []).append(path or "the model")
        return "; ".join(f"{policy} on {_listed(paths)}" for policy, paths in by_policy.items())

    def __repr__(self) -> str:
        return f"Remat({self.describe()})"

    def apply(self, model: nnx.Module) -> None:
        """Make each named module of `model` (a copy merged inside the traced step) call
        itself under `nnx.remat` with its policy."""
        for path, policy in self.modules:
            node: Any = model
            for part in path.split("."):
                node = node[int(part)] if part.isdigit() else getattr(node, part)
            node.__class__ = _rematerialized(type(node), POLICIES.get(policy, policy))  # type: ignore[arg-type]


def remat_options(remat: Remat | None, platform: str) -> dict[str, str]:
    """The XLA options a train step with `remat` compiles with. XLA's CPU pipeline removes
    the optimization barriers `jax.checkpoint` places early (its `cse_barrier_expander`
    pass), and its scheduler then moves the recomputation up into the forward pass, where it
    costs memory instead of saving it; keeping the barriers keeps it in the backward pass."""
    if remat is None or platform != "cpu":
        return {}
    return {"xla_disable_hlo_passes": "cse_barrier_expander"}


def module_paths(model: nnx.Module) -> tuple[list[str], dict[str, list[str]]]:
    """(the paths of `model`'s submodules, in order; each list of modules' path -> the paths
    of the modules it holds)."""
    modules, lists = [], {}
    nodes = sorted(
        nnx.iter_graph(model), key=lambda item: [(isinstance(k, int), f"{k:09}") for k in item[0]]
    )
    for path, node in nodes:
        if not path:
            continue
        name = ".".join(map(str, path))
        if isinstance(node, (nnx.List, list, tuple)):
            held = [f"{name}.{i}" for i, n in enumerate(node) if isinstance(n, nnx.Module)]
            if held:
                lists[name] = held
        elif isinstance(node, nnx.Module):
            modules.append(name)
    return modules, lists


def _composites(modules: list[str]) -> list[str]:
    """The modules holding modules of their own (a transformer's blocks and their attention),
    else every module: a leaf such as a Linear keeps little beyond its input anyway."""
    held = [p for p in modules if any(q.startswith(p + ".") for q in modules)]
    return held or modules


def _show(policy: Policy) -> str:
    if isinstance(policy, str):
        return repr(policy)
    return getattr(policy, "__qualname__", None) or type(policy).__name__


def _key(policy: Policy) -> str:
    return policy if isinstance(policy, str) else f"{_show(policy)} {callable_token(policy)}"


def _listed(paths: Sequence[str], limit: int = 12) -> str:
    shown = ", ".join(paths[:limit])
    return shown + (f", ... ({len(paths) - limit} more)" if len(paths) > limit else "")


@functools.cache
def _rematerialized(cls: type, policy: Callable[..., bool]) -> type:
    """`cls` whose `__call__` runs under `nnx.remat(policy=policy)`. Arrays and NNX objects
    (an `nnx.Rngs`) pass through the remat; other arguments (flags, shapes) stay Python
    values, so the module's code branches on them as it does without remat."""
    if getattr(cls, "_nitro_remat_of", None) is not None:
        cls = cls._nitro_remat_of  # type: ignore[attr-defined]
    method = cls.__call__  # type: ignore[attr-defined]

    def __call__(self, *args, **kwargs):
        leaves, tree = jax.tree.flatten((args, kwargs), is_leaf=nnx.graph.is_graph_node)
        traced = [isinstance(x, jax.Array) or nnx.graph.is_graph_node(x) for x in leaves]

        def run(module, inputs):
            given = iter(inputs)
            values = [next(given) if t else x for x, t in zip(leaves, traced, strict=True)]
            args, kwargs = jax.tree.unflatten(tree, values)
            return method(module, *args, **kwargs)

        inputs = [x for x, t in zip(leaves, traced, strict=True) if t]
        return nnx.remat(run, policy=policy)(self, inputs)

    return types.new_class(
        cls.__name__,
        (cls,),
        exec_body=lambda ns: ns.update(
            __call__=__call__,
            __module__=cls.__module__,
            __qualname__=cls.__qualname__,
            _nitro_remat_of=cls,
        ),
    )
