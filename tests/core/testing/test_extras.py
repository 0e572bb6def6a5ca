"""The `tensorfold[testing]` extra: it names every package tensorfold.testing imports beyond the core (never torch),
and a missing one fails naming the extra; checked in real processes where the package cannot be imported."""

from __future__ import annotations

import ast
import importlib.metadata
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

import tensorfold.testing
from tensorfold.testing.extras import EXTRA, need

TESTING = Path(tensorfold.testing.__file__).parent
PYPROJECT = TESTING.parents[1] / "pyproject.toml"


def requirement_names(requirements: list[str]) -> set[str]:
    return {re.split(r"[\s<>=!~;\[]", r, maxsplit=1)[0].lower().replace("_", "-") for r in requirements}


def optional_imports(tree: ast.AST) -> set[int]:
    """The import statements inside a `try` that catches ImportError: what a module does without them is its own."""
    guarded = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Try) and any(isinstance(h.type, ast.Name) and h.type.id == "ImportError"
                                             for h in node.handlers):
            guarded |= {id(inner) for statement in node.body for inner in ast.walk(statement)}
    return guarded


def imported_top_levels() -> set[str]:
    """Every top-level module tensorfold.testing imports, at module level, inside functions or through `need`
    (an import guarded by `except ImportError` is optional and not counted)."""
    found = set()
    for path in TESTING.glob("*.py"):
        tree = ast.parse(path.read_text())
        optional = optional_imports(tree)
        for node in ast.walk(tree):
            if id(node) in optional:
                continue
            if isinstance(node, ast.Import):
                found |= {alias.name.split(".")[0] for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                found.add(node.module.split(".")[0])
            elif isinstance(node, ast.Call) and getattr(node.func, "id", None) == "need":
                found.add(node.args[0].value)
    return found - set(sys.stdlib_module_names) - {"tensorfold"}


def test_the_extra_names_what_the_testing_modules_import_beyond_the_core():
    project = tomllib.loads(PYPROJECT.read_text())["project"]
    core = requirement_names(project["dependencies"])
    extra = requirement_names(project["optional-dependencies"]["testing"])
    assert extra == {"pytest", "httpx", "openai"}
    assert not extra & {"torch", "triton", "nvidia-cublas-cu12"} and "torch" in core   # the core's torch range stands
    distributions = importlib.metadata.packages_distributions()
    needed = {dist.lower().replace("_", "-") for module in imported_top_levels() for dist in distributions[module]}
    assert needed - core == extra, sorted(needed - core)


@pytest.mark.parametrize("module, missing, call", [
    ("tensorfold.testing.served", "httpx", ""),
    ("tensorfold.testing.served", "openai", "tensorfold.testing.served.openai_client('http://127.0.0.1:9')"),
    ("tensorfold.testing.fuzz_http", "httpx", ""),
    ("tensorfold.testing.fixtures", "pytest", ""),
])
def test_a_missing_package_names_the_extra(module, missing, call, tmp_path):
    """`sys.modules[name] = None` is how Python itself marks a module as not importable: the process has no httpx."""
    code = f"import sys; sys.modules[{missing!r}] = None; import {module}; {call or 'pass'}"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          cwd=tmp_path)
    assert done.returncode == 1
    assert done.stderr.strip().splitlines()[-1] == (
        f"ImportError: {module} needs {missing}, which tensorfold does not install by itself: "
        f"pip install '{EXTRA}'")


def test_need_returns_the_module_when_it_is_there():
    assert need("json", "a test").loads("[1]") == [1]
    with pytest.raises(ImportError) as caught:
        need("tensorfold_no_such_module", "tensorfold.testing.x")
    assert caught.value.name == "tensorfold_no_such_module" and EXTRA in str(caught.value)
