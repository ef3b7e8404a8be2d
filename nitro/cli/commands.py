"""The experiment commands: `nitro train`, `validate`, `evaluate`, `predict` and `export`.

Each builds the experiment and a `nitro.Nitro` handle from its options (`nitro.cli.options`)
and does what the handle's method of the same name does. Every command continues the
experiment's run by default (`--resume auto`): `train` picks a killed or requeued job up where
its checkpoint left off, and the others evaluate, predict with or export what `train` trained.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["COMMANDS", "Command", "run"]


@dataclasses.dataclass(frozen=True)
class Command:
    name: str
    summary: str  # one line, for `nitro --help`
    description: str
    options: tuple[dict[str, Any], ...]  # its own options: argparse's add_argument keywords
    action: Callable[[Any, Any], None]  # (handle, settings)

    @property
    def trains(self) -> bool:
        return self.name == "train"


def _train(n: Any, settings: Any) -> None:
    n.train()
    print(n.history().to_string())
    print(f"run {n.run_id}: {n.run_dir}")


def _validate(n: Any, settings: Any) -> None:
    print(json.dumps(n.validate()))


def _evaluate(n: Any, settings: Any) -> None:
    print(json.dumps(n.evaluate(split=settings.command["split"])))


def _predict(n: Any, settings: Any) -> None:
    import numpy as np

    with np.load(settings.command["input"]) as arrays:
        batch = {name: arrays[name] for name in arrays.files}
    outputs = n.predict(batch)
    path = settings.command.get("output")
    if path is None:
        print(outputs)
    elif isinstance(outputs, dict):
        arrays = {str(k): np.asarray(v) for k, v in outputs.items()}
        np.savez(path, **arrays)  # pyright: ignore[reportArgumentType]  # names, not savez's flags
    else:
        np.save(path, np.asarray(outputs))


def _export(n: Any, settings: Any) -> None:
    directory = settings.command.get("directory") or f"exports/{n.cls.__name__.lower()}"
    manifest = n.export(directory)
    print(f"exported {manifest.get('name', n.cls.__name__.lower())} to {directory}")


_RUN_IT = (
    "It continues the experiment's run (--resume auto: the run `nitro train` trained with "
    "these GraphConst values), or the run --resume DIR or --weights DIR names."
)

COMMANDS = {
    c.name: c
    for c in [
        Command(
            "train",
            "train an experiment: nitro train module:Class [--config FILE] [--OPTION VALUE ...]",
            "Train an experiment. Every field of the experiment and every run keyword of "
            "nitro.Nitro(...) is an option; --config reads them from a file, and the options "
            "after it override it. The resolved configuration is saved in the run's directory "
            "as config.yaml: nitro train --config runs/<Experiment>/<run id>/config.yaml trains "
            "the same run. --resume auto (the default) continues the experiment's run where its "
            "checkpoint left off, so a killed or requeued job that reruns the same command goes "
            "on instead of starting over; --resume false starts a new run.",
            (),
            _train,
        ),
        Command(
            "validate",
            "the trained run's loss and metrics on the 'val' split (JSON)",
            "Print the loss and metrics of the trained run on the 'val' split, as JSON. " + _RUN_IT,
            (),
            _validate,
        ),
        Command(
            "evaluate",
            "the trained run's loss and metrics on a split (JSON)",
            "Print the loss and metrics of the trained run on a split, as JSON. " + _RUN_IT,
            ({"flag": "--split", "default": "test", "help": "the split (default: test)"},),
            _evaluate,
        ),
        Command(
            "predict",
            "run forward on arrays from an .npz file",
            "Run the trained run's forward in eval mode on the arrays of an .npz file (named "
            "as forward's inputs) and print the outputs or save them (.npy, or .npz for a dict "
            "of outputs). " + _RUN_IT,
            (
                {"flag": "--input", "required": True, "help": "an .npz file of named arrays"},
                {"flag": "--output", "default": None, "help": "where to save the outputs"},
            ),
            _predict,
        ),
        Command(
            "export",
            "write the trained run as a bundle that `nitro serve` serves",
            "Write the trained run's weights and eval-mode forward as a bundle that runs "
            "without Nitro and serves with `nitro serve` (docs/export.md). " + _RUN_IT,
            (
                {
                    "flag": "--directory",
                    "default": None,
                    "help": "the bundle's directory (default: exports/<experiment, lower case>)",
                },
            ),
            _export,
        ),
    ]
}


def _usage(command: Command) -> str:
    return (
        f"usage: nitro {command.name} module:Class [--config FILE] [--print-config] "
        f"[--preset NAME] [--OPTION VALUE ...]\n\n{command.description}\n\n"
        f"nitro {command.name} module:Class --help lists the experiment's options (its "
        f"fields and the run keywords), e.g. nitro {command.name} "
        f"nitro.examples.digits:Digits --help"
    )


def run(name: str, argv: Sequence[str]) -> int:
    """Run the experiment command `name` with its arguments; the exit status."""
    from nitro.cli.options import CommandError, config_text, parse, resolved_config

    command = COMMANDS[name]
    prog = f"nitro {name}"
    if not argv or (argv[0] in ("-h", "--help")):
        print(_usage(command))
        return 0 if argv else 2
    try:
        settings, print_config = parse(prog, command.description, argv, command.options)
        experiment = settings.experiment()
        keywords = settings.run_keywords()
        config = resolved_config(settings, experiment)
        if print_config:
            sys.stdout.write(config_text(config))
            return 0
        handle = _handle(command, experiment, keywords)
    except CommandError as error:
        print(f"{prog}: error: {error}", file=sys.stderr)
        return 2
    try:
        if command.trains:
            _save_config(handle.run_dir, config)
        command.action(handle, settings)
    finally:
        handle.close()
    return 0


def _handle(command: Command, experiment: Any, keywords: dict[str, Any]) -> Any:
    """The handle the command runs. Unless told which run (`--resume`, `--weights`), it
    continues the experiment's run with these GraphConst values (or the run `--run-dir`
    names); without one, `train` starts a new run, and the others refuse: they need trained
    weights."""
    import nitro
    from nitro.cli.options import CommandError
    from nitro.runs.resume import fitting_run
    from nitro.runs.run_dirs import list_runs

    name = type(experiment).__name__
    if "resume" not in keywords and "weights" not in keywords:
        keywords["resume"] = "auto"
        run_dir = keywords.get("run_dir")
        if run_dir is not None:
            where, found = run_dir, any(run.checkpoints for run in list_runs(run_dir))
        else:
            where, found = f"runs/{name}", fitting_run(experiment, keywords.get("name"))
        if not found and not command.trains:
            raise CommandError(
                f"no trained run of {name} with these GraphConst values under {where} to "
                f"{command.name}: train one with nitro train, or name one with --resume DIR "
                f"or --weights DIR"
            )
        if not found:
            keywords["resume"] = False
            print(f"nitro: no run to continue under {where}: a new run", file=sys.stderr)
    try:
        return nitro.Nitro(experiment, **keywords)
    except (nitro.SetupError, nitro.ExperimentError, TypeError, ValueError) as error:
        raise CommandError(str(error)) from None


def _save_config(run_dir: str, config: dict[str, Any]) -> None:
    """The run's config.yaml, written by one process of a multi-process run."""
    import jax

    from nitro.cli.options import write_config

    if jax.process_index() == 0:
        write_config(run_dir, config)
