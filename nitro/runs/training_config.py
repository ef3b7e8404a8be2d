"""The run keywords that change how a run trains, as each checkpoint records them, and what
a resume with other values says.

A resume continues the run with the keywords it is given: a changed `accum=`, `sam=`, `ema=`,
`precision=`, optimizer, learning rate, `gradient_clip_norm=`, `weight_decay=`, `decay_to=` or
parameter groups is used from the first resumed step (as Keras and Lightning do with a changed
argument), and a warning names each difference and the keywords that continue the run as it
was trained. An optimizer whose state no longer fits is refused before this, by the restore.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from nitro.core.run_setup import RunSetup
from nitro.optim import ranges

__all__ = ["training_config", "training_differences"]

# key -> how the keyword that sets it is written (None: no one keyword does)
_KEYWORDS = {
    "optimizer": None,
    "accum": "accum",
    "sam": "sam",
    "ema": "ema",
    "gradient_clip_norm": "gradient_clip_norm",
    "weight_decay": "weight_decay",
    "decay_to": "decay_to",
    "param_groups": None,
    "precision": "precision",
}


def training_config(setup: RunSetup) -> dict[str, Any]:
    """The keywords that change the training, as JSON values (a checkpoint's `training`).

    `optimizer` is the optimizer's own description, its learning rate included
    (`optax.adam(learning_rate=0.001)`); `param_groups` maps each group to its `group_lr`
    ratio (None: the learning rate itself)."""
    optimizer = setup.optimizer
    weight_decay = (
        setup.keywords["weight_decay"].value if "weight_decay" in setup.keywords else None
    )
    return {
        "optimizer": optimizer.description if optimizer is not None else None,
        "accum": setup.accum,
        "sam": _written(setup.sam),
        "ema": _written(setup.ema),
        "gradient_clip_norm": getattr(optimizer, "gradient_clip_norm", None),
        "weight_decay": float(weight_decay) if weight_decay is not None else None,
        "decay_to": optimizer.decay_to if optimizer is not None else None,
        "param_groups": (
            {g.name: g.lr_ratio for g in optimizer.groups}
            if optimizer is not None and optimizer.groups
            else None
        ),
        "precision": _precision(setup.precision),
    }


def training_differences(saved: Mapping[str, Any] | None, now: dict[str, Any]) -> str | None:
    """What a resume warns, when this run's training keywords differ from the checkpoint's
    (`saved`; None: a checkpoint of a Nitro that did not record them: nothing to compare).

    >>> print(training_differences({"accum": 3, "sam": "nitro.SAM(rho=0.05)"},
    ...                            {"accum": 1, "sam": None}))
    resuming with run keywords that differ from the checkpoint's; the run continues with this run's:
      accum: the checkpoint's 3, this run's 1
      sam: the checkpoint's nitro.SAM(rho=0.05), this run's None
    To continue as the checkpoint was trained, resume with its keywords: accum=3, sam=nitro.SAM(rho=0.05)
    """
    if not saved:
        return None
    changed = [key for key in _KEYWORDS if key in saved and saved[key] != now.get(key)]
    if not changed:
        return None
    lines = [
        f"  {key}: the checkpoint's {_shown(saved[key])}, this run's {_shown(now.get(key))}"
        for key in changed
    ]
    fixes = [
        f"{_KEYWORDS[key]}={_shown(saved[key], keyword=True)}"
        for key in changed
        if _KEYWORDS[key] is not None
    ]
    if any(_KEYWORDS[key] is None for key in changed):
        fixes.append("the same optimizer=, learning_rate=, group_lr= and param_group method")
    return (
        "resuming with run keywords that differ from the checkpoint's; the run continues with "
        "this run's:\n"
        + "\n".join(lines)
        + "\nTo continue as the checkpoint was trained, resume with its keywords: "
        + ", ".join(fixes)
    )


def _written(value: Any) -> str | None:
    """A SAM, ASAM or EMA as the keyword is written: `nitro.ASAM(rho=0.5, eta=0.01)`."""
    if value is None:
        return None
    return f"nitro.{value!r}"


def _precision(value: Any) -> str:
    """A precision as the keyword is written: 'bfloat16', or `nitro.Precision('float16',
    loss_scale=1024.0)` when it sets more than the dtype."""
    if value is None:
        return "float32"
    if value.loss_scale is None and value.growth_interval is None:
        return value.compute
    return f"nitro.{value!r}"


def _shown(value: Any, keyword: bool = False) -> str:
    if isinstance(value, float):
        return ranges.show(value)
    if isinstance(value, str) and not value.startswith("nitro.") and keyword:
        return repr(value)
    return str(value)
