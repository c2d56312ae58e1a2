"""docs/architecture.md names every module, and dtrain's imports run down its layers.

The import graph is read from the source with `ast`: every import, at module level, inside
functions and under ``if TYPE_CHECKING:`` alike (a type named from a higher layer is an
arrow running up, even if it never runs). A unit is a package (``parallel/``) or a
top-level module (``advice.py``); the layers and rules below are the "Layers" section of
docs/architecture.md.
"""

from __future__ import annotations

import ast
import functools
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

pytestmark = pytest.mark.quick

ROOT = Path(__file__).resolve().parent.parent
SOURCE = ROOT / "src" / "dtrain"
DOC = ROOT / "docs" / "architecture.md"

# The package itself (`import dtrain`, `from dtrain import __version__`).
PACKAGE = "__init__.py"

# Bottom to top: a unit may import units of its own layer or of the layers below.
LAYERS: list[tuple[str, set[str]]] = [
    ("leaves", {"errors.py", "advice.py", "command_names.py"}),
    ("foundations", {"config/", "process/", "step/", "models/", "datasets/"}),
    ("measurement and files", {"observe/", "checkpoint/", "data/"}),
    ("parallel core", {"parallel/"}),
    ("strategies", {"strategies/"}),
    ("loop and launcher", {"engine/", "launcher/"}),
    ("commands and products", {PACKAGE, "demo/", "cli/", "bench/", "plan/", "horovod/", "keras/"}),
]

PRODUCTS = {"horovod/", "plan/", "keras/", "bench/"}
# What runs before any process starts reaches a strategy only through its spec.
LAUNCH_SIDE = {"launcher/", "cli/", "bench/", "plan/"}
SPECS = "dtrain.strategies.specs"
LEAVES = LAYERS[0][1]
LOOP = {"engine/"}

# Rules stricter than the layers: (importers, units they may not import, why).
RULES: list[tuple[set[str], set[str], str]] = [
    (
        {"observe/"},
        {"strategies/", "models/", "parallel/", "launcher/"},
        "measurement sees tensors and timings, never how they were produced",
    ),
    (
        {"parallel/"},
        {"strategies/", "launcher/", "engine/"},
        "the parallel core knows no strategy, launcher or Engine",
    ),
    (
        {"checkpoint/"},
        {"strategies/", "launcher/", "engine/"},
        "the formats know no strategy, launcher or Engine",
    ),
    ({"launcher/"}, LOOP | {"parallel/", "models/"}, "the launcher never runs the loop"),
    (LOOP, {"launcher/"}, "the loop runs the same with or without the launcher"),
]


def units() -> dict[str, str]:
    """Every source file (relative to src/dtrain) and the unit it belongs to."""
    packages = {p.name for p in SOURCE.iterdir() if (p / "__init__.py").exists()}
    found = {}
    for path in SOURCE.rglob("*.py"):
        rel = path.relative_to(SOURCE).as_posix()
        top = rel.split("/")[0]
        found[rel] = f"{top}/" if top in packages else rel
    return found


def unit_of(module: str) -> str:
    """The unit of a dotted module name under dtrain (``dtrain`` itself is PACKAGE)."""
    parts = module.split(".")[1:]
    if not parts:
        return PACKAGE
    if (SOURCE / parts[0]).is_dir():
        return f"{parts[0]}/"
    return f"{parts[0]}.py" if (SOURCE / f"{parts[0]}.py").exists() else PACKAGE


def imported(node: ast.AST, package: str) -> Iterator[tuple[int, str]]:
    """(line, dotted module) of every dtrain import under `node`, type-only ones included;
    `package` (dotted) resolves relative imports."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.Import):
            names = [alias.name for alias in child.names]
        elif isinstance(child, ast.ImportFrom):
            base = package.rsplit(".", child.level - 1)[0] if child.level else ""
            module = ".".join(part for part in (base, child.module) if part)
            # `from dtrain import advice` imports the module dtrain.advice.
            names = [f"{module}.{alias.name}" for alias in child.names]
        else:
            names = []
        for name in names:
            if name == "dtrain" or name.startswith("dtrain."):
                yield child.lineno, name
        yield from imported(child, package)


@functools.cache
def arrows() -> tuple[tuple[str, str, str], ...]:
    """(importing unit, imported unit, "file:line imports module") across units."""
    found = []
    for rel, source in sorted(units().items()):
        tree = ast.parse((SOURCE / rel).read_text(), filename=rel)
        package = ".".join(["dtrain", *rel.split("/")[:-1]])
        for line, module in imported(tree, package):
            target = unit_of(module)
            if target != source:
                found.append((source, target, f"{rel}:{line} imports {module}"))
    return tuple(found)


def layer_of() -> dict[str, int]:
    return {unit: index for index, (_, members) in enumerate(LAYERS) for unit in members}


def test_every_module_is_named_in_the_architecture_doc():
    text = DOC.read_text()
    # A whole path, so that `checkpoint/canonical.py` does not stand for `canonical.py`.
    missing = [
        rel
        for rel in sorted(units())
        if not rel.endswith("__init__.py")
        and not re.search(rf"(?<![\w/.]){re.escape(rel)}(?![\w/])", text)
    ]
    assert not missing, (
        "docs/architecture.md does not name these modules: "
        + ", ".join(missing)
        + ". Add a line for each, by its path relative to src/dtrain (e.g. "
        "`strategies/ps/client.py`), to the block of its package in the 'Modules' section "
        "(top-level modules go in the first block), saying what it holds."
    )


def test_the_core_uses_each_file_name_once():
    seen: dict[str, list[str]] = {}
    for rel in sorted(units()):
        if not rel.endswith(("__init__.py", "__main__.py")) and not rel.startswith(tuple(PRODUCTS)):
            seen.setdefault(rel.rsplit("/", 1)[-1], []).append(rel)
    repeated = {name: paths for name, paths in seen.items() if len(paths) > 1}
    assert not repeated, (
        f"Core modules share a file name: {repeated}. Rename one so that its name says "
        "which room it is (docs/architecture.md, 'The products')."
    )


def test_every_unit_has_a_layer():
    layers = layer_of()
    unplaced = sorted(set(units().values()) - set(layers))
    assert not unplaced, (
        f"{', '.join(unplaced)} belongs to no layer: add it to LAYERS in "
        "tests/test_architecture.py and to the 'Layers' table of docs/architecture.md."
    )
    stale = sorted(set(layers) - set(units().values()))
    assert not stale, f"LAYERS names units that no longer exist: {', '.join(stale)}."


def test_imports_run_down_the_layers():
    layers = layer_of()
    upward = [
        f"{where} ({source}: {LAYERS[layers[source]][0]} -> {target}: {LAYERS[layers[target]][0]})"
        for source, target, where in arrows()
        if source in layers and target in layers and layers[target] > layers[source]
    ]
    assert not upward, "Imports that go up a layer (move the code down instead):\n" + "\n".join(
        upward
    )


def test_imports_keep_the_rules():
    broken = [
        f"{where}: {source} may not import {target} ({why})"
        for importers, banned, why in RULES
        for source, target, where in arrows()
        if source in importers and target in banned
    ]
    broken += [
        f"{where}: {source} may import only the leaves ({', '.join(sorted(LEAVES))})"
        + (" and datasets/" if source == "models/" else "")
        for source, target, where in arrows()
        if source in {"models/", "datasets/"}
        and target not in LEAVES | ({"datasets/"} if source == "models/" else set())
    ]
    # The command and its parser assemble the products' flags and commands.
    core = set(units().values()) - PRODUCTS - {"cli/"}
    broken += [
        f"{where}: the core does not depend on the products (horovod/, plan/, keras/, bench/)"
        for source, target, where in arrows()
        if source in core and target in PRODUCTS
    ]
    assert not broken, "Imports that break the layering rules:\n" + "\n".join(broken)


def test_units_import_each_other_in_one_direction_only():
    graph: dict[str, set[str]] = {}
    for source, target, _ in arrows():
        graph.setdefault(source, set()).add(target)

    def reaches(start: str, goal: str) -> bool:
        seen, todo = set(), [start]
        while todo:
            unit = todo.pop()
            if unit == goal:
                return True
            if unit not in seen:
                seen.add(unit)
                todo.extend(graph.get(unit, ()))
        return False

    cycles = sorted(
        f"{source} <-> {target}"
        for source, targets in graph.items()
        for target in targets
        if source < target and reaches(target, source)
    )
    assert not cycles, "Units that import each other (directly or through others): " + ", ".join(
        cycles
    )


def test_the_launch_side_imports_only_the_strategy_specs():
    runtime = [
        f"{where}: {source} reaches a strategy only through {SPECS} (its runtime class "
        "imports DDP, FSDP, DTensor or pipelining, which the launcher never needs)"
        for source, target, where in arrows()
        if source in LAUNCH_SIDE
        and target == "strategies/"
        and not f"{where}.".split(" imports ")[1].startswith(f"{SPECS}.")
    ]
    assert not runtime, "\n".join(runtime)


def _file_of(module: str) -> Path | None:
    """The source file of dotted `module` under dtrain, if it is a module (not a name)."""
    path = SOURCE.joinpath(*module.split(".")[1:])
    for candidate in (path.with_suffix(".py"), path / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def _module_level(path: Path) -> list[str]:
    """Modules that `path` imports when it is imported (its top-level statements)."""
    found = []
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Import):
            found += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found += [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
    return found


def _module_level_reach(start: str) -> tuple[set[str], list[str]]:
    """(the dtrain modules that importing `start` runs, a package's __init__.py included;
    "FILE imports NAME" for every outside module they import at module level)."""
    seen: set[str] = set()
    todo = [start]
    outside = []
    while todo:
        parts = todo.pop().split(".")
        for module in (".".join(parts[:n]) for n in range(1, len(parts) + 1)):
            path = _file_of(module)
            if module in seen or path is None:
                continue
            seen.add(module)
            for imported_name in _module_level(path):
                if imported_name.startswith("dtrain."):
                    todo.append(imported_name)
                else:
                    outside.append(f"{path.relative_to(SOURCE)} imports {imported_name}")
    return seen, outside


def test_the_strategy_specs_import_no_torch():
    """Importing the specs runs only modules that import no torch at module level (a
    package's __init__.py included), so the launcher's checks cost no torch import."""
    seen, outside = _module_level_reach(SPECS)
    heavy = [line for line in outside if line.split(" imports ")[1].split(".")[0] == "torch"]
    assert "dtrain.parallel.degrees" in seen and "dtrain.strategies.base" not in seen
    assert not heavy, "Importing the strategy specs imports torch: " + ", ".join(heavy)


def test_the_launcher_starts_without_dtensor():
    """The launcher (and each process's bootstrap) imports none of torch's modules that
    bring DTensor: torch.distributed.checkpoint alone adds about 0.6 s to every start."""
    heavy = ("torch.distributed.checkpoint", "torch.distributed.tensor", "torch.distributed.fsdp")
    _, outside = _module_level_reach("dtrain.launcher.bootstrap")
    found = [line for line in outside if line.split(" imports ")[1].startswith(heavy)]
    assert not found, "The launcher imports DTensor: " + ", ".join(found)


# The only core modules each product reaches into: the core's public API (`dtrain`,
# `dtrain.config`, `dtrain.errors`) plus the engine rooms it is built on, each named in
# the "Products" paragraph of docs/architecture.md. A new door is a decision: add it here
# and there, or reach the core through one already open.
PUBLIC = {"dtrain", "dtrain.config", "dtrain.errors"}
PRODUCT_DOORS = {
    "horovod/": PUBLIC
    | {
        "dtrain.advice",
        "dtrain.process.topology",
        "dtrain.launcher.bootstrap",
        "dtrain.launcher.hosts",
        "dtrain.launcher.runner",
        "dtrain.observe.trace",
        "dtrain.parallel.sync_batchnorm",
        "dtrain.process.teardown",
    },
    "plan/": PUBLIC
    | {
        "dtrain.step.batches",
        "dtrain.data.sampler",
        "dtrain.models",
        "dtrain.command_names",
        "dtrain.models.recipes",
        "dtrain.parallel.blocks",
        "dtrain.parallel.pipeline",
        "dtrain.parallel.split",
        "dtrain.parallel.tensor_plan",
        "dtrain.parallel.context_parallel",
        "dtrain.parallel.expert_parallel",
        "dtrain.demo.flags",
        SPECS,
    },
    "keras/": PUBLIC | {"dtrain.step.batches", "dtrain.engine", "dtrain.parallel.data_parallel"},
    "bench/": PUBLIC
    | {
        "dtrain.step.batches",
        "dtrain.command_names",
        "dtrain.models.recipes",
        "dtrain.launcher.hosts",
        "dtrain.launcher.topology_flags",
        "dtrain.demo.flags",
        "dtrain.observe.metrics",
        "dtrain.observe.progress",
        SPECS,
    },
}


def _module_named(name: str) -> str:
    """The module an import names: `name` itself, or the module a name is taken from
    (``dtrain.config.Config`` -> ``dtrain.config``)."""
    return name if name == "dtrain" or _file_of(name) else name.rsplit(".", 1)[0]


def test_the_products_enter_the_core_through_their_doors_only():
    assert set(PRODUCT_DOORS) == PRODUCTS
    text = DOC.read_text()
    undocumented = sorted(
        {door for doors in PRODUCT_DOORS.values() for door in doors if f"`{door}`" not in text}
    )
    assert not undocumented, f"docs/architecture.md does not name the doors {undocumented}"
    strays = [
        f"{where}: {source} reaches the core only through {', '.join(sorted(doors))}"
        for product, doors in PRODUCT_DOORS.items()
        for source, target, where in arrows()
        if source == product
        and target not in PRODUCTS
        and _module_named(where.rsplit(" imports ", 1)[1]) not in doors
    ]
    assert not strays, "Products that reach into the core elsewhere:\n" + "\n".join(strays)


def test_every_package_says_what_it_holds_and_what_it_may_import():
    silent = []
    for init in sorted(SOURCE.glob("*/__init__.py")):
        doc = ast.get_docstring(ast.parse(init.read_text())) or ""
        if "import" not in doc:
            silent.append(init.parent.name)
    assert not silent, (
        f"These packages' __init__ docstrings do not say what they may import: {silent}; add a "
        "paragraph naming the packages each may import (docs/architecture.md, 'Layers')."
    )
