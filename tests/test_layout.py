"""The package layout is the data path: a stage imports only stages below it, and no module imports
itself back through others. `docs/architecture.md` lists the same order."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SOURCES = {"quantize_moe": ROOT / "quantize_moe", "quantize_moe.kernels": ROOT / "kernels"}

# Lowest first. A module may import its own package and every package of a lower rank.
RANKS = [
    {"quantize_moe", "quantize_moe.errors", "quantize_moe.console"},
    {"quantize_moe.quantization"},
    {"quantize_moe.moe", "quantize_moe.kernels", "quantize_moe.configs"},
    {"quantize_moe.source"},
    {"quantize_moe.adapters"},
    {"quantize_moe.plan"},
    {"quantize_moe.write"},
    {"quantize_moe.run"},
    {"quantize_moe.check"},
    {"quantize_moe.publish"},
    {"quantize_moe.cli", "quantize_moe.__main__"},
]
MAX_LINES = 420  # "about 400": a module past it holds more than one concern


def _modules() -> dict[str, Path]:
    modules = {}
    for package, folder in SOURCES.items():
        for path in folder.rglob("*.py"):
            parts = path.relative_to(folder).with_suffix("").parts
            if package == "quantize_moe" and parts[0] == "kernels":
                continue
            name = ".".join((package, *parts)).removesuffix(".__init__")
            modules[name] = path
    return modules


MODULES = _modules()


def _imports(name: str, text: str, is_package: bool = False) -> set[str]:
    """Our modules that `name` imports anywhere in its body (lazy imports count: they are edges too)."""
    found = set()
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = name.split(".")[: len(name.split(".")) - node.level + (1 if is_package else 0)]
                base = ".".join([*anchor, base] if base else anchor)
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)
    return {module for module in found if module in MODULES and module != name}


GRAPH = {name: _imports(name, path.read_text(), path.name == "__init__.py") for name, path in MODULES.items()}


def _rank(module: str) -> int:
    for rank, packages in enumerate(RANKS):
        for package in packages:
            if module == package or (package != "quantize_moe" and module.startswith(package + ".")):
                return rank
    raise AssertionError(f"{module} belongs to no stage of RANKS: add its package there and to docs/architecture.md")


def test_every_module_has_a_stage():
    for module in MODULES:
        _rank(module)


@pytest.mark.parametrize("module", sorted(MODULES))
def test_no_module_imports_a_higher_stage(module):
    higher = sorted(imported for imported in GRAPH[module] if _rank(imported) > _rank(module))
    assert not higher, f"{module} (stage {_rank(module)}) imports higher stages: {higher}"


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of `graph` (depth-first search), or None."""
    state: dict[str, str] = {}

    def visit(module: str, path: list[str]) -> list[str] | None:
        state[module] = "open"
        for imported in sorted(graph[module]):
            if state.get(imported) == "open":
                return path[path.index(imported):] + [imported]
            if imported not in state and (found := visit(imported, [*path, imported])):
                return found
        state[module] = "done"
        return None

    return next((found for module in sorted(graph) if module not in state
                 for found in [visit(module, [module])] if found), None)


def test_no_import_cycles():
    assert _cycle(GRAPH) is None, "import cycle: " + " -> ".join(_cycle(GRAPH))


def test_the_guards_can_fail():
    lazy = "def f():\n    from quantize_moe.plan.plan import make_plan\n"
    edges = _imports("quantize_moe.source.checkpoint", lazy)
    assert edges == {"quantize_moe.plan.plan"} and _rank("quantize_moe.plan.plan") > _rank("quantize_moe.source.checkpoint")
    relative = _imports("quantize_moe.write.job", "from .pipeline import run\nfrom ..plan import plan\n")
    assert relative == {"quantize_moe.write.pipeline", "quantize_moe.plan", "quantize_moe.plan.plan"}
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]


@pytest.mark.parametrize("module", sorted(MODULES))
def test_modules_are_short_and_say_their_concern(module):
    path = MODULES[module]
    text = path.read_text()
    lines = text.count("\n")
    assert lines <= MAX_LINES, f"{path.relative_to(ROOT)} has {lines} lines; split it by concern"
    docstring = ast.get_docstring(ast.parse(text))
    assert docstring and docstring.strip(), f"{path.relative_to(ROOT)} has no docstring saying its concern"


def test_architecture_map_lists_every_package_in_stage_order():
    text = (ROOT / "docs" / "architecture.md").read_text()
    packages = [p for rank in RANKS for p in sorted(rank) if p.count(".") == 1 and p != "quantize_moe.__main__"]
    positions = []
    for package in packages:
        folder = "kernels/" if package == "quantize_moe.kernels" else (
            "configs/" if package == "quantize_moe.configs" else package.replace(".", "/") + "/")
        if package in ("quantize_moe.errors", "quantize_moe.console"):
            folder = package.replace(".", "/") + ".py"
        row = f"| `{folder}"
        assert row in text, f"docs/architecture.md has no table row for {folder}"
        positions.append(text.index(row))
    ranks = [_rank(p) for p in packages]
    assert [r for _, r in sorted(zip(positions, ranks))] == sorted(ranks), \
        "docs/architecture.md lists the packages out of stage order"
