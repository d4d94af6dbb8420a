"""The package layout: imports run one way (core <- kernels <- models <- eval / proxy / cli
<- benchmarks), no module imports a project module inside a function, no cycles."""

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
# package -> the project packages it may import (besides itself)
ALLOWED = {
    "oscar_jax": set(),
    "pallas_kernels": {"oscar_jax"},
    "models": {"oscar_jax", "pallas_kernels"},
    "oscar_eval": {"oscar_jax", "pallas_kernels", "models"},
    "oscar_proxy": {"oscar_jax", "pallas_kernels", "models", "oscar_eval"},
    "oscar_cli": {"oscar_jax", "pallas_kernels", "models", "oscar_eval", "oscar_proxy"},
    "benchmarks": {"oscar_jax", "pallas_kernels", "models", "oscar_eval", "oscar_proxy",
                   "oscar_cli"},
}  # fmt: skip
PACKAGES = tuple(ALLOWED)


def _modules():
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            rel = path.relative_to(ROOT).with_suffix("")
            parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
            yield ".".join(parts), path


def _imports(tree: ast.AST, name: str):
    """(imported module, line, inside a function) for each project import."""
    out = []

    def visit(node, in_fn):
        for child in ast.iter_child_nodes(node):
            fn = in_fn or isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda)
            if isinstance(child, ast.Import):
                out.extend((a.name, child.lineno, in_fn) for a in child.names)
            elif isinstance(child, ast.ImportFrom) and child.level == 0 and child.module:
                for a in child.names:
                    out.append((f"{child.module}.{a.name}", child.lineno, in_fn))
            visit(child, fn)

    visit(tree, False)
    return [(m, ln, f) for m, ln, f in out if m.split(".")[0] in PACKAGES]


MODULES = dict(_modules())
GRAPH = {}
for _name, _path in MODULES.items():
    _edges = set()
    for _mod, _, _ in _imports(ast.parse(_path.read_text()), _name):
        while _mod and _mod not in MODULES:  # "pkg.mod.attr" -> "pkg.mod"
            _mod = _mod.rpartition(".")[0]
        if _mod and _mod != _name:
            _edges.add(_mod)
    GRAPH[_name] = _edges


@pytest.mark.parametrize("name", sorted(MODULES))
def test_imports_point_one_way_and_sit_at_module_level(name):
    pkg = name.split(".")[0]
    tree = ast.parse(MODULES[name].read_text())
    for mod, line, in_fn in _imports(tree, name):
        target = mod.split(".")[0]
        assert target == pkg or target in ALLOWED[pkg], f"{name}:{line} imports {mod}"
        assert not in_fn, f"{name}:{line} imports {mod} inside a function"


def test_no_import_cycles():
    state, stack = {}, []

    def dfs(n):
        state[n] = 1
        stack.append(n)
        for m in sorted(GRAPH[n]):
            if state.get(m) == 1:
                raise AssertionError("import cycle: " + " -> ".join(stack[stack.index(m) :] + [m]))
            if m not in state:
                dfs(m)
        stack.pop()
        state[n] = 2

    for n in sorted(GRAPH):
        if n not in state:
            dfs(n)


def test_the_checker_sees_a_function_level_import():
    src = "def f():\n    from models import layers\n"
    assert _imports(ast.parse(src), "x") == [("models.layers", 2, True)]
