"""The package's imports point one way: read with ``ast`` from the source, so nothing is imported to check.

No module of the package outside ``stepops.testing`` imports ``stepops.testing`` (test support builds on the
ops and models, not the reverse) or an op's naive ``reference`` (test support too: it may need numpy); that
includes the demo and the CLI. The module-level imports form no circle, and no module of stepops, benchmarks or tests imports another's private
name.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "stepops"


def _name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _imports(name: str, *, module_level: bool) -> set[str]:
    """The stepops modules ``name`` imports (anywhere in it, or only at module level), each ``from a import b``
    counted as ``a`` and, where ``a.b`` is a module, ``a.b``."""
    path = MODULES[name]
    tree = ast.parse(path.read_text(), str(path))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    nodes = ast.walk(tree)
    if module_level:  # top-level statements, and the bodies of top-level if/try blocks
        nodes = [n for s in tree.body for n in ([s] if not isinstance(s, (ast.If, ast.Try)) else ast.walk(s))]
    found = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            found.add(base)
            found.update(f"{base}.{a.name}" for a in node.names)
    return {m for m in found if m in MODULES and m != name}


def _is_test_support(module: str) -> bool:
    return module == "stepops.testing" or module.startswith("stepops.testing.") or module.endswith(".reference")


@pytest.mark.parametrize("name", sorted(n for n in MODULES if not _is_test_support(n)))
def test_no_library_module_imports_test_support(name):
    assert not {m for m in _imports(name, module_level=False) if _is_test_support(m)}, name


@pytest.mark.parametrize(
    "path", sorted(p for folder in ("stepops", "benchmarks", "tests") for p in (ROOT / folder).rglob("*.py")), ids=str
)
def test_no_private_name_is_imported_from_another_module(path):
    tree = ast.parse(path.read_text(), str(path))
    private = [
        f"{node.module}.{alias.name}"
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom)
        for alias in node.names
        if alias.name.startswith("_") and alias.name != "__future__" and node.module != "__future__"
    ]
    assert not private, f"{path.relative_to(ROOT)} imports {private}"


def test_the_step5_recompute_imports_only_the_config_of_the_model():
    """The independent Step5 recompute (the Step5 oracle) reads the config's numbers and shares no code that
    computes a layer, directly or through the test support it imports."""
    seen, todo = set(), ["stepops.testing.step5_reference"]
    while todo:
        name = todo.pop()
        seen.add(name)
        todo += [m for m in _imports(name, module_level=False) if _is_test_support(m) and m not in seen]
    models = {m for name in seen for m in _imports(name, module_level=False) if m.startswith("stepops.models")}
    assert models == {"stepops.models.step5_config"}, models


def test_module_level_imports_form_no_circle():
    graph = {name: _imports(name, module_level=True) for name in MODULES}
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for dep in sorted(graph[node]):
            if state.get(dep) == 1:
                cycle = path[path.index(dep) :] + [dep]
                pytest.fail("import circle: " + " -> ".join(cycle))
            if dep not in state:
                visit(dep, path + [dep])
        state[node] = 2

    for name in sorted(graph):
        if name not in state:
            visit(name, [name])
