"""The fifteen agent tools as an MCP server: argument schemas, descriptions, dispatch.

Each tool is declared once: a name, a description for the agent, and a pydantic model of its
arguments; the model gives the input schema the client lists and checks every call (an unknown
argument or a value of the wrong type is an error naming the argument). The work happens in
`ToolSession`, on a worker thread, so a slow call never blocks the server.

>>> server = build_server(ToolSession())
>>> sorted(TOOLS)[:3]
['nitro_evaluate', 'nitro_export', 'nitro_fork']
"""

from __future__ import annotations

import base64
import dataclasses
import functools
import json
from collections.abc import Callable
from typing import Any, Literal

import anyio.to_thread
import mcp.types as types
from mcp.server.lowlevel import Server
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from pydantic_core import ErrorDetails

from nitro._version import __version__
from nitro.engine.run_keywords import KEYWORD_ONLY, RUN_KEYWORDS
from nitro.mcp.json_keywords import OBJECT_KEYWORDS
from nitro.mcp.lookup import ToolFailure
from nitro.mcp.session import ToolSession

__all__ = ["TOOLS", "ToolSpec", "build_server", "call"]

RUN_ID = (
    "a run id from nitro_train, nitro_population or nitro_runs (a notebook's run or population: "
    "its variable name), or a handle_run_id (the run directory's id)"
)
WAIT = "seconds to wait for the result; a longer job answers its run id to poll with nitro_status"


class _Arguments(BaseModel):
    model_config = ConfigDict(extra="forbid")


class SetupArguments(_Arguments):
    backend: str | None = Field(
        None, description="the JAX backend expected ('cpu', 'gpu', 'tpu'); fixed at start-up"
    )
    n_devs: int | None = Field(
        None, ge=1, description="devices in the data-parallel mesh of runs started from now on"
    )


CHECKPOINT = 'a run directory or checkpoint path, or [run_dir, "best" | "latest"]'


class _Experiment(_Arguments):
    experiment: str | None = Field(
        None,
        description="an experiment class by name: 'Digits' (defined in the notebook) or "
        "module-qualified, 'nitro.examples.digits.Digits'",
    )
    overrides: dict[str, Any] | None = Field(
        None, description='field values, e.g. {"width": 256}; checked against the fields'
    )
    preset: str | None = Field(
        None,
        description="build the experiment from this preset of its class (its presets() "
        "names them), the overrides on top; the run records it",
    )


class _NewHandle(_Experiment):
    weights: str | tuple[str, Literal["best", "latest"]] | None = Field(
        None, description=f"start from these weights: a run id (nitro_runs), {CHECKPOINT}"
    )
    keywords: dict[str, Any] | None = Field(
        None,
        description="other run keywords for nitro.Nitro(...): "
        + ", ".join(sorted((set(RUN_KEYWORDS) | set(KEYWORD_ONLY)) - OBJECT_KEYWORDS))
        + '. JSON forms: checkpointer true, false or {"k": 3, "metric": "val_acc", "mode": '
        '"max", "every": 1}; early_stop {"metric": "val_loss", "patience": 5, "min_delta": '
        '1e-4}; logger null, "jsonl", "csv", "tensorboard" or a list of them',
    )


class TrainArguments(_NewHandle):
    max_epochs: int | None = Field(None, ge=1, description="epochs the run trains to")
    epochs: int | None = Field(None, ge=1, description="train this many epochs (more)")
    steps: int | None = Field(
        None, ge=1, description="train this many steps (more), mid-epoch if need be"
    )
    seed: int | None = Field(None, description="seeds the model's initialization and data order")
    run_dir: str | None = Field(
        None,
        description="directory for the run's files (default runs/<Experiment>/<id>), inside "
        "the session's root",
    )
    n_devs: int | None = Field(None, ge=1, description="devices in the data-parallel mesh")
    learning_rate: float | None = Field(
        None, gt=0, description="learning rate of the default optimizer"
    )
    resume: str | bool | tuple[str, Literal["best", "latest"]] | None = Field(
        None,
        description="continue from a checkpoint: 'auto' (the newest run of this experiment "
        f"under runs/, or under run_dir), {CHECKPOINT}; false starts afresh",
    )
    run_id: str | None = Field(
        None,
        description="continue this run or population (stopped or finished) instead of starting one",
    )


class ValidateArguments(_NewHandle):
    run_id: str | None = Field(None, description=RUN_ID)
    wait_seconds: float = Field(60.0, ge=0, le=600, description=WAIT)


class EvaluateArguments(ValidateArguments):
    split: str = Field("test", description="the split to evaluate")


class PredictArguments(_Arguments):
    run_id: str = Field(description=RUN_ID)
    inputs: dict[str, list[Any]] = Field(
        description='batch fields as JSON arrays, batch axis first: {"x": [[...], [...]]}; '
        "each is converted to the dtype of the model's batches"
    )
    out: str | None = Field(
        None,
        description="write all outputs to this file (.npy, .npz or .json, inside the "
        "session's root); a large answer is written to predictions/ by itself",
    )


class ExportArguments(_NewHandle):
    run_id: str | None = Field(None, description=RUN_ID + "; or give experiment and weights")
    dir: str = Field(description="directory to write the bundle to, inside the session's root")
    name: str | None = Field(
        None, description="the bundle's (and served model's) name; default: the class, lower case"
    )
    platforms: list[Literal["cpu", "cuda", "rocm", "tpu"]] | None = Field(
        None, min_length=1, description="platforms to lower for; default all four"
    )
    echo: list[str] | None = Field(
        None,
        description='wire inputs returned unchanged as outputs of the same name (an id), e.g. ["id"]',
    )
    batch_sizes: list[int] | None = Field(
        None,
        description="the batch sizes a call is padded to (the smallest that fits), increasing, "
        "e.g. [1, 8, 32]; each is compiled when the bundle is served",
    )
    axes: dict[str, list[str | None]] | None = Field(
        None,
        description='names of the axes of inputs and outputs, "batch" for the batch axis, '
        'null for an unnamed one, e.g. {"x": ["batch", "height", "width"]}',
    )
    wait_seconds: float = Field(300.0, ge=0, le=600, description=WAIT)


class RunsArguments(_Arguments):
    pass


class StatusArguments(_Arguments):
    run_id: str = Field(description=RUN_ID)
    history: bool = Field(
        False,
        description="include every epoch's history row (a population's: one per member and "
        "epoch, with the member's settings)",
    )


class RunIdArguments(_Arguments):
    run_id: str = Field(description=RUN_ID)


class StopArguments(_Arguments):
    run_id: str = Field(description=RUN_ID)
    wait_seconds: float = Field(
        30.0, ge=0, le=600, description="seconds to wait for the run to stop"
    )
    member: int | None = Field(
        None,
        ge=0,
        description="a population's member to stop (prune) alone: its variables stop changing "
        "and the others train on; leave it out to stop the whole run",
    )


class PopulationArguments(_NewHandle):
    keywords: dict[str, Any] | None = Field(
        None,
        description="run keywords every member shares, in nitro_train's JSON forms (e.g. "
        '{"steps_per_dispatch": 1, "early_stop": {"metric": "val_loss", "patience": 2}, '
        '"logger": "csv"}): one run directory holds the members\' checkpoint and a '
        "directory per member for its logs",
    )
    axes: dict[str, list[Any]] | None = Field(
        None,
        description="what varies: {name: [values]}, every combination a member, e.g. "
        '{"learning_rate": [0.001, 0.01], "seed": [0, 1]} (4 members). A name is a run keyword '
        "fed to the step (seed, learning_rate, weight_decay, gradient_clip_norm, group_lr) or "
        "a Device field of the experiment",
    )
    members: list[dict[str, Any]] | None = Field(
        None,
        min_length=1,
        description='instead of axes, each member\'s values: [{"learning_rate": 0.001}, '
        '{"learning_rate": 0.01, "seed": 1}]',
    )
    search: dict[str, Any] | list[dict[str, Any]] | None = Field(
        None,
        description="a search inside the population (docs/search.md): members drawn from a "
        'space, {"random": {"space": {"learning_rate": {"log_uniform": [0.0001, 0.1]}}, "n": 8, '
        '"seed": 0}} (or "sobol"; instead of axes), and/or what happens while they train, '
        '{"pbt": {"every": 2}} or {"halving": {"rungs": [1, 2], "keep": 0.5}}; a list gives one '
        "of each",
    )
    max_epochs: int | None = Field(None, ge=1, description="epochs every member trains to")
    epochs: int | None = Field(None, ge=1, description="train this many epochs (more)")
    steps: int | None = Field(
        None, ge=1, description="train this many steps (more), mid-epoch if need be"
    )
    run_id: str | None = Field(
        None,
        description="train this population on (as nitro_train with run_id) instead of starting one",
    )
    wait_seconds: float = Field(
        60.0,
        ge=0,
        le=600,
        description="seconds to wait for the members to be set up (a refusal comes back as the "
        "tool's error within it); training goes on in the background",
    )


class RenderArguments(_Arguments):
    run_id: str = Field(description=RUN_ID)
    view: Literal["samples", "data", "top_losses", "confusion"] = Field(
        "samples",
        description="samples: a grid of samples with their labels and predictions; data: the "
        "data alone (compiles nothing); top_losses: the k samples with the highest loss; "
        "confusion: a classifier's confusion matrix and per-class precision, recall, F1",
    )
    split: str | None = Field(None, description="the split (default: val; for data: train)")
    k: int = Field(9, ge=1, le=64, description="top_losses: how many samples")
    samples: int = Field(16, ge=1, le=64, description="samples, data: how many samples")
    member: int | None = Field(
        None, ge=0, description="a population's member (default: every member, one image each)"
    )


class MemberArguments(_Arguments):
    run_id: str = Field(description="a population's run id (nitro_population, nitro_runs)")
    member: int | None = Field(
        None, ge=0, description="the member to take (its index); default: the best by metric"
    )
    metric: str = Field("val_loss", description="the history column the best member is chosen by")
    mode: Literal["min", "max"] | None = Field(
        None, description="'min' or 'max'; default 'min' for a metric named like a loss"
    )
    max_epochs: int | None = Field(None, ge=1, description="epochs the new run trains to")
    keywords: dict[str, Any] | None = Field(
        None,
        description="other run keywords of the new run (run_dir, checkpointer, early_stop, "
        "logger, ...), in nitro_train's JSON forms; the member's settings are its keywords",
    )
    wait_seconds: float = Field(60.0, ge=0, le=600, description=WAIT)


class RewindArguments(_Arguments):
    run_id: str = Field(description=RUN_ID)
    step: int | None = Field(
        None,
        ge=0,
        description="the step to go back to (a snapshot in memory or a checkpoint); leave it "
        "out to list the steps the run can go back to",
    )


class ForkArguments(_Arguments):
    run_id: str = Field(description=RUN_ID)
    step: int | None = Field(
        None,
        ge=0,
        description="the step to fork at (nitro_rewind without step lists them); default: the "
        "run's state now (it must not be training)",
    )
    overrides: dict[str, Any] | None = Field(
        None, description='Device or Host field values of the fork, e.g. {"scale": 2.0}'
    )
    keywords: dict[str, Any] | None = Field(
        None,
        description="run keywords of the fork that keep its program (learning_rate, "
        "max_epochs, early_stop, checkpointer, ...), in nitro_train's JSON forms; "
        "one that changes the program (accum, sam, a GraphConst field) is refused",
    )
    wait_seconds: float = Field(60.0, ge=0, le=600, description=WAIT)


@dataclasses.dataclass(frozen=True)
class ToolSpec:
    name: str
    description: str
    arguments: type[_Arguments]
    method: str  # the ToolSession method

    def schema(self) -> dict[str, Any]:
        return self.arguments.model_json_schema()


TOOLS: dict[str, ToolSpec] = {
    t.name: t
    for t in [
        ToolSpec(
            "nitro_setup",
            "The devices runs use: backend, device count, the mesh size (n_devs) of new runs. "
            "With no arguments it only reports; n_devs sets the mesh size of later runs.",
            SetupArguments,
            "setup",
        ),
        ToolSpec(
            "nitro_train",
            "Start training an experiment on a background thread and answer its run id at "
            "once; poll nitro_status. Field overrides and run keywords are checked first. With "
            "run_id (and optionally epochs or steps) it continues an existing run or "
            "population instead.",
            TrainArguments,
            "train",
        ),
        ToolSpec(
            "nitro_validate",
            "Loss and metrics on the 'val' split of a run (run_id; a population's: one row per "
            "member), or of a new handle of an experiment (e.g. with weights from a checkpoint "
            "path or run directory).",
            ValidateArguments,
            "validate",
        ),
        ToolSpec(
            "nitro_evaluate",
            "Loss and metrics on any split (default 'test') of a run (a population's: one row "
            "per member), or of a new handle.",
            EvaluateArguments,
            "evaluate",
        ),
        ToolSpec(
            "nitro_predict",
            "Run the model of a run on inputs given as JSON arrays (batch axis first); answers "
            "the outputs as JSON arrays with their shapes and dtypes. A large answer (over "
            "10,000 values) shows its first rows and writes all of them to a file (its path in "
            "'file').",
            PredictArguments,
            "predict",
        ),
        ToolSpec(
            "nitro_export",
            "Write a run's model (run_id), or an experiment's with weights from a checkpoint, as "
            "a serving bundle into dir (nitro.bundle.load, nitro serve); answers its manifest. "
            "echo, batch_sizes and axes shape the client contract as n.export's keywords do.",
            ExportArguments,
            "export",
        ),
        ToolSpec(
            "nitro_runs",
            "Every run: the agent's (id, kind, status) and the notebook's, with phase, epoch, "
            "step and latest loss; a population's with its members, axes and their losses.",
            RunsArguments,
            "runs",
        ),
        ToolSpec(
            "nitro_status",
            "One run in detail: status, phase, epoch, step, latest loss and metrics, "
            "stop_reason (completed, early_stop, requested, error), run directory and "
            "handle_run_id, where its weights came from, result or error text; history=true "
            "adds every epoch. A population's adds each member's settings, epoch, step, loss "
            "and metrics, and the best member.",
            StatusArguments,
            "status",
        ),
        ToolSpec(
            "nitro_logger",
            "The run's loggers: their types and files (metrics.jsonl in the run directory by "
            "default), and where to look at them; a population's: each member's directory "
            "and files.",
            RunIdArguments,
            "logger",
        ),
        ToolSpec(
            "nitro_stop",
            "Stop a run cleanly: the current step finishes and nothing is lost "
            "(stop_reason 'requested'); it can be continued with nitro_train(run_id=...). "
            "With member, stop one member of a population (prune it); the others train on.",
            StopArguments,
            "stop",
        ),
        ToolSpec(
            "nitro_population",
            "Start a population: members of one experiment that differ in fed values (axes: "
            "learning rates, seeds, Device fields), trained side by side by one program on a "
            "background thread; answers its run id once the members are set up. The tools for "
            "runs work on its run id (nitro_status, history=true: every member's epochs with "
            "its settings; nitro_validate, nitro_evaluate: one row per member; nitro_train "
            "with run_id trains it on; nitro_stop stops it, or one member with member); "
            "nitro_member takes one member as a run.",
            PopulationArguments,
            "population",
        ),
        ToolSpec(
            "nitro_render",
            "Look at what a run's model does: images (PNG) of samples with their labels and "
            "predictions, of the data alone, of the samples with the highest loss, or of a "
            "classifier's confusion matrix, with their rows as JSON. Uses the evaluation "
            "program the run already has; the data view compiles nothing.",
            RenderArguments,
            "render",
        ),
        ToolSpec(
            "nitro_member",
            "Take the best member of a population (by metric, default val_loss), or member i, "
            "as a new single run with its settings and current weights; the other tools "
            "(nitro_validate, nitro_train, nitro_export, ...) work on its run id.",
            MemberArguments,
            "member",
        ),
        ToolSpec(
            "nitro_rewind",
            "Take a run (not training) back to an earlier step, a snapshot in memory or a "
            "checkpoint: weights, optimizer state, data position, random streams, history and "
            "Device values as they were, so nitro_train with its run_id trains on bit for bit "
            "as before. The steps after it stay in the history as an abandoned branch. "
            "Without step it lists the steps the run can go back to.",
            RewindArguments,
            "rewind",
        ),
        ToolSpec(
            "nitro_fork",
            "A new run starting from a run's snapshot at step, with other Device or Host field "
            "values or run keywords that keep its program (a learning rate, max_epochs); answers "
            "its run id (nitro_train trains it, beside its parent). With no changes it trains "
            "on bit for bit as the parent did.",
            ForkArguments,
            "fork",
        ),
    ]
}


def _argument_errors(tool: ToolSpec, error: ValidationError) -> str:
    """`nitro_train: argument 'max_epochs': ...`, one clause per argument. An argument of
    several accepted forms (`resume`) gets its most specific problem and the forms it takes,
    rather than one complaint per form."""
    allowed = ", ".join(tool.arguments.model_fields) or "none"
    by_argument: dict[str, list[ErrorDetails]] = {}
    for item in error.errors():
        by_argument.setdefault(str(item["loc"][0]) if item["loc"] else "arguments", []).append(item)
    problems = []
    for name, items in by_argument.items():
        item = max(items, key=lambda i: len(i["loc"]))
        if item["type"] == "extra_forbidden":
            problems.append(f"unknown argument {name!r} (arguments: {allowed})")
        elif item["type"] == "missing":
            problems.append(f"argument {name!r} is required")
        else:
            where = ".".join(str(p) for p in item["loc"] if isinstance(p, int) or p == name)
            problem = f"argument {where!r}: {item['msg']} (got {item['input']!r})"
            field = tool.arguments.model_fields.get(name)
            if len(items) > 1 and field is not None and field.description:
                problem += f"; {name}: {field.description}"
            problems.append(problem)
    return f"{tool.name}: " + "; ".join(problems)


def call(session: ToolSession, name: str, arguments: dict[str, Any] | None) -> dict[str, Any]:
    """Check `arguments` and run tool `name` on `session` (blocking); raises ToolFailure."""
    tool = TOOLS.get(name)
    if tool is None:
        raise ToolFailure(f"no tool {name!r}; tools: {', '.join(TOOLS)}")
    try:
        parsed = tool.arguments.model_validate(arguments or {})
    except ValidationError as error:
        raise ToolFailure(_argument_errors(tool, error)) from None
    method: Callable[..., dict[str, Any]] = getattr(session, tool.method)
    try:
        return method(**parsed.model_dump())
    except ToolFailure as failure:
        raise ToolFailure(f"{name}: {failure}") from None
    except Exception as error:  # noqa: BLE001 - the agent reads what went wrong
        raise ToolFailure(f"{name}: {type(error).__name__}: {error}") from None


def _text(value: Any) -> list[types.ContentBlock]:
    return [types.TextContent(type="text", text=json.dumps(value, indent=1))]


INSTRUCTIONS = (
    "Nitro trains JAX/Flax experiments in the session this server belongs to. nitro_train "
    "answers a run id at once; poll nitro_status until status is not 'running', then read "
    "the metrics, nitro_evaluate or nitro_predict. nitro_stop stops a run cleanly. "
    "nitro_population trains many variants at once; nitro_member takes one as a run. "
    "nitro_rewind goes back to an earlier step; nitro_fork starts a new run from one."
)


def build_server(session: ToolSession) -> Server:
    """An MCP server (the SDK's low-level `Server`) offering the fifteen tools on `session`."""

    async def list_tools(ctx, params) -> types.ListToolsResult:
        return types.ListToolsResult(
            tools=[
                types.Tool(name=t.name, description=t.description, input_schema=t.schema())
                for t in TOOLS.values()
            ]
        )

    async def call_tool(ctx, params: types.CallToolRequestParams) -> types.CallToolResult:
        work = functools.partial(call, session, params.name, params.arguments)
        try:
            result = await anyio.to_thread.run_sync(work)
        except ToolFailure as failure:
            message = types.TextContent(type="text", text=str(failure))
            return types.CallToolResult(content=[message], is_error=True)
        images = result.pop("images", None) or []
        content = _text(result) + [
            types.ImageContent(
                type="image", data=base64.b64encode(png).decode(), mime_type="image/png"
            )
            for png in images
        ]
        return types.CallToolResult(content=content, structured_content=result)

    return Server(
        "nitro",
        version=__version__,
        instructions=INSTRUCTIONS,
        on_list_tools=list_tools,
        on_call_tool=call_tool,
    )
