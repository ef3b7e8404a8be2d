"""The `%nitro` line magic: train, stop and inspect runs by name.

Declared once with `magic_arguments`, so `%nitro?` shows the same help the parser enforces.
The magics parse and dispatch; when and how `%nitro train` builds a new handle after an edit
is `rebuild.py`'s.
"""

from __future__ import annotations

import re
from typing import Any

from IPython.core import magic_arguments
from IPython.core.error import UsageError
from IPython.core.magic import Magics, line_magic, magics_class

import nitro
from nitro.staleness import is_experiment

from . import agents, rebuild, runs, worker
from .cache_table import CacheTable
from .member_table import stop_member

__all__ = ["NitroMagics"]

COMMANDS = (
    "train",
    "stop",
    "wait",
    "status",
    "runs",
    "validate",
    "evaluate",
    "predict",
    "render",
    "history",
    "plot",
    "panel",
    "cache",
    "profile",
    "bind",
    "export",
    "mcp",
    "reload",
    "rewind",
    "fork",
)


class _Shown:
    """Shows a report as its text in a terminal and as its HTML in a notebook."""

    def __init__(self, report: Any):
        self.report = report

    def __repr__(self) -> str:
        return str(self.report)

    def _repr_html_(self) -> str:
        return self.report._repr_html_()


def _without_comment(line: str) -> str:
    """The magic's line without a trailing `# comment`, which IPython passes on with the
    arguments (`%nitro train exp  # a note` trains exp): a `#` outside quotes that starts a
    word starts it."""
    quote = None
    for index, char in enumerate(line):
        if quote is not None:
            quote = None if char == quote else quote
        elif char in "'\"":
            quote = char
        elif char == "#" and (index == 0 or line[index - 1].isspace()):
            return line[:index].rstrip()
    return line


def _axes_option(given: str) -> tuple[str, tuple[str | None, ...]]:
    """`--axes x=batch,height,width` as ("x", ("batch", "height", "width")); an empty name
    leaves its axis unnamed."""
    name, equals, names = given.partition("=")
    if not (name and equals and names):
        raise UsageError(
            f"--axes takes NAME=AXIS,AXIS,... (e.g. --axes x=batch,height,width; an empty "
            f"name leaves an axis unnamed: x=batch,,width), got {given!r}"
        )
    return name, tuple(axis or None for axis in names.split(","))


@magics_class
class NitroMagics(Magics):
    """`%nitro COMMAND [TARGET] [options]`; see `%nitro?`."""

    def __init__(self, shell, watcher=None):
        super().__init__(shell)
        self.watcher = watcher

    @line_magic
    @magic_arguments.magic_arguments()
    @magic_arguments.argument(
        "command",
        nargs="?",
        default="status",
        choices=COMMANDS,
        metavar="COMMAND",
        help=f"one of: {', '.join(COMMANDS)} (default: status)",
    )
    @magic_arguments.argument(
        "target",
        nargs="?",
        metavar="TARGET",
        help="train: an experiment instance, a handle or a nitro.Population; stop, wait, "
        "status, validate, evaluate, history, panel, bind: a handle or a population; predict, "
        "plot, profile: a handle (default: the latest, _nitro); export: a directory; mcp: "
        "start or stop",
    )
    @magic_arguments.argument(
        "member",
        nargs="?",
        metavar="MEMBER",
        help="stop: the member of a population to stop (its index); the others train on; "
        "rewind, fork: the step",
    )
    @magic_arguments.argument(
        "--run", "-r", help="export: the handle to export (default: the latest, _nitro)"
    )
    @magic_arguments.argument(
        "--name", help="export: the bundle's name (default: the experiment class, lower case)"
    )
    @magic_arguments.argument(
        "--echo",
        nargs="+",
        metavar="INPUT",
        help="export: wire inputs returned unchanged as outputs of the same name (n.export's echo=)",
    )
    @magic_arguments.argument(
        "--batch-sizes",
        dest="batch_sizes",
        nargs="+",
        type=int,
        metavar="SIZE",
        help="export: the batch sizes a call is padded to, increasing (n.export's batch_sizes=)",
    )
    @magic_arguments.argument(
        "--axes",
        action="append",
        metavar="NAME=AXIS,AXIS",
        help="export: name the axes of an input or output, 'batch' first, an empty name for an "
        "unnamed axis, e.g. --axes x=batch,height,width (n.export's axes=); once per tensor",
    )
    @magic_arguments.argument(
        "--epochs", "-e", type=int, help="train this many more epochs (default: to max_epochs)"
    )
    @magic_arguments.argument(
        "--steps",
        type=int,
        default=20,
        help="profile: the training steps to profile (default: 20; they train the handle)",
    )
    @magic_arguments.argument(
        "--background",
        "-b",
        action="store_true",
        help="return at once; the run's panel shows progress and `%%nitro stop` ends it",
    )
    @magic_arguments.argument(
        "--no-live-edits",
        dest="no_live_edits",
        action="store_true",
        help="train: an edit saved while the run trains waits until it stops (sets the "
        "handle's live_edits=False); by default it is compiled beside the run and swapped in",
    )
    @magic_arguments.argument(
        "--preset",
        "-p",
        metavar="NAME",
        help="train: build the experiment from its class's preset NAME (`%%nitro train Digits "
        "--preset small`, as Digits.from_preset('small')); the handle is stored as "
        "`digits_small_run`",
    )
    @magic_arguments.argument(
        "--fresh",
        action="store_true",
        help="start from build_model's weights, not from the previous run of the experiment",
    )
    @magic_arguments.argument(
        "--resume",
        nargs="?",
        const=True,
        default=False,
        metavar="RUN_ID",
        help="continue this handle's run on disk from its newest checkpoint (after a kernel "
        "restart): the run EXP_run last trained, else the experiment's only run from this "
        "notebook with these GraphConst values; RUN_ID (or a run directory) names the run",
    )
    @magic_arguments.argument(
        "--split",
        "-s",
        help="evaluate: the split to evaluate (default: test); render: the split to draw "
        "(default: val; with --data: train)",
    )
    @magic_arguments.argument(
        "--data", action="store_true", help="render: the data alone (compiles nothing)"
    )
    @magic_arguments.argument(
        "--top-losses",
        dest="top_losses",
        type=int,
        metavar="K",
        help="render: the K samples with the highest loss",
    )
    @magic_arguments.argument(
        "--confusion", action="store_true", help="render: the confusion matrix of a classifier"
    )
    @magic_arguments.argument(
        "--out", metavar="PATH", help="render: also write the figure to PATH (a file or directory)"
    )
    @magic_arguments.argument(
        "--batch",
        help="predict: a variable holding a batch dict (default: the first batch of the "
        "handle's test split, else val)",
    )
    @magic_arguments.argument(
        "--port",
        type=int,
        default=0,
        help="mcp start: the loopback port to serve on (default: any free port)",
    )
    @magic_arguments.argument(
        "--allow",
        action="append",
        metavar="DIR",
        help="mcp start: another directory whose paths the agent may use (repeatable)",
    )
    @magic_arguments.argument(
        "--root",
        help="mcp start: the directory whose paths the agent may use (default: the working "
        "directory)",
    )
    def nitro(self, line: str = ""):
        """Train, watch and inspect Nitro runs.

        %nitro train EXP [--epochs N] [--background] [--no-live-edits] [--fresh]
                         [--resume [RUN_ID]]
            EXP is an experiment instance (`exp = Digits()`) or a handle. On an experiment
            it stores the handle as `EXP_run` (and `_nitro`) and trains it. Training again
            continues that handle, also after an edit of the experiment's code when the run
            has epochs to go (stopped or failed, or --epochs N) and the edit keeps its
            layout: the handle takes the edit. Otherwise (a completed run, other field
            values, a new model structure) it builds a new handle that starts from the
            previous one's weights (unless --fresh); one line says which, and why. The notebook's interrupt button stops a foreground run after
            the current step; `%nitro train` again resumes it. After a kernel restart,
            --resume continues EXP_run's run on disk from its newest checkpoint (its epoch,
            step, history, optimizer state): the run EXP_run last trained, else the only run
            of the experiment from this notebook with its GraphConst values (several are
            listed, to pick one with --resume RUN_ID). While it trains, a saved edit of
            its hooks (or a class re-defined in a cell) is compiled beside the run and
            swapped in at its next step; --no-live-edits makes the edit wait until the run
            stops (the handle's `live_edits=False`).
        %nitro train CLASS --preset NAME [options of %nitro train EXP]
            builds the experiment from the class's preset NAME (CLASS.from_preset(NAME))
            and trains it as an experiment, stored as `class_name_run` (`digits_small_run`
            for `%nitro train Digits --preset small`); training it again continues that
            handle, as for EXP. The run records the preset.
        %nitro train POP [--epochs N] [--background] [--resume [RUN_ID]]
            POP is a nitro.Population: trains every member, with a live panel of their
            curves and a table of them (each member's rank, a Stop button per member).
            --resume continues its run on disk (after a kernel restart) in a new
            population of POP's keywords, stored as POP.
        %nitro stop [RUN]        stop RUN (default: every running run) after its current step
        %nitro stop POP MEMBER   stop one member of a population (its index); the others
                                 train on
        %nitro wait [RUN]        wait until RUN (default: every running run) finishes
        %nitro status [RUN]      phase, epoch, step, latest loss and throughput, and the
                                 edits swapped in while it trained (step, what changed); for a
                                 population, how many members still train and the best one
        %nitro runs              every run in the notebook, as a table, and the run
                                 directories of its experiments on disk (best metric,
                                 checkpoints)
        %nitro validate [RUN]    loss and metrics on the 'val' split (a population's: a
                                 row per member)
        %nitro evaluate [RUN] [--split S]
        %nitro predict [RUN] [--batch VAR]
        %nitro render [RUN] [--split S] [--data] [--top-losses K] [--confusion] [--out PATH]
            a grid of samples of the 'val' split with their labels and predictions, drawn
            by the experiment's visualize hook (n.render()); --data: the 'train' split's
            first batch alone, compiling nothing (n.show_batch()); --top-losses K: the K
            samples with the highest loss (n.top_losses(K)); --confusion: the confusion
            matrix and per-class metrics (n.confusion()); --out also writes the figure
            (a file, or a directory)
        %nitro history [RUN]     the history table (a population's: every member's)
        %nitro plot [RUN]        the history's curves
        %nitro panel [RUN]       RUN's live panel in this cell (for a run or population
                                 started elsewhere, such as by an agent)
        %nitro cache             compile cache statistics (each program's calls, compile
                                 time, FLOPs and memory) and why each program compiled
        %nitro profile [RUN] [--steps N]
            train N more steps of RUN (default 20) under jax.profiler and show where a
            call's time went: waiting for data, host-side Python, the device program and
            the readback; each program's FLOPs, memory and FLOP/s against the device's peak
            (n.profile(steps=N); the trace is in RUN's run directory, under profile/)
        %nitro bind [RUN]        where every value of the run (or population) came from
        %nitro export DIR [--run RUN] [--name NAME] [--echo INPUT ...]
                          [--batch-sizes SIZE ...] [--axes NAME=AXIS,AXIS ...]
            write RUN's current weights and eval-mode forward as a bundle that runs without
            Nitro (nitro.bundle.load(DIR)) and serves with `nitro serve DIR`; --echo,
            --batch-sizes and --axes are n.export's echo=, batch_sizes= and axes=
        %nitro reload            check the watched files now: reload the edited ones (a
                                 run training takes the edit live) and say what is stale;
                                 for file systems whose saves the watcher does not see
        %nitro rewind [RUN] [STEP]
            take RUN back to STEP, a snapshot in memory or a checkpoint (without STEP: the
            steps it can go back to); training on repeats the same steps bit for bit, and
            the steps after it stay in its history as an abandoned branch (n.rewind(STEP))
        %nitro fork [RUN] [STEP]
            a new handle starting from RUN's snapshot at STEP (default: its state now),
            stored as `RUN_fork` (and `_nitro`); it trains beside RUN (n.fork(STEP))
        %nitro mcp start [--port P] [--root DIR] [--allow DIR ...]
            serve this kernel's runs to a coding agent over MCP (loopback only; prints
            the file holding the token and client configuration); `%nitro mcp stop`
            stops serving, `%nitro mcp` says where it serves. Runs the agent starts show
            in %nitro runs under their run ids. The agent's paths stay inside the working
            directory (or --root) and the --allow'ed directories.
        """
        args = magic_arguments.parse_argstring(self.nitro, _without_comment(line))
        if args.member is not None and args.command not in ("stop", "rewind", "fork"):
            raise UsageError(
                f"%nitro {args.command} takes one target, got {args.target!r} and "
                f"{args.member!r}; a member is for `%nitro stop POP MEMBER`"
            )
        return getattr(self, f"_{args.command}")(args)

    # ------------------------------------------------------------------------------------------
    # lookups

    @property
    def _ns(self) -> dict[str, Any]:
        return self.shell.user_ns

    def _value(self, name: str) -> Any:
        if name not in self._ns and name in runs.agent_runs():  # a coding agent's run id
            return runs.agent_runs()[name]
        if name.isidentifier():
            if name not in self._ns:
                raise UsageError(
                    f"no variable named {name!r} in the notebook; create it first, e.g. "
                    f"`exp = Digits()` then `%nitro train exp`"
                )
            return self._ns[name]
        try:
            return self.shell.ev(name)
        except Exception as error:
            raise UsageError(f"cannot evaluate {name!r}: {error}") from None

    def _population(self, name: str | None) -> nitro.Population | None:
        """The population named `name`, or None when it names something else."""
        if name is None or (name not in self._ns and name in runs.agent_runs()):
            return None
        value = self._value(name)
        return value if isinstance(value, nitro.Population) else None

    def _run(self, name: str | None, what: str) -> tuple[str, Any]:
        """The population named `name`, else the handle (by default the latest)."""
        pop = self._population(name)
        return (name, pop) if pop is not None and name is not None else self._handle(name, what)

    def _targets(self, name: str | None, what: str) -> list[tuple[str, Any]]:
        """The run or population `name`; without a name, every population and run that
        trains."""
        if name is not None:
            return [self._run(name, what)]
        pops = [(n, p) for n, p in runs.named_populations(self._ns) if p.running]
        handles = [h for h in runs.live_handles(self._ns) if h.running]
        return pops + [(self._name_of(h), h) for h in handles]

    def _handle(self, name: str | None, what: str) -> tuple[str, nitro.Nitro]:
        """The handle named `name`; by default the latest one (`_nitro`)."""
        agent_handle = runs.agent_runs().get(name) if name is not None else None
        if agent_handle is not None:
            return name, agent_handle
        if name is None:
            handle = self._ns.get("_nitro")
            if not isinstance(handle, nitro.Nitro):
                handles = runs.live_handles(self._ns)
                if len(handles) != 1:
                    raise UsageError(
                        f"%nitro {what} needs a run: %nitro train EXP first, or name a handle "
                        f"(%nitro {what} RUN)"
                        if not handles
                        else f"%nitro {what}: several runs exist; name one (%nitro {what} RUN)"
                    )
                handle = handles[0]
            names = runs.handle_names(self._ns, handle)
            return (names[0] if names else "_nitro"), handle
        value = self._value(name)
        if isinstance(value, nitro.Nitro):
            return name, value
        if is_experiment(value) and isinstance(self._ns.get(f"{name}_run"), nitro.Nitro):
            return f"{name}_run", self._ns[f"{name}_run"]
        if isinstance(value, nitro.Population):
            raise UsageError(
                f"{name!r} is a nitro.Population; %nitro {what} takes a handle: "
                f"`{name}.best()` or `{name}.member(i)` is one (%nitro train, stop, wait, "
                f"status, validate, evaluate, history, panel and bind take a population)"
            )
        raise UsageError(
            f"{name!r} is a {type(value).__name__}, not a run; %nitro {what} takes a handle "
            f"(a nitro.Nitro, such as the `EXP_run` that %nitro train stores)"
        )

    # ------------------------------------------------------------------------------------------
    # train

    def _train(self, args) -> nitro.Nitro:
        if args.target is None and isinstance(args.resume, str) and args.resume in self._ns:
            args.target, args.resume = args.resume, True  # `%nitro train --resume exp`
        if args.target is None:
            raise UsageError("%nitro train needs an experiment or a handle: %nitro train exp")
        if args.epochs is not None and args.epochs < 1:
            raise UsageError(f"--epochs must be at least 1, got {args.epochs}")
        if args.resume and args.fresh:
            raise UsageError("--resume continues a run on disk, --fresh starts over: pass one")
        value = self._value(args.target)
        base = args.target if args.target.isidentifier() else None
        previous = None
        if args.preset is not None:
            value, base = self._from_preset(args.target, value, args.preset)
        if isinstance(value, nitro.Population):
            name, handle = args.target, rebuild.population_to_train(value, args.target, args)
        elif isinstance(value, nitro.Nitro):
            name = base if base and base != "_nitro" else self._name_of(value, "_nitro")
            handle = rebuild.handle_to_train(
                name,
                value,
                value.experiment,
                value,
                fresh=args.fresh,
                resume=args.resume,
                more=args.epochs is not None,
            )
        elif is_experiment(value) and not isinstance(value, type):
            name = f"{base}_run" if base else f"{type(value).__name__.lower()}_run"
            previous = self._ns.get(name)
            if not rebuild.runs_experiment(previous, value):
                previous = None
            handle = rebuild.handle_to_train(
                name,
                previous,
                value,
                previous,
                fresh=args.fresh,
                resume=args.resume,
                more=args.epochs is not None,
            )
        elif isinstance(value, type) and is_experiment(value):
            presets = nitro.presets(value)
            hint = (
                f", or build it from a preset: `%nitro train {args.target} --preset NAME` "
                f"(its presets: {', '.join(presets)})"
                if presets
                else ""
            )
            raise UsageError(
                f"{args.target} is the experiment class; pass an instance: "
                f"`exp = {value.__name__}()` then `%nitro train exp`{hint}"
            )
        else:
            raise UsageError(
                f"{args.target!r} is a {type(value).__name__}; %nitro train takes an experiment "
                f"instance (a class decorated with @nitro.experiment), a nitro.Nitro handle or "
                f"a nitro.Population"
            )
        population = isinstance(handle, nitro.Population)
        before = value if isinstance(value, nitro.Nitro) else previous
        if args.no_live_edits:
            handle.live_edits = False
        elif before is not None and handle is not before and handle.live_edits is None:
            handle.live_edits = before.live_edits  # a rebuilt handle keeps the choice
        if not population or name.isidentifier():
            self._ns[name] = handle
        if not population:  # the latest run, which commands take by default
            self._ns["_nitro"] = handle
        # train() without epochs resumes to target_epoch, else trains to max_epochs
        if args.epochs is None and handle.epoch >= max(handle.target_epoch, handle.max_epochs):
            print(
                f"nitro: {name} already trained its {handle.epoch} epochs "
                f"(max_epochs={handle.max_epochs}); `%nitro train {args.target} --epochs N` "
                f"trains N more" + ("" if population else ", `--fresh` starts over")
            )
            return handle
        try:
            handle.train(epochs=args.epochs, background=args.background)
        finally:
            worker.reserve_panel(None)  # a setup panel no run took
        if args.background and handle.running:
            members = f" ({len(handle.members)} members)" if population else ""
            worker.say(  # beside its panel's title while it lives, not under its record
                f"{name}{members} is training in the background; `%nitro status` shows how far "
                f"it is, `%nitro stop {name}` stops it"
                + (f", `%nitro stop {name} I` stops member I" if population else "")
            )
            return None
        return handle

    def _from_preset(self, target: str, value: Any, preset: str) -> tuple[Any, str]:
        """`%nitro train CLASS --preset NAME`: the experiment CLASS.from_preset(NAME) and the
        base of its handle's name (`digits_small` for `_run`)."""
        if not (isinstance(value, type) and is_experiment(value)):
            what = (
                type(value.experiment).__name__
                if isinstance(value, nitro.Nitro)
                else type(value).__name__
            )
            raise UsageError(
                f"%nitro train {target} --preset {preset}: --preset builds the experiment from "
                f"its class, and {target} is a {type(value).__name__}; name the class: "
                f"`%nitro train {what} --preset {preset}`"
            )
        try:
            experiment = value.from_preset(preset)
        except nitro.ExperimentError as error:
            raise UsageError(f"%nitro train {target} --preset {preset}: {error}") from None
        return experiment, re.sub(r"\W", "_", f"{value.__name__}_{preset}".lower())

    # ------------------------------------------------------------------------------------------
    # runs

    def _stop(self, args) -> None:
        if args.member is not None:
            pop = self._population(args.target)
            if pop is None:
                raise UsageError(
                    f"%nitro stop {args.target} {args.member}: a member is for a population, "
                    f"and {args.target} is not a nitro.Population; `%nitro stop {args.target}` "
                    f"stops it"
                )
            return stop_member(pop, args.target, args.member)
        targets = self._targets(args.target, "stop")
        if not targets:
            print("nitro: no run is training")
        for name, target in targets:
            runs.stop(target, name)

    def _stepped(self, args, what: str) -> tuple[str, nitro.Nitro, int | None]:
        """`%nitro rewind|fork [RUN] [STEP]`: the handle (default: the latest) and the step."""
        target, step = args.target, args.member
        if step is None and target is not None and target.isdigit():
            target, step = None, target
        if step is not None and not step.isdigit():
            raise UsageError(f"%nitro {what}: STEP is a step number (%nitro {what} RUN 120)")
        name, handle = self._handle(target, what)
        return name, handle, int(step) if step is not None else None

    def _rewind(self, args):
        name, handle, step = self._stepped(args, "rewind")
        if step is None:
            return handle.snapshots
        self._idle(name, handle, f"rewind {name} {step}").rewind(step)
        return handle

    def _fork(self, args):
        name, handle, step = self._stepped(args, "fork")
        fork = handle.fork(step)
        stored = f"{name}_fork" if name.isidentifier() else "_nitro"
        self._ns[stored] = self._ns["_nitro"] = fork
        print(f"nitro: the fork is `{stored}`; %nitro train {stored} trains it")
        return fork

    def _wait(self, args) -> None:
        targets = self._targets(args.target, "wait")
        if not targets:
            print("nitro: no run is training")
        for name, target in targets:
            target.wait()
            for line in runs.status_lines(target, name):
                print(line)

    def _idle(self, name: str, handle: nitro.Nitro, what: str) -> nitro.Nitro:
        """`handle`, unless it is training in the background (then a one-line error)."""
        if handle.running:
            raise UsageError(
                f"{name} is {handle.phase} in the background; `%nitro stop {name}` stops it, "
                f"`%nitro wait {name}` waits for it to finish; then `%nitro {what}` again"
            )
        return handle

    def _name_of(self, handle, default: str | None = None) -> str:
        names = runs.handle_names(self._ns, handle)
        return names[0] if names else default or f"a {handle.cls.__name__} run"

    def _status(self, args) -> None:
        targets = self._targets(args.target, "status")
        if not targets and args.target is None:  # nothing trains: the latest run, populations
            latest = self._ns.get("_nitro")
            handles = [latest] if isinstance(latest, nitro.Nitro) else runs.live_handles(self._ns)
            targets = runs.named_populations(self._ns)
            targets += [(self._name_of(h), h) for h in handles]
        if not targets:
            print("nitro: no runs yet; %nitro train EXP starts one")
        for name, target in targets:
            for line in runs.status_lines(target, name):
                print(line)

    def _runs(self, args):
        handles = [
            h for h in runs.live_handles(self._ns) if h.running or runs.handle_names(self._ns, h)
        ]
        on_disk = runs.runs_on_disk(self._ns, handles)
        pops = runs.populations_table(self._ns)
        if not handles and on_disk.empty and pops is None:
            print("nitro: no runs yet; %nitro train EXP starts one")
            return None
        live = runs.runs_table(self._ns, handles) if handles else None
        return runs.RunTables(live, on_disk, pops)

    def _validate(self, args):
        return self._idle(*self._run(args.target, "validate"), "validate").validate()

    def _evaluate(self, args):
        handle = self._idle(*self._run(args.target, "evaluate"), "evaluate")
        return handle.evaluate(args.split or "test")

    def _render(self, args):
        result = self._rendered(args)
        if not isinstance(result, list):
            return result
        from IPython.display import display

        for one in result:  # a population's: one per member
            display(one)

    def _rendered(self, args):
        name, handle = self._run(args.target, "render")
        where = "inline" if args.out is None else ["inline", args.out]
        if args.data:
            return handle.show_batch(args.split or "train", where=where)
        self._idle(name, handle, "render")
        split = args.split or "val"
        if args.confusion:
            return handle.confusion(split, where=where)
        if args.top_losses is not None:
            return handle.top_losses(args.top_losses, split, where=where)
        return handle.render(split, where=where)

    def _predict(self, args):
        name, handle = self._handle(args.target, "predict")
        self._idle(name, handle, "predict")
        if args.batch is not None:
            return handle.predict(self._value(args.batch))
        for split in ("test", "val"):
            if split in handle.splits:
                batch = next(iter(handle.splits[split]))
                print(f"nitro: predicting the first batch of {name}'s {split!r} split")
                return handle.predict(batch)
        raise UsageError(
            f"{name} has no 'test' or 'val' split to take a batch from; pass one: "
            f"%nitro predict {name} --batch VAR (VAR is a dict of arrays)"
        )

    def _history(self, args):
        return self._run(args.target, "history")[1].history()

    def _plot(self, args):
        name, handle = self._handle(args.target, "plot")
        if handle.history().empty:
            raise UsageError(f"{name} has no history yet: train at least one epoch first")
        return handle.plot()

    def _panel(self, args):
        from .reporters import show_panel

        name, handle = self._run(args.target, "panel")
        panel = show_panel(handle)
        if panel is None:
            raise UsageError(
                f"{name} has no live panel: it has not run in this notebook with progress=True"
            )

    def _cache(self, args):
        return CacheTable(nitro.cache_stats())

    def _profile(self, args):
        name, handle = self._handle(args.target, "profile")
        self._idle(name, handle, "profile")
        if args.steps < 1:
            raise UsageError(
                f"--steps must be at least 1, got {args.steps}: the training steps to profile"
            )
        return handle.profile(steps=args.steps)

    def _bind(self, args):
        value = self._value(args.target) if args.target is not None else None
        if isinstance(value, nitro.Population):  # its first member's, after its own section
            return _Shown(value.binding_report())
        return _Shown(self._handle(args.target, "bind")[1].binding_report())

    def _reload(self, args) -> None:
        """Check the watched files now, as the watcher does on a save."""
        if self.watcher is None:
            raise UsageError("%nitro reload needs the code watcher: %load_ext nitro starts it")
        self.watcher.track()
        messages = self.watcher.check(after_autoreload=True)
        messages += self.watcher.report_stale()
        for message in messages or ["no watched file changed since it was last loaded"]:
            print(f"nitro: {message}", flush=True)

    def _mcp(self, args) -> None:
        if args.target == "start":
            print(agents.start(self.shell, port=args.port, allow=args.allow, root=args.root))
        elif args.target == "stop":
            print(agents.stop())
        elif args.target is None:
            server = agents.serving()
            print(f"nitro: serving at {server.url}" if server else "nitro: not serving")
        else:
            raise UsageError(f"%nitro mcp takes start or stop, got {args.target!r}")

    def _export(self, args) -> None:
        if args.target is None:
            raise UsageError("%nitro export needs a directory: %nitro export exports/digits")
        axes = dict(_axes_option(given) for given in args.axes or ())
        name, handle = self._handle(args.run, "export")
        manifest = handle.export(
            args.target,
            name=args.name,
            echo=tuple(args.echo or ()),
            batch_sizes=tuple(args.batch_sizes) if args.batch_sizes else None,
            axes=axes or None,
        )
        wire = ", ".join(f"{i['name']} {i['dtype']}{i['shape']}" for i in manifest["inputs"])
        print(
            f"nitro: exported {name} (step {handle.step}) to {args.target} as bundle "
            f"{manifest['name']!r} ({wire}); load it with nitro.bundle.load({args.target!r}) or "
            f"serve it with `nitro serve {args.target}`"
        )
