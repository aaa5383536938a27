"""The shape of the house: imports point one way with no circles, modules and functions stay
short, and the decode loop never asks which cache or drafter it holds.

Pure AST and text: nothing of the project is imported, so these run in a fraction of a second.
Each checker takes a root folder, and the tests at the bottom run it on a tiny planted package
to show it can fail.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("app", "core", "models")
MAX_MODULE_LINES = 400
MAX_FUNCTION_LINES = 80
# `core` is the engine: it knows neither the UI, nor the app, nor where weights come from
CORE_MUST_NOT_IMPORT = ("app", "models", "gradio")
# the backend interface and the drafter contract make these needless (issue 31)
# (the grep of issue 31: `grep -rn "isinstance(.*StaticKV\|getattr(drafter" core app`)
FORBIDDEN_TEXT = (r"isinstance\(.*StaticKV", r"getattr\(drafter")


def project_modules(root: Path, packages: tuple[str, ...] = PACKAGES) -> dict[str, Path]:
    """Dotted module name → file, for every Python file of the packages (a package is its `__init__`)."""
    modules = {}
    for package in packages:
        for file in sorted((root / package).rglob("*.py")):
            if "__pycache__" in file.parts:
                continue
            parts = file.relative_to(root).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            modules[".".join(parts)] = file
    return modules


def _resolve(name: str, modules: dict[str, Path]) -> str | None:
    """The longest prefix of `name` that is a project module (`core.x.y` → `core.x` when y is a name)."""
    parts = name.split(".")
    for end in range(len(parts), 0, -1):
        candidate = ".".join(parts[:end])
        if candidate in modules:
            return candidate
    return None


def _imports(module: str, file: Path) -> list[tuple[str, list[str]]]:
    """(imported module, names taken from it) for every import anywhere in the module (nested and
    function-level ones too), relative imports made absolute; `import a.b` gives ("a.b", [])."""
    is_package = file.name == "__init__.py"
    found = []
    for node in ast.walk(ast.parse(file.read_text(encoding="utf-8"), filename=str(file))):
        if isinstance(node, ast.Import):
            found += [(alias.name, []) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                # a module's level 1 is its package; a package's level 1 is itself
                package = module.split(".") if is_package else module.split(".")[:-1]
                anchor = package[: len(package) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            found.append((base, [alias.name for alias in node.names if alias.name != "*"]))
    return found


def import_graph(root: Path, packages: tuple[str, ...] = PACKAGES) -> dict[str, set[str]]:
    """Module → the project modules it imports; `from pkg import name` points at `pkg.name` when
    that is a module, else at `pkg` (or the longest prefix of it that is a project module)."""
    modules = project_modules(root, packages)
    graph = {}
    for module, file in modules.items():
        targets = set()
        for base, taken in _imports(module, file):
            submodules = [f"{base}.{name}" for name in taken if f"{base}.{name}" in modules]
            targets |= set(submodules)
            if not taken or len(submodules) < len(taken):  # `import base`, or a name defined in base
                targets.add(_resolve(base, modules))
        graph[module] = targets - {None, module}
    return graph


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One named cycle per group of modules that import each other, e.g. [a, b, c, a]."""
    return [_a_cycle_in(group, graph) for group in cycle_groups(graph)]


def cycle_groups(graph: dict[str, set[str]]) -> list[set[str]]:
    """The strongly connected groups of two or more modules (Tarjan): each holds at least one cycle."""
    index, low, stack, on_stack, groups = {}, {}, [], set(), []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            group = set()
            while True:
                member = stack.pop()
                on_stack.discard(member)
                group.add(member)
                if member == node:
                    break
            if len(group) > 1:
                groups.append(group)

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return groups


def _a_cycle_in(group: set[str], graph: dict[str, set[str]]) -> list[str]:
    """A shortest path from the group's first module back to itself, inside the group."""
    start = min(group)
    paths = {start: [start]}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for nxt in sorted(graph[node] & group):
                if nxt == start:
                    return paths[node] + [start]
                if nxt not in paths:
                    paths[nxt] = paths[node] + [nxt]
                    following.append(nxt)
        frontier = following
    raise AssertionError(f"no cycle found in the group {sorted(group)}")


def forbidden_core_imports(root: Path, packages: tuple[str, ...] = PACKAGES) -> list[str]:
    """'core.x imports models.y' for every import of app, models or gradio from a core module."""
    modules = project_modules(root, packages)
    found = []
    for module, file in modules.items():
        if module.split(".")[0] != "core":
            continue
        # `from .. import app` at the top of the tree has no base: the names are the modules
        named = {name for base, taken in _imports(module, file) for name in ([base] if base else taken)}
        found += [f"{module} imports {name}" for name in sorted(named) if name.split(".")[0] in CORE_MUST_NOT_IMPORT]
    return found


def long_modules(root: Path, packages: tuple[str, ...] = PACKAGES) -> list[str]:
    """'path: N lines' for every Python module over the limit (C kernels are not Python: not counted)."""
    found = []
    for file in project_modules(root, packages).values():
        lines = len(file.read_text(encoding="utf-8").splitlines())
        if lines > MAX_MODULE_LINES:
            found.append(f"{file.relative_to(root)}: {lines} lines")
    return found


def long_functions(root: Path, packages: tuple[str, ...] = PACKAGES) -> list[str]:
    """'path:line qualified.name: N lines' for every function, method or nested function over the limit."""
    found = []
    for file in project_modules(root, packages).values():
        tree = ast.parse(file.read_text(encoding="utf-8"), filename=str(file))
        for qualname, node in _functions(tree, ""):
            lines = node.end_lineno - node.lineno + 1
            if lines > MAX_FUNCTION_LINES:
                found.append(f"{file.relative_to(root)}:{node.lineno} {qualname}: {lines} lines")
    return found


def _functions(node: ast.AST, prefix: str) -> Iterator[tuple[str, ast.FunctionDef | ast.AsyncFunctionDef]]:
    """(qualified name, node) of every function below `node`, nested ones included."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield prefix + child.name, child
            yield from _functions(child, f"{prefix}{child.name}.")
        elif isinstance(child, ast.ClassDef):
            yield from _functions(child, f"{prefix}{child.name}.")
        else:
            yield from _functions(child, prefix)


def forbidden_text(root: Path, folders: tuple[str, ...] = ("core", "app")) -> list[str]:
    """'path:line: text' for every line of a file under the folders that matches a forbidden pattern."""
    found = []
    for folder in folders:
        for file in sorted((root / folder).rglob("*")):
            if not file.is_file() or "__pycache__" in file.parts:
                continue
            text = file.read_text(encoding="utf-8", errors="ignore")
            for number, line in enumerate(text.splitlines(), 1):
                if any(re.search(pattern, line) for pattern in FORBIDDEN_TEXT):
                    found.append(f"{file.relative_to(root)}:{number}: {line.strip()}")
    return found


# --- the project itself ---


def test_no_import_cycles():
    graph = import_graph(ROOT)
    lines = [
        " → ".join(_a_cycle_in(group, graph)) + f"  (the circle holds {', '.join(sorted(group))})"
        for group in cycle_groups(graph)
    ]
    assert not lines, "import cycles:\n" + "\n".join(lines)


def test_core_imports_neither_app_nor_models_nor_gradio():
    found = forbidden_core_imports(ROOT)
    assert not found, "core must not import app, models or gradio:\n" + "\n".join(found)


def test_no_module_over_400_lines():
    found = long_modules(ROOT)
    assert not found, f"modules over {MAX_MODULE_LINES} lines:\n" + "\n".join(found)


def test_no_function_over_80_lines():
    found = long_functions(ROOT)
    assert not found, f"functions over {MAX_FUNCTION_LINES} lines:\n" + "\n".join(found)


def test_no_cache_type_checks_nor_optional_drafter_methods():
    found = forbidden_text(ROOT)
    assert not found, "found (issue 31 forbids them):\n" + "\n".join(found)


def test_the_walk_sees_the_project():
    graph = import_graph(ROOT)
    assert {"app.main", "core.decode.generate", "models.loader"} <= set(graph)
    assert "core.decode.step" in graph["core.decode.generate"]  # an import the loop surely makes


# --- the checkers can fail: a tiny planted package ---


def _plant(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
    return root


def test_a_cycle_through_a_nested_import_is_named(tmp_path):
    root = _plant(
        tmp_path,
        {
            "core/__init__.py": "",
            "core/sub/__init__.py": "",
            "core/sub/a.py": "import core.sub.b\n",
            "core/sub/b.py": "def f():\n    from core.sub import c\n",  # `c` is a module: the edge goes to it
            "core/sub/c.py": "from . import a\n",  # relative
            "core/sub/d.py": "from core.sub import a\n",  # into the cycle, not part of it
            "core/e.py": "from .sub.a import thing\n",
            "app/__init__.py": "",
            "models/__init__.py": "",
        },
    )
    assert import_cycles(import_graph(root)) == [["core.sub.a", "core.sub.b", "core.sub.c", "core.sub.a"]]
    assert "core.sub.a" in import_graph(root)["core.e"]


def test_no_cycle_when_imports_point_one_way(tmp_path):
    root = _plant(
        tmp_path,
        {
            "core/__init__.py": "",
            "core/a.py": "from core import b\n",
            "core/b.py": "import os\n",
            "app/__init__.py": "from core import a\n",
            "models/__init__.py": "",
        },
    )
    assert import_cycles(import_graph(root)) == []
    assert import_graph(root)["core.a"] == {"core.b"}


def test_a_package_importing_a_name_from_itself_is_no_cycle(tmp_path):
    # `from core.pkg import name` where name is defined in the package: the edge is to `core.pkg`
    root = _plant(
        tmp_path,
        {
            "core/__init__.py": "",
            "core/pkg/__init__.py": "X = 1\n",
            "core/pkg/m.py": "from core.pkg import X\n",
            "app/__init__.py": "",
            "models/__init__.py": "",
        },
    )
    assert import_graph(root)["core.pkg.m"] == {"core.pkg"}
    assert import_cycles(import_graph(root)) == []


def test_core_importing_app_models_or_gradio_is_found(tmp_path):
    root = _plant(
        tmp_path,
        {
            "core/__init__.py": "",
            "core/a.py": "def f():\n    import gradio as gr\n",
            "core/b.py": "from models.loader import load\n",
            "core/c.py": "from .. import app\n",
            "core/d.py": "import core.a\n",
            "app/__init__.py": "import models\n",  # app may import models
            "models/__init__.py": "",
        },
    )
    found = forbidden_core_imports(root)
    assert found == ["core.a imports gradio", "core.b imports models.loader", "core.c imports app"]


def test_long_modules_and_functions_are_listed_with_their_size(tmp_path):
    body = "\n".join(f"        x{i} = {i}" for i in range(MAX_FUNCTION_LINES))  # def line + 80 = 81 lines
    nested = "def outer():\n    def inner():\n" + "\n".join(f"        y{i} = {i}" for i in range(90))
    root = _plant(
        tmp_path,
        {
            "core/__init__.py": "",
            "core/long.py": "\n".join(f"x{i} = {i}" for i in range(MAX_MODULE_LINES + 1)) + "\n",
            "core/ok.py": "\n".join(f"x{i} = {i}" for i in range(MAX_MODULE_LINES)) + "\n",
            "app/__init__.py": f"class K:\n    def method(self):\n{body}\n",
            "models/__init__.py": nested + "\n",
            "models/short.py": "def f():\n" + "\n".join(f"    x{i} = {i}" for i in range(79)) + "\n",
        },
    )
    assert long_modules(root) == ["core/long.py: 401 lines"]
    assert sorted(long_functions(root)) == [
        "app/__init__.py:2 K.method: 81 lines",
        "models/__init__.py:1 outer: 92 lines",
        "models/__init__.py:2 outer.inner: 91 lines",
    ]


def test_forbidden_text_is_found(tmp_path):
    root = _plant(
        tmp_path,
        {
            "core/step.py": "if isinstance(cache, lean.StaticKV):\n    pass\n",
            "app/engine.py": "ok = 1\nfeed = getattr(drafter, 'feed', None)\n",
            "models/x.py": "getattr(drafter, 'x')\n",  # models is not searched
        },
    )
    assert forbidden_text(root) == [
        "core/step.py:1: if isinstance(cache, lean.StaticKV):",
        "app/engine.py:2: feed = getattr(drafter, 'feed', None)",
    ]
