"""The options of `nitro train` and the other experiment commands: one per field of the
experiment (`field_specs`) and per run keyword (`RUN_KEYWORDS`), with their docs, types and
defaults, parsed by jsonargparse from the command line and from configuration files (YAML,
JSON or TOML; later arguments win); and the resolved configuration, written back out by
`--print-config` and into every run directory (`config.yaml`).

A value given as text reads as YAML reads it (`8`, `0.1`, `1e-3`, `null`, `[val, test]`,
`{data: 2}`), and stays the text where the option takes a str and the YAML reading does not
fit. Parsing refuses no value: the Python API's own checks do, after it, so a bad value gets
the message `nitro.Nitro(...)` gives, with the option's name in front. An option left out
resolves as in Python (a method of the experiment, a Host field, the framework default).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import os
import re
import sys
import types
import typing
from collections.abc import Mapping, Sequence
from typing import Any

from nitro.engine.run_keywords import KEYWORD_ONLY, RUN_KEYWORDS
from nitro.errors import ExperimentError, SetupError
from nitro.experiments.declaration import FieldKind, check_field_type, field_specs, has_method
from nitro.experiments.field_types import fits_type
from nitro.experiments.presets import from_preset

__all__ = [
    "CONFIG_FILE",
    "CommandError",
    "Option",
    "Settings",
    "parse",
    "resolved_config",
    "write_config",
]

CONFIG_FILE = "config.yaml"  # the resolved configuration, in the run's directory
_MODE = "nitro"  # jsonargparse's parser mode for our loader: YAML (and JSON), else TOML
_GIVEN = argparse.SUPPRESS  # an option left out is not in the parsed namespace
_WEIGHTS_TYPE = str | tuple[str, str]


class CommandError(Exception):
    """A value the command refuses: printed as `nitro <command>: error: <message>`, exit 2."""


@dataclasses.dataclass(frozen=True)
class Option:
    """One option of an experiment command: a field's or a run keyword's."""

    name: str  # the field's or run keyword's name, the configuration's key
    type: Any  # the declared annotation, or a string naming objects only Python builds
    default: str  # the default as help shows it
    doc: str
    keyword: bool  # a run keyword (passed to Nitro); else a field of the experiment
    namespace: Mapping[str, Any] | None = None  # resolves a field's string annotation

    def read(self, value: Any) -> Any:
        """A value as given (text from the command line, or what a configuration file held)
        read for this option; never refuses."""
        if not isinstance(value, str):
            return value
        try:
            loaded = _yaml_load(value)
        except Exception:  # noqa: BLE001 - not YAML: the text itself
            return value
        loaded = _tuples(loaded, self.type, self.namespace)
        if isinstance(loaded, str) or not _takes_str(self.type, self.namespace):
            return loaded
        return loaded if fits_type(self.type, loaded, self.namespace) is not False else value


def _takes_str(tp: Any, namespace: Mapping[str, Any] | None) -> bool:
    return fits_type(tp, "text", namespace) is True


def _tuples(value: Any, tp: Any, namespace: Mapping[str, Any] | None) -> Any:
    """A list where the type takes a tuple (and no list) as the tuple."""
    if isinstance(value, list) and fits_type(tp, (), namespace) and not fits_type(tp, []):
        return tuple(value)
    return value


def _type_text(tp: Any) -> str:
    """An annotation as `--help` shows it: `int | null`, `auto | threads`, `tuple[str, ...]`."""
    if isinstance(tp, str):
        return tp
    if tp is None or tp is type(None):
        return "null"
    origin, arguments = typing.get_origin(tp), typing.get_args(tp)
    if origin is typing.Union or origin is types.UnionType:
        return " | ".join(_type_text(argument) for argument in arguments)
    if origin is typing.Literal:
        return " | ".join(str(value) for value in arguments)
    if origin is typing.Annotated:
        return _type_text(arguments[0])
    if origin is not None:
        inner = ", ".join("..." if a is Ellipsis else _type_text(a) for a in arguments)
        return f"{getattr(origin, '__name__', origin)}[{inner}]"
    return getattr(tp, "__name__", str(tp))


def _default_text(value: Any, text: str) -> str:
    """A default as the command line spells it (`null`, `true`, `[val, test]`), else `text`."""
    return _plain_text(value) if _plain(value) is not _NOT_PLAIN else text


def experiment_options(cls: type) -> list[Option]:
    """The options of `cls`'s commands: its fields (a field named like a run keyword is that
    keyword's option, as in a population), then the run keywords and `weights`."""
    module = sys.modules.get(cls.__module__)
    namespace = vars(module) if module is not None else None
    specs = {spec.name: spec for spec in field_specs(cls)}
    options = [
        Option(spec.name, spec.type, _field_default(spec), _field_doc(cls, spec), False, namespace)
        for spec in specs.values()
        if spec.name not in RUN_KEYWORDS
    ]
    for name, keyword in RUN_KEYWORDS.items():
        default, doc = keyword.default_text, keyword.doc
        if not keyword.computed:
            default = _default_text(keyword.default, default)
        if name == "resume":
            default = "the command's: auto where a run with these GraphConst values has a checkpoint, else a new run"
        spec = specs.get(name)
        if has_method(cls, name):
            default = f"{cls.__name__}.{name}()"
        elif spec is not None and spec.kind is FieldKind.HOST:
            default = f"{_field_default(spec)} ({cls.__name__}.{name})"
            doc = spec.doc or doc
        options.append(Option(name, keyword.type, default, doc, True))
    options.append(Option("weights", _WEIGHTS_TYPE, "null", KEYWORD_ONLY["weights"], True))
    return options


def _field_default(spec: Any) -> str:
    if not spec.has_default:
        return "required"
    return _default_text(spec.default, getattr(spec.default, "__name__", repr(spec.default)))


def _field_doc(cls: type, spec: Any) -> str:
    kind = {FieldKind.GRAPHCONST: "GraphConst", FieldKind.DEVICE: "Device"}.get(spec.kind)
    return (f"{kind}: " if kind else "") + (spec.doc or f"{cls.__name__}.{spec.name}")


# ---------------------------------------------------------------------------------------------
# reading text and files


def _yaml_load(text: str) -> Any:
    """YAML as jsonargparse reads it: floats as YAML 1.2 reads them (`1e-3` is a number)."""
    from jsonargparse import get_loader

    return get_loader("yaml")(text)


def load_config_text(text: str) -> Any:
    """A configuration file's contents: YAML (JSON is YAML) when it reads as a mapping, else
    TOML; anything else as YAML reads it."""
    import tomllib

    try:
        value = _yaml_load(text)
    except Exception:  # noqa: BLE001 - maybe TOML
        value = None
    if isinstance(value, dict) or not text.strip():
        return value
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError:
        if value is None:
            raise
        return value


def _register_loader() -> None:
    import tomllib

    import yaml
    from jsonargparse import set_loader

    set_loader(_MODE, load_config_text, (yaml.YAMLError, tomllib.TOMLDecodeError))


# ---------------------------------------------------------------------------------------------
# parsing


@dataclasses.dataclass(frozen=True)
class Settings:
    """What a command was given: the experiment, its preset, the fields and run keywords given
    (as given: YAML-able) and the command's own options."""

    target: str  # module:Class
    cls: type
    preset: str | None
    fields: dict[str, Any]
    keywords: dict[str, Any]
    command: dict[str, Any]
    options: tuple[Option, ...]

    def experiment(self) -> Any:
        """The experiment instance: the preset's values, then the fields given; a field the
        Python API refuses is an error naming its option."""
        specs = {spec.name: spec for spec in field_specs(self.cls)}
        fields = {}
        for name, given in self.fields.items():
            try:
                fields[name] = value = _built(given)
                check_field_type(self.cls, specs[name], value, call=self.cls.__name__)
            except (ValueError, TypeError, SetupError, ExperimentError) as error:
                raise CommandError(f"{_flag(name)} {_shown(given)}: {error}") from None
        missing = [
            name
            for name, spec in specs.items()
            if not spec.has_default and name not in fields and name not in RUN_KEYWORDS
        ]
        if missing and self.preset is None:
            raise CommandError(
                f"{', '.join(map(_flag, missing))} {'is' if len(missing) == 1 else 'are'} "
                f"required: {self.cls.__name__} declares no default for "
                f"{', '.join(missing)}"
            )
        try:  # an unknown preset is refused there, listing the experiment's
            return from_preset(self.cls, self.preset, **fields)
        except (ExperimentError, TypeError, ValueError) as error:
            raise CommandError(str(error)) from None

    def run_keywords(self) -> dict[str, Any]:
        """The run keywords given, as `Nitro(...)` takes them; a value its check refuses is an
        error naming its option."""
        keywords = {}
        for name, given in self.keywords.items():
            try:
                value = _built(given)
                declared = RUN_KEYWORDS[name].type if name in RUN_KEYWORDS else None
                if isinstance(declared, str) and isinstance(value, str) and _PATH.fullmatch(value):
                    value = _imported(value) or value  # an object only Python builds, by path
                if name in RUN_KEYWORDS:
                    RUN_KEYWORDS[name].checked(value)
            except (ValueError, TypeError, SetupError, ExperimentError) as error:
                raise CommandError(f"{_flag(name)} {_shown(given)}: {error}") from None
            keywords[name] = value
        return keywords


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _shown(value: Any) -> str:
    return value if isinstance(value, str) else _plain_text(value)


def _plain_text(value: Any) -> str:
    import yaml

    text = yaml.safe_dump(_plain(value), default_flow_style=True, width=1000).strip()
    return text.removesuffix("\n...").removesuffix("...").strip()


def split_target(argv: Sequence[str]) -> tuple[str | None, list[str]]:
    """(module:Class, the other arguments): the experiment is the first argument, when it is
    not an option."""
    if argv and not argv[0].startswith("-"):
        return argv[0], list(argv[1:])
    return None, list(argv)


def target_in_configs(argv: Sequence[str]) -> str | None:
    """The experiment the last `--config` file names (its `experiment` key)."""
    found = None
    for index, arg in enumerate(argv):
        path = None
        if arg == "--config" and index + 1 < len(argv):
            path = argv[index + 1]
        elif arg.startswith("--config="):
            path = arg.partition("=")[2]
        if path is None:
            continue
        try:
            with open(path, encoding="utf-8") as file:
                config = load_config_text(file.read())
        except Exception as error:  # noqa: BLE001 - a missing file, YAML or TOML that does not parse
            raise CommandError(f"--config {path}: cannot read it ({error})") from None
        if isinstance(config, dict) and isinstance(config.get("experiment"), str):
            found = config["experiment"]
    return found


def import_experiment(target: str) -> type:
    """The experiment class `module:Class` (or `module.Class`) names."""
    module_name, colon, name = target.partition(":")
    if not colon:
        module_name, _, name = target.rpartition(".")
    if not module_name or not name:
        raise CommandError(
            f"{target!r} names no experiment: give module:Class, e.g. nitro.examples.digits:Digits"
        )
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())  # as `python -m` does: a module beside the shell
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as error:
        if error.name and module_name.startswith(error.name):
            raise CommandError(
                f"{target}: no module named {error.name!r} (is the directory that holds it "
                f"the working directory, or on PYTHONPATH?)"
            ) from None
        raise
    cls = module
    for part in name.split("."):
        cls = getattr(cls, part, None)
        if cls is None:
            public = [n for n, v in vars(module).items() if isinstance(v, type)]
            raise CommandError(
                f"{target}: module {module_name!r} has no {name!r}{_close(name, public)}"
            )
    if not isinstance(cls, type) or not hasattr(cls, "__nitro_fields__"):
        raise CommandError(f"{target} is not an experiment: a class decorated @nitro.experiment")
    return cls


def _close(name: str, known: Sequence[str]) -> str:
    import difflib

    close = difflib.get_close_matches(name, known, n=3, cutoff=0.5)
    return f" (did you mean {', '.join(close)}?)" if close else ""


def build_parser(
    prog: str, description: str, cls: type, options: Sequence[Option], command: Sequence[dict]
):
    """The jsonargparse parser of an experiment command: `--config`, `--print-config`,
    `--preset`, the command's own options, then one per field and run keyword."""
    try:
        from jsonargparse import (
            ActionConfigFile,  # pyright: ignore[reportPrivateImportUsage]
            ArgumentParser,
        )
    except ImportError:
        raise CommandError(
            f"{prog} reads its options with jsonargparse, which is not installed: "
            f"pip install 'nitro[cli]'"
        ) from None
    _register_loader()
    parser = ArgumentParser(
        prog=prog,
        usage=f"{prog} {cls.__module__}:{cls.__qualname__} [--config FILE] [--print-config] "
        "[--preset NAME] [--OPTION VALUE ...]",
        description=description,
        print_config=None,  # `--print-config` prints the resolved configuration: ours
        parser_mode=_MODE,
        exit_on_error=False,
        allow_abbrev=False,
    )
    parser.add_argument("--experiment", type=str, default=_GIVEN, help=argparse.SUPPRESS)
    parser.add_argument(
        "--config",
        action=ActionConfigFile,
        help="a configuration file (YAML, JSON or TOML; a run's config.yaml): its keys are "
        "the options' names; later arguments override it",
    )
    parser.add_argument(
        "--print-config",
        action="store_true",
        help="print the resolved configuration (YAML) and exit",
    )
    parser.add_argument(
        "--preset",
        type=str,
        default=None,
        help=f"start from the named preset of {cls.__name__} (the fields given override it)",
    )
    for spec in command:
        parser.add_argument(spec["flag"], **{k: v for k, v in spec.items() if k != "flag"})
    groups = {
        False: parser.add_argument_group(f"fields of {cls.__qualname__}"),
        True: parser.add_argument_group("run keywords (nitro.Nitro(...))"),
    }
    own = {"--experiment", "--config", "--print-config", "--preset", *(c["flag"] for c in command)}
    for option in options:
        if _flag(option.name) in own:
            raise CommandError(
                f"{cls.__name__}.{option.name} would be the option {_flag(option.name)}, which "
                f"{prog} has of its own: rename the field"
            )
        names = [_flag(option.name)] + ([f"--{option.name}"] if "_" in option.name else [])
        groups[option.keyword].add_argument(
            *names,
            dest=option.name,
            type=_Reader(option),
            default=_GIVEN,
            metavar=option.name.upper(),
            help=f"{option.doc} [%(type)s; default: {option.default}]",
        )
    return parser


class _Reader:
    """The parser's type for an option: `Option.read`; `--help` shows the declared type."""

    def __init__(self, option: Option):
        self.option = option

    def __repr__(self) -> str:
        return _type_text(self.option.type)

    def __call__(self, value: Any) -> Any:
        return self.option.read(value)


def parse(
    prog: str, description: str, argv: Sequence[str], command: Sequence[dict]
) -> tuple[Settings, bool]:
    """(the `Settings` an experiment command's arguments give, whether `--print-config` was
    given)."""
    target, rest = split_target(argv)
    target = target or target_in_configs(rest)
    if target is None:
        raise CommandError(
            f"name the experiment: {prog} module:Class [options] (e.g. "
            f"{prog} nitro.examples.digits:Digits --max-epochs 1), or give --config with an "
            f"'experiment' key"
        )
    cls = import_experiment(target)
    options = experiment_options(cls)
    parser = build_parser(prog, description, cls, options, command)
    try:
        namespace = parser.parse_args([*rest, "--experiment", target])
    except argparse.ArgumentError as error:
        raise CommandError(_with_hint(str(error), options, command)) from None
    given = namespace.as_dict()
    by_name = {option.name: option for option in options}
    own = {spec["flag"].lstrip("-").replace("-", "_") for spec in command}
    settings = Settings(
        target=target,
        cls=cls,
        preset=given.get("preset"),
        fields={k: v for k, v in given.items() if k in by_name and not by_name[k].keyword},
        keywords={k: v for k, v in given.items() if k in by_name and by_name[k].keyword},
        command={k: v for k, v in given.items() if k in own},
        options=tuple(options),
    )
    return settings, bool(given.get("print_config"))


def _with_hint(message: str, options: Sequence[Option], command: Sequence[dict]) -> str:
    """jsonargparse's message, with the options meant where a name was mistyped."""
    known = [_flag(o.name) for o in options] + [s["flag"] for s in command]
    known += ["--config", "--print-config", "--preset"]
    unknown = re.findall(r"(--[\w-]+)", message) if "unrecognized" in message else []
    unknown += ["--" + k.replace("_", "-") for k in re.findall(r"Option '([\w.]+)'", message)]
    hints = [f"{name}{_close(name, known)}" for name in unknown if _close(name, known)]
    return message + (f"; {'; '.join(hints)}" if hints else "")


# ---------------------------------------------------------------------------------------------
# the resolved configuration


def _plain(value: Any) -> Any:
    """`value` as YAML holds it (tuples as lists, numpy scalars as numbers), or `_NOT_PLAIN`."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)):
        items = [_plain(v) for v in value]
        return _NOT_PLAIN if _NOT_PLAIN in items else items
    if isinstance(value, Mapping):
        items = {k: _plain(v) for k, v in value.items()}
        plain = all(isinstance(k, str) for k in items) and _NOT_PLAIN not in items.values()
        return items if plain else _NOT_PLAIN
    item = getattr(value, "item", None)  # a numpy scalar
    if callable(item) and getattr(value, "shape", None) == ():
        return _plain(item())
    return _NOT_PLAIN


_NOT_PLAIN = object()


def resolved_config(settings: Settings, experiment: Any) -> dict[str, Any]:
    """The configuration that rebuilds this run: the experiment, its preset, every field's
    value in declaration order (those a YAML file can hold; one given as a `class_path`, as
    given), then the run keywords given. `nitro train --config` of it trains the same run."""
    config: dict[str, Any] = {"experiment": settings.target, "preset": settings.preset}
    given = {**settings.fields, **settings.keywords}
    for spec in field_specs(settings.cls):
        if spec.name in given:
            config[spec.name] = given[spec.name]
        elif spec.name not in RUN_KEYWORDS or spec.kind is FieldKind.HOST:
            # a Host field named like a run keyword is what the keyword resolves to
            config[spec.name] = _plain(getattr(experiment, spec.name))
    for option in settings.options:
        if option.keyword and option.name in given:
            config[option.name] = given[option.name]
    return {
        k: _plain(v) if _plain(v) is not _NOT_PLAIN else v
        for k, v in config.items()
        if v is not _NOT_PLAIN
    }


def config_text(config: Mapping[str, Any]) -> str:
    import yaml

    return yaml.safe_dump(dict(config), sort_keys=False, default_flow_style=False)


def write_config(run_dir: str, config: Mapping[str, Any]) -> str:
    """Write `config` as the run's `config.yaml` (a temporary file, then a rename)."""
    path = os.path.join(run_dir, CONFIG_FILE)
    os.makedirs(run_dir, exist_ok=True)
    temporary = f"{path}.{os.getpid()}.tmp"
    with open(temporary, "w", encoding="utf-8") as file:
        file.write(config_text(config))
    os.replace(temporary, path)
    return path


# ---------------------------------------------------------------------------------------------
# objects a configuration names


def _built(value: Any) -> Any:
    """`value` with each `{class_path: ..., init_args: {...}}` replaced by the object it
    builds (jsonargparse's and LightningCLI's spelling)."""
    if isinstance(value, Mapping) and "class_path" in value:
        target = _imported(str(value["class_path"]))
        if target is None:
            raise ValueError(f"class_path {value['class_path']!r} does not import")
        arguments = {k: _built(v) for k, v in dict(value.get("init_args") or {}).items()}
        return target(**arguments)
    if isinstance(value, Mapping):
        return {k: _built(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_built(v) for v in value)
    return value


_PATH = re.compile(r"[A-Za-z_][\w.]*[.:][A-Za-z_]\w*")  # optax.sgd, my_module:schedule


def _imported(path: str) -> Any:
    module_name, colon, name = path.partition(":")
    if not colon:
        module_name, _, name = path.rpartition(".")
    try:
        target: Any = importlib.import_module(module_name)
    except (ImportError, ValueError):
        return None
    for part in name.split("."):
        target = getattr(target, part, None)
    return target
