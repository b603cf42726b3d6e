"""The wheel a user installs: built from the package's files alone, and every module in it
imports from the wheel, not from this checkout (a package without its `__init__.py` would be
left out, or ship only by setuptools' namespace-package fallback)."""

import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import raysb

CHECKOUT = Path(raysb.__file__).parent.parent


def test_every_module_imports_from_the_built_wheel(tmp_path):
    # Built from a copy: pip builds in the source folder, which would leave build/ in the checkout.
    source = tmp_path / "source"
    shutil.copytree(CHECKOUT / "raysb", source / "raysb", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(CHECKOUT / name, source / name)
    built = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index",
         "--wheel-dir", str(tmp_path / "dist"), str(source)],
        capture_output=True, text=True, timeout=300,
    )
    assert built.returncode == 0, built.stdout + built.stderr
    (wheel,) = (tmp_path / "dist").glob("raysb-*.whl")
    installed = tmp_path / "installed"
    with zipfile.ZipFile(wheel) as archive:
        archive.extractall(installed)
        files = archive.namelist()

    packages = sorted({str(Path(name).parent) for name in files if name.startswith("raysb/") and name.endswith(".py")})
    assert [p for p in packages if f"{p}/__init__.py" not in files] == []
    # A package's __main__ runs its command when imported; the rest import as a user's code would.
    modules = sorted(
        name[: -len(".py")].replace("/", ".").removesuffix(".__init__")
        for name in files
        if name.startswith("raysb/") and name.endswith(".py") and not name.endswith("__main__.py")
    )
    assert "raysb.training.selection.rounds" in modules
    code = (
        "import importlib, json, sys\n"
        f"for name in {modules!r}: importlib.import_module(name)\n"
        "print(json.dumps({name: module.__file__ for name, module in sys.modules.items()"
        " if name == 'raysb' or name.startswith('raysb.')}))\n"
    )
    # The wheel first on the path, and neither this checkout nor its folder on it.
    environment = {**os.environ, "PYTHONPATH": str(installed)}
    imported = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, env=environment, capture_output=True, text=True, timeout=300
    )
    assert imported.returncode == 0, imported.stderr
    where = json.loads(imported.stdout.strip().splitlines()[-1])
    assert set(modules) <= set(where)
    assert [name for name, path in where.items() if not Path(path).is_relative_to(installed)] == []
