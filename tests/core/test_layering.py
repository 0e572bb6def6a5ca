"""The core's imports keep its layers (docs/architecture.md): no import circle among tensorfold's modules, no module
importing a layer above its own, and no tier importing another (the chain wires them)."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from graphlib import CycleError, TopologicalSorter
from pathlib import Path

import attrs

import tensorfold

ROOT = Path(tensorfold.__file__).parent

# Lowest first. A module is in the layer of the longest name listed that is it or a package above it; it may import
# its own layer and the layers below, never one above.
LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("contracts", ("tensorfold", "tensorfold.settings", "tensorfold.refusals", "tensorfold.layout", "tensorfold.plan",
                   "tensorfold.cuts", "tensorfold.checkpoint", "tensorfold.tokenizer", "tensorfold.memory_plan",
                   "tensorfold.heap_trim", "tensorfold.kernels", "tensorfold.shard", "tensorfold.ports")),
    ("states", ("tensorfold.kv", "tensorfold.pool", "tensorfold.image", "tensorfold.image_rows")),
    ("family", ("tensorfold.family", "tensorfold.hookspecs", "tensorfold.plugins", "tensorfold.embedded")),
    ("memory", ("tensorfold.memory",)),
    ("rows", ("tensorfold.rows",)),
    ("tiers", ("tensorfold.tiers",)),
    ("follow", ("tensorfold.follow",)),
    ("engine", ("tensorfold.engine", "tensorfold.service")),
    ("server", ("tensorfold.server",)),
    ("startup", ("tensorfold.boot", "tensorfold.startup_checks", "tensorfold.launch", "tensorfold.explain",
                 "tensorfold.learned",
                 "tensorfold.learned_cli")),
    ("cli", ("tensorfold.cli", "tensorfold.__main__")),
    ("testing", ("tensorfold.testing",)),
)
TIERS = frozenset({"tensorfold.tiers.device", "tensorfold.tiers.host", "tensorfold.tiers.disk"})
WIRING = frozenset({"tensorfold.tiers", "tensorfold.tiers.chain"})   # the tiers package's modules that may import them


@attrs.frozen
class Import:
    """One import of a tensorfold module: who imports what, and whether it runs when the importer is loaded."""

    source: str
    target: str
    line: int
    module_level: bool


def modules() -> dict[str, Path]:
    """Every module of the tensorfold package by dotted name (a package by its own name)."""
    found = {}
    for path in sorted(ROOT.rglob("*.py")):
        parts = path.relative_to(ROOT.parent).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


MODULES = modules()


def _resolve(name: str) -> str | None:
    """The module a dotted name imports: itself, else the nearest package above it (a name taken from it)."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def _targets(node: ast.Import | ast.ImportFrom, source: str) -> Iterator[str]:
    if isinstance(node, ast.Import):
        yield from (alias.name for alias in node.names)
        return
    base = node.module or ""
    if node.level:
        package = source if MODULES[source].name == "__init__.py" else source.rpartition(".")[0]
        for _ in range(node.level - 1):
            package = package.rpartition(".")[0]
        base = f"{package}.{base}" if base else package
    yield from (f"{base}.{alias.name}" for alias in node.names)


def _walk(node: ast.AST, module_level: bool) -> Iterator[tuple[ast.Import | ast.ImportFrom, bool]]:
    """Every import under `node`, and whether it runs at import time (not inside a function)."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.Import | ast.ImportFrom):
            yield child, module_level
        inside = module_level and not isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda)
        yield from _walk(child, inside)


def imports() -> list[Import]:
    """Every import of one tensorfold module by another, the ones inside functions and TYPE_CHECKING too."""
    out: dict[Import, None] = {}
    for source, path in MODULES.items():
        for node, module_level in _walk(ast.parse(path.read_text(), str(path)), True):
            for name in _targets(node, source):
                target = _resolve(name) if name.split(".")[0] == "tensorfold" else None
                if target is not None and target != source:
                    out[Import(source, target, node.lineno, module_level)] = None
    return list(out)


IMPORTS = imports()


def layer_of(module: str) -> int | None:
    """The index in LAYERS of the longest name listed that is `module` or a package above it."""
    best: tuple[int, int] | None = None
    for index, (_, names) in enumerate(LAYERS):
        for name in names:
            if (module == name or module.startswith(name + ".")) and (best is None or len(name) > best[0]):
                best = (len(name), index)
    return None if best is None else best[1]


def test_every_module_has_a_layer():
    missing = sorted(m for m in MODULES if layer_of(m) is None)
    assert not missing, f"name the layer of {missing} in LAYERS (and in docs/architecture.md)"


def circle(found: list[Import]) -> list[str]:
    """One import circle among the module-level imports in `found`, as the modules round it; empty when none."""
    graph: dict[str, set[str]] = {}
    for imp in found:
        if imp.module_level:
            graph.setdefault(imp.source, set()).add(imp.target)
    try:
        tuple(TopologicalSorter(graph).static_order())
    except CycleError as err:
        return list(err.args[1])
    return []


def upward(found: list[Import]) -> list[str]:
    """Each import in `found` of a layer above the importer's, in words."""
    out = []
    for imp in found:
        source, target = layer_of(imp.source), layer_of(imp.target)
        if source is not None and target is not None and target > source:
            out.append(f"{imp.source} (layer {LAYERS[source][0]}) imports {imp.target} (layer {LAYERS[target][0]}) "
                       f"at line {imp.line}")
    return out


def test_no_import_circle_among_module_level_imports():
    found = circle(IMPORTS)
    assert not found, "an import circle: " + " -> ".join(found)


def test_no_module_imports_a_layer_above_its_own():
    found = upward(IMPORTS)
    assert not found, "\n".join(found)


def test_no_tier_imports_another():
    crossing = [f"{imp.source} imports {imp.target} at line {imp.line}" for imp in IMPORTS
                if imp.target in TIERS and imp.source.startswith("tensorfold.tiers.") and imp.source not in WIRING]
    assert not crossing, "only tiers/chain.py wires the tiers:\n" + "\n".join(crossing)


def test_tiers_import_nothing_from_the_engine():
    found = [imp for imp in IMPORTS if imp.source.startswith("tensorfold.tiers.")
             and imp.target.startswith("tensorfold.engine")]
    assert not found, found


def test_the_checks_catch_what_they_guard_against():
    """The checks see imports inside TYPE_CHECKING and functions, and flag a circle and an upward import."""
    assert any(imp.source == "tensorfold.engine.runner" and imp.target == "tensorfold.tiers.device"
               and imp.module_level for imp in IMPORTS)                       # under TYPE_CHECKING
    assert any(imp.source == "tensorfold.cli" and imp.target == "tensorfold.boot" and not imp.module_level
               for imp in IMPORTS)                                            # inside a function
    back = [Import("tensorfold.tiers.device", "tensorfold.tiers.host", 1, True),
            Import("tensorfold.tiers.host", "tensorfold.tiers.device", 1, True)]
    assert sorted(set(circle(back))) == ["tensorfold.tiers.device", "tensorfold.tiers.host"]
    assert circle([Import(i.source, i.target, 1, False) for i in back]) == []  # a function's import runs later
    assert upward([Import("tensorfold.tiers.device", "tensorfold.engine.memory", 1, False)])
    assert not upward([Import("tensorfold.tiers.device", "tensorfold.memory", 1, True)])
