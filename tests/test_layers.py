"""The package's layers: every module imports on its own, no layer imports one above it,
and the light entry points stay light (README.md, "Architecture")."""

import ast
import json
import pkgutil
import subprocess
import sys
from pathlib import Path

import raysb

PACKAGE = Path(raysb.__file__).parent
# Bottom to top. A module may import from its own layer and the ones below, whether
# at module level or inside a function (README.md, "Architecture").
LAYERS = [
    {"raysb.version", "raysb.chaos", "raysb.core"},
    {"raysb.config", "raysb.resume"},
    {"raysb.data", "raysb.models"},
    {"raysb.training"},
    {"raysb.distributed"},
    {"raysb.api", "raysb.selective_backprop"},
    {"raysb.tune", "raysb.analysis", "raysb.bench"},
    {"raysb.cli", "raysb.__main__", "raysb"},
]


def layer_of(module: str) -> int:
    parts = module.split(".")
    for prefix in (".".join(parts[:2]), parts[0]):
        for rank, members in enumerate(LAYERS):
            if prefix in members:
                return rank
    raise AssertionError(f"{module} is in no layer; add it to LAYERS and to README's architecture")


def module_names() -> list[str]:
    names = [m.name for m in pkgutil.walk_packages([str(PACKAGE)], "raysb.")]
    return sorted(name for name in names if name != "raysb.__main__")


def raysb_imports(source: str) -> list[str]:
    """Every raysb module `source` imports, at module level or inside a function, class or branch."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append(node.module)
        elif isinstance(node, ast.Import):
            found += [alias.name for alias in node.names]
    return [name for name in found if name == "raysb" or name.startswith("raysb.")]


def upward_imports(module: str, source: str) -> list[str]:
    return [f"{module} -> {target}" for target in raysb_imports(source) if layer_of(target) > layer_of(module)]


def run_python(code: str) -> dict:
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_every_module_imports_on_its_own():
    # One interpreter, raysb's modules dropped before each import: an import circle fails
    # when entered from some module, whatever the order a test session happened to use.
    failures = run_python(
        "import importlib, json, sys, traceback\n"
        f"names = {module_names()!r}\n"
        "failures = {}\n"
        "for name in names:\n"
        "    for loaded in [m for m in sys.modules if m == 'raysb' or m.startswith('raysb.')]:\n"
        "        del sys.modules[loaded]\n"
        "    try:\n"
        "        importlib.import_module(name)\n"
        "    except Exception:\n"
        "        failures[name] = traceback.format_exc(limit=3)\n"
        "print(json.dumps(failures))\n"
    )
    assert failures == {}


def test_no_module_imports_from_a_layer_above_its_own():
    upward = []
    for path in sorted(PACKAGE.rglob("*.py")):
        relative = path.relative_to(PACKAGE.parent).with_suffix("")
        module = ".".join(relative.parts).removesuffix(".__init__")
        upward += upward_imports(module, path.read_text())
    assert upward == []


def test_an_import_inside_a_function_that_reaches_up_is_caught():
    planted = "import torch\n\ndef shared():\n    if True:\n        from raysb.distributed.loss_history import shared_loss_history\n"
    assert upward_imports("raysb.training.selection.rounds", planted) == [
        "raysb.training.selection.rounds -> raysb.distributed.loss_history"
    ]
    assert upward_imports("raysb.selective_backprop", planted) == []


def test_the_package_and_its_core_pull_in_no_ray_and_nothing_of_torch_distributed():
    # `import torch` itself loads parts of torch.distributed; what counts is what raysb adds.
    core = [name for name in module_names() if name.startswith("raysb.core.")]
    added = run_python(
        "import json, sys\n"
        "import torch\n"
        "before = set(sys.modules)\n"
        f"import raysb\nfrom raysb import Selector\nfor name in {core!r}: __import__(name)\n"
        "print(json.dumps(sorted(set(sys.modules) - before)))\n"
    )
    assert [m for m in added if m == "ray" or m.startswith(("ray.", "torch.distributed"))] == []
    assert "raysb.models" not in added and "raysb.data" not in added


def test_the_config_imports_no_torch():
    # The CLI, Tune's driver and sweep checks read configs without paying for torch.
    loaded = run_python("import json, sys\nimport raysb.config\nprint(json.dumps(sorted(sys.modules)))\n")
    assert "torch" not in loaded
