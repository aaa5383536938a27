"""Every third-party import of the app is a declared dependency with a lower bound."""

from __future__ import annotations

import ast
import re
import sys
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FIRST_PARTY = {"app", "core", "models", "assets"}


def imported_modules() -> set[str]:
    """Top-level names of every absolute import in app/, core/ and models/ (nested ones too)."""
    names = set()
    for package in ("app", "core", "models"):
        for file in (ROOT / package).rglob("*.py"):
            for node in ast.walk(ast.parse(file.read_text(encoding="utf-8"))):
                if isinstance(node, ast.Import):
                    names |= {a.name.split(".")[0] for a in node.names}
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    names.add(node.module.split(".")[0])
    return names - FIRST_PARTY - set(sys.stdlib_module_names) - {"__future__"}


def declared() -> dict[str, str]:
    """Normalised distribution name → its version specifier, from the installed metadata."""
    out = {}
    for req in metadata.requires("medusa-chat") or []:  # optional extras count: their imports are guarded
        name, spec = re.match(r"([A-Za-z0-9._-]+)\s*(.*)", req.split(";")[0]).groups()  # drop the marker
        out[_norm(name)] = spec
    return out


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def test_every_import_is_declared():
    owners = metadata.packages_distributions()
    deps = declared()
    missing = {m: owners.get(m) for m in imported_modules() if not _declares(deps, owners.get(m, []), m)}
    assert not missing, f"imported but not declared in pyproject: {missing}"


def _declares(deps: dict[str, str], owners: list[str], module: str) -> bool:
    """The module's distribution is declared; an optional one that is not installed here is
    matched by name (llama_cpp → llama-cpp-python)."""
    if owners:
        return bool({_norm(d) for d in owners} & set(deps))
    return any(name.startswith(_norm(module)) for name in deps)


def test_every_dependency_has_a_lower_bound():
    unbounded = [name for name, spec in declared().items() if ">=" not in spec]
    assert not unbounded, unbounded


def test_the_checker_sees_nested_imports():
    # `tqdm` is imported inside functions only: the walk must still find it
    assert {"torch", "transformers", "gradio", "tqdm", "markdown_it", "numpy"} <= imported_modules()
