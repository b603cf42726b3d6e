"""The public API and the wheel a user installs: the wheel, built from the package's files alone,
holds every module of the checkout, each importing on its own from the wheel, not from this checkout (a
package without its `__init__.py` would be left out, or ship only by setuptools' namespace-package
fallback); README lists every public name, and the examples import no other."""

import ast
import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

import raysb

CHECKOUT = Path(raysb.__file__).parent.parent


def _source_copy(tmp_path: Path) -> Path:
    """The package's files in a folder of their own: pip builds in the source folder, which would
    leave build/ in the checkout."""
    source = tmp_path / "source"
    shutil.copytree(CHECKOUT / "raysb", source / "raysb", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(CHECKOUT / name, source / name)
    return source


@pytest.mark.slow
def test_every_module_imports_on_its_own_from_the_built_wheel(tmp_path):
    built = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index",
         "--wheel-dir", str(tmp_path / "dist"), str(_source_copy(tmp_path))],
        capture_output=True, text=True, timeout=300,
    )
    assert built.returncode == 0, built.stdout + built.stderr
    (wheel,) = (tmp_path / "dist").glob("raysb-*.whl")
    installed = tmp_path / "installed"
    with zipfile.ZipFile(wheel) as archive:
        archive.extractall(installed)
        files = archive.namelist()

    # Every module of this checkout, no more (a module left out of the wheel would be missed below).
    in_checkout = {str(path.relative_to(CHECKOUT)) for path in (CHECKOUT / "raysb").rglob("*.py")}
    assert {name for name in files if name.startswith("raysb/") and name.endswith(".py")} == in_checkout
    packages = sorted({str(Path(name).parent) for name in files if name.startswith("raysb/") and name.endswith(".py")})
    assert [p for p in packages if f"{p}/__init__.py" not in files] == []
    # A package's __main__ runs its command when imported; the rest import as a user's code would.
    modules = sorted(
        name[: -len(".py")].replace("/", ".").removesuffix(".__init__")
        for name in files
        if name.startswith("raysb/") and name.endswith(".py") and not name.endswith("__main__.py")
    )
    assert "raysb.training.selection.rounds" in modules
    # One interpreter, raysb's modules dropped before each import: an import circle fails when
    # entered from some module, whatever order a test session happened to use.
    code = (
        "import importlib, json, sys, traceback\n"
        "failures, where = {}, {}\n"
        f"for name in {modules!r}:\n"
        "    for loaded in [m for m in sys.modules if m == 'raysb' or m.startswith('raysb.')]:\n"
        "        where[loaded] = sys.modules.pop(loaded).__file__\n"
        "    try:\n"
        "        where[name] = importlib.import_module(name).__file__\n"
        "    except Exception:\n"
        "        failures[name] = traceback.format_exc(limit=3)\n"
        "print(json.dumps({'failures': failures, 'where': where}))\n"
    )
    # The wheel first on the path, and neither this checkout nor its folder on it.
    environment = {**os.environ, "PYTHONPATH": str(installed)}
    imported = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, env=environment, capture_output=True, text=True, timeout=300
    )
    assert imported.returncode == 0, imported.stderr
    found = json.loads(imported.stdout.strip().splitlines()[-1])
    assert found["failures"] == {}
    where = found["where"]
    assert set(modules) <= set(where)
    assert [name for name, path in where.items() if not Path(path).is_relative_to(installed)] == []


README = (CHECKOUT / "README.md").read_text()


def test_readme_lists_every_public_name_and_the_examples_import_nothing_else():
    import raysb.data

    section = README[README.index("What `from raysb import ...`"):README.index("## How selection works")]
    exported = [name for name in raysb.__all__ if name != "__version__"]
    assert [name for name in exported if f"`{name}`" not in section and f"`{name}(" not in section] == []
    public = {"raysb": set(raysb.__all__), "raysb.data": set(raysb.data.__all__)}
    reached = []
    for example in sorted((CHECKOUT / "examples").glob("*.py")):
        for node in ast.walk(ast.parse(example.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "raysb":
                reached += [f"{example.name}: {node.module}.{alias.name}" for alias in node.names
                            if alias.name not in public.get(node.module, set())]
            elif isinstance(node, ast.Import):
                reached += [f"{example.name}: {alias.name}" for alias in node.names
                            if alias.name.split(".")[0] == "raysb" and alias.name not in public]
    assert reached == []
