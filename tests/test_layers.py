"""The house by layers: nitro's packages import only the packages below them."""

from __future__ import annotations

import ast
import importlib
import pathlib
import tomllib

import grimp

import nitro

ROOT = pathlib.Path(nitro.__file__).parent

# bottom-up; a package may import any package listed before it, never one after it
LAYERS = [
    "_version",
    "_public_path",
    "errors",
    "experiments",
    "data",
    "optim",
    "core",
    "programs",
    "runs",
    "weights",
    "models",
    "loggers",
    "engine",
    "serving",
    "handle",
    "mcp",
    "examples",
    "cli",
]
# public import paths kept at the top level: each stands for the module of a package
# (`nitro.bundle` for `nitro.serving.bundle`)
ALIASES = {
    "bundle": "serving",
    "serve": "serving",
    "manual": "programs",
    "staleness": "programs",
    "events": "core",
    "progress": "core",
    "runner": "engine",
    "dispatch": "engine",
    "datasets": "data",
    "gallery": "handle",
    "search": "engine",
}


# what nitro_ipython may import: the facade, the public import paths and the public packages
PUBLIC = {
    "nitro",
    *(f"nitro.{alias}" for alias in ALIASES),
    "nitro.data",
    "nitro.loggers",
    "nitro.mcp",
    "nitro.weights",
    "nitro.models",
}


def _unit(module: str) -> str | None:
    parts = module.split(".")
    if parts[0] != "nitro" or len(parts) < 2:
        return None
    return ALIASES.get(parts[1], parts[1])


def _imports(path: pathlib.Path):
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, node.lineno
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            yield node.module, node.lineno
            for alias in node.names:
                yield f"{node.module}.{alias.name}", node.lineno


def test_every_package_and_top_level_module_has_a_layer():
    units = {p.stem if p.is_file() else p.name for p in ROOT.iterdir()}
    units = {u for u in units if not u.startswith("__")} - {"py"}
    assert units - set(LAYERS) - set(ALIASES) == set()


def test_no_package_imports_a_higher_one():
    breaches = []
    for path in ROOT.rglob("*.py"):
        relative = path.relative_to(ROOT)
        if relative == pathlib.Path("__init__.py"):
            continue  # the lazy facade: it names every public module
        own = ALIASES.get(
            relative.parts[0].removesuffix(".py"), relative.parts[0].removesuffix(".py")
        )
        for module, line in _imports(path):
            other = _unit(module)
            if other is None or other == own or other not in LAYERS:
                continue
            if LAYERS.index(other) > LAYERS.index(own):
                breaches.append(f"nitro/{relative}:{line} ({own}) imports {module} ({other})")
    assert breaches == []


def test_relative_imports_are_not_used_so_a_moved_module_cannot_silently_change_meaning():
    relative = [
        f"{path.relative_to(ROOT)}:{node.lineno}"
        for path in ROOT.rglob("*.py")
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8")))
        if isinstance(node, ast.ImportFrom) and node.level
    ]
    assert relative == []


def test_the_version_is_set_once_in_a_leaf_module_that_pyproject_reads():
    leaf = ROOT / "_version.py"
    imports = [
        node
        for node in ast.walk(ast.parse(leaf.read_text(encoding="utf-8")))
        if isinstance(node, ast.Import | ast.ImportFrom)
    ]
    pyproject = tomllib.loads((ROOT.parent / "pyproject.toml").read_text(encoding="utf-8"))
    assert imports == []
    assert pyproject["tool"]["setuptools"]["dynamic"]["version"] == {
        "attr": "nitro._version.__version__"
    }
    assigned = [
        path.relative_to(ROOT).as_posix()
        for path in ROOT.rglob("*.py")
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8")))
        if isinstance(node, ast.Assign)
        and any(isinstance(t, ast.Name) and t.id == "__version__" for t in node.targets)
    ]
    assert assigned == ["_version.py"]


def _circles(graph) -> list[str]:
    circles = set()
    for importer in graph.modules:
        for imported in graph.find_modules_directly_imported_by(importer):
            back = graph.find_shortest_chain(importer=imported, imported=importer)
            if back is not None:
                circles.add(" -> ".join((importer, *back)))
    return sorted(circles)


def test_no_module_of_nitro_imports_itself_through_others():
    # every import counts: at module level, inside functions and under TYPE_CHECKING; the
    # `%load_ext nitro` shim's import of nitro_ipython leaves the package, so it is no edge here
    graph = grimp.build_graph("nitro", cache_dir=None)
    # the facade imports the module of each public name when the name is first used
    for module in {*nitro._EXPORTS.values(), *(f"nitro.{m}" for m in nitro._SUBMODULES)}:
        graph.add_import(importer="nitro", imported=module)
    assert _circles(graph) == []


def test_no_module_of_the_notebook_layer_imports_itself_through_others():
    # every import counts here too, the package's own imports in `load_ipython_extension`
    # included; its imports of nitro leave the package
    graph = grimp.build_graph("nitro_ipython", include_external_packages=False, cache_dir=None)
    assert _circles(graph) == []


def test_the_notebook_layer_imports_only_public_modules_and_their_public_names():
    private = []
    for path in (ROOT.parent / "nitro_ipython").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                modules = {a.name: [] for a in node.names if a.name.split(".")[0] == "nitro"}
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                modules = {node.module: [a.name for a in node.names]}
            else:
                continue
            for module, names in modules.items():
                if module.split(".")[0] != "nitro":
                    continue
                where = f"nitro_ipython/{path.name}:{node.lineno}"
                if module not in PUBLIC:
                    private.append(f"{where} imports the internal module {module}")
                    continue
                public = set(importlib.import_module(module).__all__)
                private += [
                    f"{where} imports {module}.{name}, which is not in its __all__"
                    for name in names
                    if name not in public
                ]
    assert private == []


def test_no_two_modules_share_a_name_except_a_public_import_path_and_its_module():
    by_name: dict[str, set[str]] = {}
    for path in [*ROOT.rglob("*.py"), *(ROOT.parent / "nitro_ipython").rglob("*.py")]:
        if path.name not in ("__init__.py", "__main__.py"):
            by_name.setdefault(path.stem, set()).add(path.relative_to(ROOT.parent).as_posix())
    shared = {name: paths for name, paths in by_name.items() if len(paths) > 1}
    expected = {
        alias: {f"nitro/{alias}.py", f"nitro/{package}/{alias}.py"}
        for alias, package in ALIASES.items()
    }
    # a population's module in each layer it reaches
    population = {f"nitro/{p}/population.py" for p in ("programs", "engine", "handle", "mcp")}
    if shared.get("population", set()) <= population:
        shared.pop("population", None)
    assert shared == expected


def test_each_public_import_path_is_its_own_files_module_and_reads_and_sets_its_modules_names(
    monkeypatch,
):
    for alias, package in ALIASES.items():
        public = importlib.import_module(f"nitro.{alias}")
        module = importlib.import_module(f"nitro.{package}.{alias}")
        # what `pytest --doctest-modules nitro` checks of every file it imports
        assert public.__file__ == str(ROOT / f"{alias}.py")
        assert {n: getattr(public, n) for n in module.__all__} == {
            n: getattr(module, n) for n in module.__all__
        }
    engine = importlib.import_module("nitro.engine.dispatch")
    share = engine.PROBE_SHARE
    with monkeypatch.context() as patch:
        patch.setattr(nitro.dispatch, "PROBE_SHARE", share * 2)
        assert engine.PROBE_SHARE == share * 2
    assert engine.PROBE_SHARE == nitro.dispatch.PROBE_SHARE == share


def test_every_module_is_the_module_of_its_file_as_standard_tools_import_it():
    # what `pytest --doctest-modules nitro nitro_ipython` checks of each file it imports; the
    # serving's server modules are imported in a server process only (conftest.py)
    elsewhere = {ROOT / "serving" / "server.py", ROOT / "serving" / "transport.py"}
    mismatched = []
    for package in (ROOT, ROOT.parent / "nitro_ipython"):
        for path in sorted(package.rglob("*.py")):
            if path.name == "__main__.py" or path in elsewhere:
                continue
            parts = path.relative_to(ROOT.parent).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            if pathlib.Path(importlib.import_module(name).__file__ or "") != path:
                mismatched.append(name)
    assert mismatched == []


def test_every_package_has_a_docstring_that_names_each_of_its_modules():
    unnamed = []
    files = [*ROOT.rglob("*.py"), *(ROOT.parent / "nitro_ipython").rglob("*.py")]
    for package in sorted({path.parent for path in files}):
        init = package / "__init__.py"
        doc = (
            ast.get_docstring(ast.parse(init.read_text(encoding="utf-8"))) if init.exists() else ""
        )
        parts = [p for p in package.iterdir() if p.suffix == ".py" or (p / "__init__.py").exists()]
        names = {p.stem for p in parts} - {"__init__", "__main__"}
        where = package.relative_to(ROOT.parent).as_posix()
        unnamed += [
            f"{where}: {name}"
            for name in sorted(names)
            if f"`{name}`" not in (doc or "") and f"`{name}.py`" not in (doc or "")
        ]
    assert unnamed == [], unnamed
