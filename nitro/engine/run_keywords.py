"""Run keywords: settings of a run, each resolved by name.

Each keyword resolves in this order: the `Nitro(...)` keyword, a method of the same name on
the experiment (called with no arguments), a Host field of the same name, the framework
default. Adding a keyword is one `RunKeyword(...)` line in `RUN_KEYWORDS`.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Mapping
from typing import Any, Literal

from nitro.core.frozen import freeze
from nitro.core.provenance import Resolved
from nitro.engine.dispatch import DispatchChoice
from nitro.errors import SetupError, did_you_mean
from nitro.experiments.declaration import FieldKind, field_specs, has_method
from nitro.optim import ranges

__all__ = ["RUN_KEYWORDS", "KEYWORD_ONLY", "RunKeyword", "Resolved", "resolve_run_keywords"]

NITRO_KEYWORD = "Nitro keyword"
METHOD = "method on experiment"
FIELD = "field on experiment"
DEFAULT = "framework default"


def _default_workers() -> int:
    from nitro.data.prefetch import default_workers

    return default_workers()


def _default_n_devs() -> int:
    import jax

    return jax.device_count()


def _positive_int(name):
    def check(value):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        return value

    return check


def _int(name):
    def check(value):
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"{name} must be an int, got {value!r}")
        return value

    return check


def _bool(name):
    def check(value):
        if not isinstance(value, bool):
            raise ValueError(f"{name} must be True or False, got {value!r}")
        return value

    return check


def _choice(name, choices):
    def check(value):
        if value not in choices:
            raise ValueError(
                f"{name} must be one of {', '.join(map(repr, choices))}, got {value!r}"
            )
        return value

    return check


def _learning_rate(value):
    return ranges.check(
        "learning_rate",
        value,
        ranges.POSITIVE.with_example(1e-3),
        note="to start it at 0, schedule it: schedules={'learning_rate': ...}",
    )


def _number(name, bound: ranges.Range, *, off: str):
    """A number in `bound`, or None (`off` says what None does)."""

    def check(value):
        return ranges.check(name, value, bound, note=f"None {off}")

    return check


def _group_lr(value):
    if not isinstance(value, Mapping) or not value:
        raise ValueError(
            f"group_lr must be a dict of parameter group -> learning-rate ratio, e.g. "
            f"{{'backbone': 0.1, 'head': 1.0}}; got {value!r}"
        )
    ratios = {}
    for group, ratio in value.items():
        if not isinstance(group, str):
            raise ValueError(f"group_lr keys are group names (str); got {group!r}")
        ratios[group] = ranges.check(
            f"group_lr[{group!r}]",
            ratio,
            ranges.NON_NEGATIVE,
            note="a ratio of the learning rate; 0 freezes the group",
            fix=f"group_lr={{{group!r}: 0.1}}",
        )
    return ratios


def _decay_to(value):
    if isinstance(value, str) and value not in ("zero", "init"):
        raise ValueError(
            f"decay_to must be 'zero', 'init' (the weights the run starts from), or a model or "
            f"tree of anchor weights shaped like the parameters; got {value!r}"
        )
    return value


def _predicate(name, signature):
    def check(value):
        if not callable(value):
            raise ValueError(f"{name} must be a function {signature}, got {value!r}")
        return value

    return check


def _path(name):
    def check(value):
        if not isinstance(value, (str, os.PathLike)) or not str(value):
            raise ValueError(f"{name} must be a path, got {value!r}")
        return os.fspath(value)

    return check


def _name(value):
    if not isinstance(value, str) or not value.strip():
        raise ValueError(f"name must be a non-empty str (or None: unnamed), got {value!r}")
    return value


def _default_logger():
    from nitro.loggers import JSONLinesLogger

    return JSONLinesLogger()


def _logger(value):
    from nitro.loggers import as_logger

    try:
        return as_logger(value)
    except TypeError as error:
        raise ValueError(str(error)) from None


def _checkpointer(value):
    from nitro.runs.checkpoints import Checkpointer

    if value is True:
        return Checkpointer()
    if value is False:
        return None
    if not isinstance(value, Checkpointer):
        raise ValueError(
            f"checkpointer must be a nitro.Checkpointer(k=, metric=, mode=, every=) or None, "
            f"got {value!r}"
        )
    return value


def _early_stop(value):
    from nitro.runs.early_stopping import EarlyStopping

    if not isinstance(value, EarlyStopping):
        raise ValueError(
            f"early_stop must be a nitro.EarlyStopping(metric=, mode=, patience=, min_delta=) "
            f"or None, got {value!r}"
        )
    return value


def _snapshots(value):
    from nitro.engine.snapshots import check_snapshots

    try:
        return check_snapshots(value)
    except SetupError as error:
        raise ValueError(str(error)) from None


def _spike(value):
    from nitro.engine.spikes import check_spike

    try:
        return check_spike(value)
    except SetupError as error:
        raise ValueError(str(error)) from None


def _resume(value):
    if value is False or value == "auto":
        return value
    if value is True:
        return "auto"
    if isinstance(value, (str, os.PathLike)):
        return os.fspath(value)
    if isinstance(value, tuple) and len(value) == 2 and value[1] in ("best", "latest"):
        return (os.fspath(value[0]), value[1])
    raise ValueError(
        f"resume must be 'auto', a run directory or checkpoint path, (run_dir, 'latest'), or "
        f"False; got {value!r}"
    )


def _preemption(value):
    if value is True or value is False or value == "auto":
        return value
    raise ValueError(
        f"preemption must be 'auto', True or False, got {value!r}: 'auto' saves and exits on "
        f"SIGTERM or SIGUSR1 in a script, True wherever train() runs on the main thread, "
        f"False never"
    )


def _ema(value):
    from nitro.optim.ema import EMA

    try:
        return EMA.of(value)
    except ValueError as error:
        raise ValueError(str(error)) from None


def _sam(value):
    from nitro.optim.sam import SAM

    try:
        return SAM.of(value)
    except ValueError as error:
        raise ValueError(str(error)) from None


def _precision(value):
    from nitro.optim.precision import Precision

    try:
        return Precision.of(value)
    except ValueError as error:
        raise ValueError(str(error)) from None


def _compile_options(value):
    from nitro.programs.compile_options import CompileOptions

    return CompileOptions.of(value)


def _hooks(value):
    from nitro.experiments.hooks import Hooks

    return Hooks.of(value)


def _remat(value):
    from nitro.programs.remat import Remat

    return Remat.of(value)


def _steps_per_dispatch(value):
    if value == "auto" or isinstance(value, DispatchChoice):  # n.dispatch: continue it
        return value
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"steps_per_dispatch must be 'auto' or an int >= 1, got {value!r}")
    return value


def _eval_splits(value):
    names = (value,) if isinstance(value, str) else value
    if (
        not isinstance(names, (tuple, list))
        or not all(isinstance(name, str) and name for name in names)
        or len(set(names)) != len(names)
    ):
        raise ValueError(
            f"eval_splits must be a tuple of split names from build_data, each once, e.g. "
            f"('val', 'test'), or () to evaluate none; got {value!r}"
        )
    if "train" in names:
        raise ValueError(
            "eval_splits names 'train', the split being trained: its loss is the history's "
            "'loss' column; evaluate it after training with n.evaluate('train')"
        )
    return tuple(names)


def _val_every_steps(value):
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(
            f"val_every_steps must be an int >= 1 (evaluate the eval splits every that many "
            f"optimizer steps, within epochs as well as at their ends), or None (at epochs' "
            f"ends only); got {value!r}"
        )
    return value


def _max_steps(value):
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(
            f"max_steps must be an int >= 1 (the optimizer step training stops at), or None "
            f"(no limit); got {value!r}"
        )
    return value


def _sharding(value):
    from collections.abc import Mapping as _Mapping

    from nitro.core.sharding import check_rules

    if isinstance(value, _Mapping):
        return check_rules(value)
    if value not in ("replicated", "fsdp", "rules"):
        raise ValueError(
            f"sharding must be 'replicated', 'fsdp', 'rules' (the model's nnx.with_partitioning "
            f"annotations) or a dict of parameter path pattern -> PartitionSpec, e.g. "
            f"{{r'qkv\\.kernel': (None, 'model')}}; got {value!r}"
        )
    return value


def _mesh(value):
    if (
        not isinstance(value, Mapping)
        or "data" not in value
        or not all(
            isinstance(k, str) and isinstance(v, int) and not isinstance(v, bool) and v >= 1
            for k, v in value.items()
        )
    ):
        raise ValueError(
            f"mesh must be a dict of axis name -> size (ints >= 1) with a 'data' axis, the "
            f"axis the batch is split over, e.g. {{'data': 4, 'model': 2}}, or None (a 'data' "
            f"mesh over n_devs devices); got {value!r}"
        )
    return dict(value)


def _schedules(value):
    if not isinstance(value, Mapping):
        raise ValueError(f"schedules must be a dict of key -> schedule, got {type(value).__name__}")
    return dict(value)


class _DefaultCheckpointer:
    """The framework default: Checkpointer() (a marker, so the table needs no import)."""

    def __repr__(self) -> str:
        return "Checkpointer()"


_DEFAULT_CHECKPOINTER = _DefaultCheckpointer()


@dataclasses.dataclass(frozen=True)
class RunKeyword:
    name: str
    default: Any  # a value, or a zero-argument callable computing it (`computed=True`)
    doc: str
    check: Callable[[Any], Any] | None = None
    computed: bool = False
    shown_default: str = ""  # how `help(Nitro)` shows a computed default
    none: str = ""  # what None does ("turns weight decay off"); "": None is refused
    # what the keyword takes, as `nitro train --help` shows it and reads a value given as text:
    # an annotation, or a string naming objects that only Python builds
    type: Any = Any

    @property
    def default_text(self) -> str:
        """The default as `help(Nitro)` and `inspect.signature(Nitro)` show it."""
        return self.shown_default if self.computed else repr(self.default)

    def checked(self, value: Any) -> Any:
        """`value` as the run uses it, or a ValueError naming the keyword, what it takes and
        the fix. None passes only where the keyword says what None does.

        >>> RUN_KEYWORDS["max_epochs"].checked(None)
        Traceback (most recent call last):
        ValueError: max_epochs=None is not a setting (max_epochs: epochs `train()` runs to). Leave it out for the default (the framework's: max_epochs=1)
        """
        if value is None:
            if self.none:
                return None
            raise ValueError(
                f"{self.name}=None is not a setting ({self.name}: {self.doc}). Leave it out "
                f"for the default (the framework's: {self.name}={self.default_text})"
            )
        return value if self.check is None else self.check(value)

    def default_value(self, experiment: Any) -> Any:
        if self.computed:
            return self.default(experiment)
        return self.default


RUN_KEYWORDS: dict[str, RunKeyword] = {
    k.name: k
    for k in [
        RunKeyword(
            "seed",
            0,
            "seeds the model's nnx.Rngs, the data order and the hooks' rngs",
            _int("seed"),
            type=int,
        ),
        RunKeyword(
            "run_dir",
            None,
            "this run's directory (default runs/<Experiment>/<run id>)",
            _path("run_dir"),
            none="runs/<Experiment>/<run id>",
            type=str | None,
        ),
        RunKeyword(
            "checkpointer",
            _DEFAULT_CHECKPOINTER,
            "a nitro.Checkpointer, or None to save no checkpoints",
            _checkpointer,
            none="saves no checkpoints",
            type="Checkpointer | bool | None",
        ),
        RunKeyword(
            "logger",
            lambda e: _default_logger(),
            "where metrics go: a logger, a list of loggers, or None (default: JSON Lines in "
            "<run_dir>/metrics.jsonl)",
            _logger,
            computed=True,
            shown_default="JSONLinesLogger()",
            none="logs nothing",
            type="logger | list[logger] | None",
        ),
        RunKeyword(
            "early_stop",
            None,
            "a nitro.EarlyStopping, or None",
            _early_stop,
            none="never stops early",
            type="EarlyStopping | None",
        ),
        RunKeyword(
            "snapshots",
            True,
            "keep the run's state in host memory at a cadence, to rewind to (n.rewind), fork "
            "from (n.fork) and roll a spike back to: a nitro.Snapshots(every=, keep=, "
            "max_bytes=), an int (every that many steps), True (nitro.Snapshots(): as often "
            "as 1% of training time allows) or False (docs/time-travel.md)",
            _snapshots,
            none="keeps none",
            type="Snapshots | int | bool | None",
        ),
        RunKeyword(
            "spike",
            None,
            "roll the run back over a loss spike, leaving out the batches of the call that "
            "spiked (in a population, each member alone): a nitro.Spike(rtol=, window=, "
            "max_rollbacks=), True (nitro.Spike()) or None (docs/time-travel.md)",
            _spike,
            none="off",
            type="Spike | bool | None",
        ),
        RunKeyword(
            "restore_best",
            False,
            "end each train() on the weights of the run's best checkpoint by the checkpointer's "
            "metric (Keras's restore_best_weights); the optimizer state, counters and history "
            "stay the last step's",
            _bool("restore_best"),
            type=bool,
        ),
        RunKeyword(
            "restore_optimizer",
            None,
            "whether the optimizer state is read with the weights: resume= reads it unless "
            "False (a fresh optimizer state on the resumed model, which may be another "
            "optimizer); weights= starts it afresh unless True (the state of the handle or "
            "single run's checkpoint the weights come from)",
            _bool("restore_optimizer"),
            none="resume= restores it, weights= starts afresh",
            type=bool | None,
        ),
        RunKeyword(
            "resume",
            False,
            "'auto' (this experiment's run: the one its name last trained, else the furthest "
            "trained), a run directory or checkpoint, or False",
            _resume,
            type=str | bool | tuple[str, str],
        ),
        RunKeyword(
            "preemption",
            "auto",
            "what SIGTERM and SIGUSR1 do while train() runs: stop after the current step, save "
            "it and exit the process with code 75, for resume='auto' to continue (a job's "
            "preemption or time limit); 'auto': so in a script, not in a notebook, IPython or "
            "a REPL, for each signal the program left at its default; True: wherever train() "
            "runs on the main thread; False: the signals keep their handlers (docs/preemption.md)",
            _preemption,
            type=Literal["auto"] | bool,
        ),
        RunKeyword(
            "name",
            None,
            "this run's name, recorded in run.json; resume='auto' continues the run this name "
            "last trained first (%nitro train exp names its runs exp_run)",
            _name,
            none="unnamed",
            type=str | None,
        ),
        RunKeyword(
            "n_devs",
            lambda e: _default_n_devs(),
            "devices in the data-parallel mesh (1: no mesh)",
            _positive_int("n_devs"),
            computed=True,
            shown_default="jax.device_count()",
            none="every visible device",
            type=int | None,
        ),
        RunKeyword(
            "mesh",
            None,
            "the device mesh's named axes: a dict of axis name -> size with a 'data' axis (the "
            "batch's), e.g. {'data': 4, 'model': 2}; it spans their product of devices, which "
            "n_devs then defaults to (None: a 'data' mesh over n_devs)",
            _mesh,
            none="a 'data' mesh over n_devs",
            type=dict[str, int] | None,
        ),
        RunKeyword(
            "sharding",
            "replicated",
            "how parameters and optimizer state lie on the mesh: 'replicated' (data parallel), "
            "'fsdp' (each leaf split along its largest axis the 'data' size divides), 'rules' "
            "(the model's nnx.with_partitioning annotations), or a dict of parameter path regex "
            "-> PartitionSpec (it takes precedence over annotations); docs/distributed.md",
            _sharding,
            type=Literal["replicated", "fsdp", "rules"] | dict[str, Any],
        ),
        RunKeyword(
            "max_epochs", 1, "epochs `train()` runs to", _positive_int("max_epochs"), type=int
        ),
        RunKeyword(
            "max_steps",
            None,
            "the optimizer step training stops at, mid-epoch if need be (None: no limit; "
            "max_epochs still applies)",
            _max_steps,
            none="no limit",
            type=int | None,
        ),
        RunKeyword(
            "val_every_steps",
            None,
            "also evaluate the eval splits every N optimizer steps within epochs (Lightning's "
            "val_check_interval); the results: n.validations() (None: at epochs' ends only)",
            _val_every_steps,
            none="at epochs' ends only",
            type=int | None,
        ),
        RunKeyword(
            "eval_splits",
            None,
            "the splits evaluated at each epoch's end, each under its prefix (val_loss, "
            "test_loss, ...); default ('val',) when build_data has one",
            _eval_splits,
            none="('val',) when build_data has one",
            type=str | tuple[str, ...] | None,
        ),
        RunKeyword(
            "validation_split",
            None,
            "hold out the last fraction of the 'train' split's arrays as the 'val' split, split "
            "before any shuffling (Keras's validation_split)",
            _number(
                "validation_split",
                ranges.Range(0.0, 1.0, low_in=False).with_example(0.2),
                off="no split held out",
            ),
            none="no split held out",
            type=float | None,
        ),
        RunKeyword(
            "schedules",
            {},
            "key -> schedule for optimizer hyperparameters or Device fields",
            _schedules,
            type="dict[str, schedule]",
        ),
        RunKeyword(
            "learning_rate",
            1e-3,
            "learning rate of the default optimizer",
            _learning_rate,
            type=float,
        ),
        RunKeyword(
            "optimizer",
            None,
            "an optax GradientTransformation or factory (default: adam)",
            none="adam",
            type="optax.GradientTransformation | factory | None",
        ),
        RunKeyword(
            "group_lr",
            None,
            "parameter group -> learning-rate ratio (groups come from a param_group(self, path) "
            "method)",
            _group_lr,
            none="one learning rate for every parameter",
            type=dict[str, float] | None,
        ),
        RunKeyword(
            "weight_decay",
            None,
            "decoupled weight decay, scaled by the learning rate (None: off)",
            _number("weight_decay", ranges.OPTAX["weight_decay"], off="turns weight decay off"),
            none="off",
            type=float | None,
        ),
        RunKeyword(
            "decay_to",
            "zero",
            "where weight decay pulls: 'zero', 'init' (L2-SP), a model or tree of anchors, or "
            "parameter group -> 'zero' | 'init'",
            _decay_to,
            type=Literal["zero", "init"],
        ),
        RunKeyword(
            "decay_mask",
            None,
            "(path, leaf) -> bool: the leaves that decay (default: those with ndim > 1)",
            _predicate("decay_mask", "(path, leaf) -> bool"),
            none="the leaves with ndim > 1",
            type="(path, leaf) -> bool | None",
        ),
        RunKeyword(
            "gradient_clip_norm",
            None,
            "clip the gradient to this global norm before the optimizer (None: off)",
            _number(
                "gradient_clip_norm", ranges.OPTAX["gradient_clip_norm"], off="turns clipping off"
            ),
            none="off",
            type=float | None,
        ),
        RunKeyword(
            "freeze_batch_stats",
            False,
            "keep the batch statistics (BatchNorm's) of a parameter group while its learning "
            "rate is 0 (a frozen backbone)",
            _bool("freeze_batch_stats"),
            type=bool,
        ),
        RunKeyword(
            "check_divergence",
            True,
            "stop with an error on a non-finite loss",
            _bool("check_divergence"),
            type=bool,
        ),
        RunKeyword(
            "prefetch_workers",
            lambda e: _default_workers(),
            "threads (or processes, with prefetch='processes') building host batches for "
            "index-addressable sources",
            _positive_int("prefetch_workers"),
            computed=True,
            shown_default="min(4, os.cpu_count())",
            type=int,
        ),
        RunKeyword(
            "device_batches",
            1,
            "batches staged on the device ahead of the loop",
            _positive_int("device_batches"),
            type=int,
        ),
        RunKeyword(
            "host_batches",
            None,
            "host batches built ahead (default 2 x prefetch_workers)",
            none="2 x prefetch_workers",
            type=int | None,
        ),
        RunKeyword("ordered", True, "deliver batches in source order", _bool("ordered"), type=bool),
        RunKeyword(
            "accum",
            1,
            "micro-batches per optimizer step (gradient accumulation; schedules count steps; an "
            "epoch's last step takes the micro-batches left, their mean gradient)",
            _positive_int("accum"),
            type=int,
        ),
        RunKeyword(
            "ema",
            None,
            "keep a moving average of the weights: a decay in (0, 1) (warmed up as "
            "nitro.EMA(decay) is), a nitro.EMA, or None",
            _ema,
            none="no moving average",
            type="float | EMA | None",
        ),
        RunKeyword(
            "sam",
            None,
            "sharpness-aware minimization: a radius, nitro.SAM(rho=), nitro.ASAM(rho=, eta=)",
            _sam,
            none="off",
            type="float | SAM | ASAM | None",
        ),
        RunKeyword(
            "precision",
            "float32",
            "the dtype the forward and backward passes compute in: 'float32', 'bfloat16', or "
            "'float16' (with dynamic loss scaling); parameters, optimizer state and loss stay "
            "float32 (or a nitro.Precision(...))",
            _precision,
            type=Literal["float32", "bfloat16", "float16"] | str,
        ),
        RunKeyword(
            "compile_options",
            None,
            "XLA compiler options for every program the handle compiles, as JAX's "
            ".compile(compiler_options=...) takes them: a dict of option -> value, or of "
            "program kind ('train', 'eval', 'predict', 'metrics') -> such a dict; they key the "
            "compile cache (an unknown option is refused before setup)",
            _compile_options,
            none="XLA's defaults",
            type="dict[str, bool | int | float | str] | None",
        ),
        RunKeyword(
            "hooks",
            None,
            "hook functions that override the experiment's methods of those names for this "
            "handle, each taking self first: nitro.hooks(loss=fn) | nitro.hooks(metrics=g), "
            "or a dict; a set mixes no traced with host hooks, and a traced hook captures no "
            "jax array",
            _hooks,
            none="the experiment's own methods",
            type="dict[str, Callable] | nitro.Hooks | None",
        ),
        RunKeyword(
            "remat",
            None,
            "which modules recompute their activations in the backward pass instead of keeping "
            "them (less memory, more compute): a policy ('full', 'dots' or a jax.checkpoint "
            "policy) for the model's layers, module paths ('blocks'), or a dict path -> policy; "
            "it keys the train step",
            _remat,
            none="no rematerialization",
            type="str | list[str] | dict[str, str] | None",
        ),
        RunKeyword(
            "steps_per_dispatch",
            "auto",
            "training steps per program call: an int K, 'auto' (measure the first steps "
            "and pick K so one call does a few milliseconds of work), or an earlier handle's "
            "n.dispatch (continue what it measured)",
            _steps_per_dispatch,
            type=Literal["auto"] | int,
        ),
        RunKeyword(
            "prefetch",
            "auto",
            "'threads', 'processes' (worker processes run an index-addressable source's "
            "batch_at: Python-heavy transforms), 'inline', or 'auto': inline for sources whose "
            "batches build in microseconds, processes when two threads measure no faster than "
            "one (the work holds the interpreter lock), threads otherwise",
            _choice("prefetch", ("auto", "threads", "processes", "inline")),
            type=Literal["auto", "threads", "processes", "inline"],
        ),
        RunKeyword(
            "persistent_workers",
            False,
            "keep prefetch='processes' worker processes alive from one train() or evaluate() "
            "call to the next (stopped by close(), a change of the source or its code's files, "
            "and the process's end); False starts them each call",
            _bool("persistent_workers"),
            type=bool,
        ),
        RunKeyword(
            "progress",
            True,
            "True, False, 'lines', 'bar' or a reporter object",
            none="silent, as False",
            type=bool | Literal["lines", "bar"] | None,
        ),
    ]
}

# Keywords that only exist on Nitro(...): no accessor, no field.
KEYWORD_ONLY = {
    "weights": "start from these weights: a Nitro handle, a run directory or checkpoint, "
    "(run_dir, 'best' | 'latest'), or nitro.average(run_dir, k=3)",
    "data": "use these splits instead of calling build_data",
}


def check_keywords(kwargs: Mapping[str, Any]) -> None:
    known = set(RUN_KEYWORDS) | set(KEYWORD_ONLY)
    for name in kwargs:
        if name not in known:
            raise TypeError(
                f"Nitro() got an unknown keyword {name!r}.{did_you_mean(name, known)} Run keywords: "
                f"{', '.join(sorted(known))}."
            )


def resolve_run_keywords(experiment: Any, kwargs: Mapping[str, Any]) -> dict[str, Resolved]:
    check_keywords(kwargs)
    cls = type(experiment)
    specs = {s.name: s for s in field_specs(cls)}
    resolved: dict[str, Resolved] = {}
    for name, keyword in RUN_KEYWORDS.items():
        if name in kwargs:
            value, source = kwargs[name], NITRO_KEYWORD
        elif has_method(cls, name):
            value, source = getattr(experiment, name)(), METHOD
        elif name in specs and specs[name].kind is FieldKind.HOST:
            value, source = getattr(experiment, name), FIELD
        else:
            value, source = keyword.default_value(experiment), DEFAULT
        if value is _DEFAULT_CHECKPOINTER:
            from nitro.runs.checkpoints import Checkpointer

            value = Checkpointer()
        else:
            try:
                value = keyword.checked(value)
            except ValueError as error:
                raise SetupError(f"{error} [{source}]") from None
        resolved[name] = Resolved(freeze(value), source)  # a dict given becomes read-only
    return resolved
