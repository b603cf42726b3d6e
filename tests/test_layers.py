"""The package's layers: no layer imports one above it, no modules import each other in a circle,
the light entry points stay light, and configuration goes down the layers in sections, back up to
the whole config in few places (README.md, "Architecture"). That every module imports on its own
is tests/test_wheel.py's, from the wheel a user installs."""

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
    {"raysb.version", "raysb.chaos_spec", "raysb.core"},
    {"raysb.config", "raysb.resume"},
    {"raysb.data", "raysb.models"},
    {"raysb.training"},
    {"raysb.distributed"},
    {"raysb.api", "raysb.selective_backprop", "raysb.inference", "raysb.predict"},
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


def absolute_module(module: str, node: ast.ImportFrom, packages: set[str]) -> str:
    """The module a `from ... import` names, its leading dots resolved from `module`."""
    if not node.level:
        return node.module
    package = module if module in packages else module.rpartition(".")[0]
    for _ in range(node.level - 1):
        package = package.rpartition(".")[0]
    return f"{package}.{node.module}" if node.module else package


def import_graph(sources: dict[str, str]) -> dict[str, set[str]]:
    """Each module of `sources` -> the modules of `sources` it imports, counting every import statement:
    at module level, inside a function, and under `if TYPE_CHECKING:`, since a circle of imports made
    only for types still ties the modules together, and becomes a real one the day such an import moves
    out of its branch. Importing a submodule counts for the submodule alone, not its packages."""
    packages = {module.rpartition(".")[0] for module in sources}
    graph = {}
    for module, source in sources.items():
        imported = set()
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.Import):
                imported |= {alias.name for alias in node.names}
            elif isinstance(node, ast.ImportFrom):
                base = absolute_module(module, node, packages)
                # `from package import name` imports the submodule `name` where there is one.
                imported |= {f"{base}.{alias.name}" if f"{base}.{alias.name}" in sources else base
                             for alias in node.names}
        graph[module] = imported & (sources.keys() - {module})
    return graph


def shortest_circle(start: str, graph: dict[str, set[str]]) -> list[str]:
    """The shortest chain of imports from `start` back to it, `start` at both ends; [] where there is none."""
    paths = {start: [start]}
    frontier = [start]
    while frontier:
        following = []
        for module in frontier:
            for target in sorted(graph[module]):
                if target == start:
                    return paths[module] + [start]
                if target not in paths:
                    paths[target] = paths[module] + [target]
                    following.append(target)
        frontier = following
    return []


def import_circles(graph: dict[str, set[str]]) -> list[str]:
    """Every module's shortest import circle, each written once, from its first module by name."""
    circles = set()
    for start in graph:
        circle = shortest_circle(start, graph)[:-1]
        if circle:
            first = circle.index(min(circle))
            circle = circle[first:] + circle[:first]
            circles.add(" -> ".join(circle + circle[:1]))
    return sorted(circles)


def test_no_modules_import_each_other_in_a_circle():
    assert import_circles(import_graph(dict(modules_and_sources()))) == []


def test_a_circle_closed_by_a_type_only_or_a_function_level_import_is_caught():
    planted = {
        "raysb.core.card": "from raysb.core.table import TABLE\n",
        "raysb.core.table": "from typing import TYPE_CHECKING\n\nif TYPE_CHECKING:\n    from .spec import Spec\n",
        "raysb.core.spec": "def check():\n    from raysb.core import card\n",
        "raysb.core.outside": "import raysb.core.card\n",
    }
    assert import_circles(import_graph(planted)) == [
        "raysb.core.card -> raysb.core.table -> raysb.core.spec -> raysb.core.card"
    ]


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


# The layers that train read typed sections of the config (raysb.core.settings), never the whole.
SECTIONED = ("raysb.core", "raysb.data", "raysb.models", "raysb.training")
# Below the entry points (api, tune, analysis, bench, cli), the only function that takes the whole
# config: the driver's entry (raysb.distributed.launch, itself an entry point of a run on Ray Train),
# which makes its paths absolute, resolves the sections and sends the resolved record to the workers.
TAKES_THE_WHOLE_CONFIG = {"raysb.distributed.launch.train_distributed(config)"}
ENTRY_FUNCTIONS = {"raysb.distributed.launch.train_distributed"}


def modules_and_sources():
    for path in sorted(PACKAGE.rglob("*.py")):
        relative = path.relative_to(PACKAGE.parent).with_suffix("")
        yield ".".join(relative.parts).removesuffix(".__init__"), path.read_text()


def functions(tree: ast.AST) -> list[ast.FunctionDef | ast.AsyncFunctionDef]:
    return [node for node in ast.walk(tree) if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))]


def whole_config_arguments(function: ast.FunctionDef | ast.AsyncFunctionDef) -> list[str]:
    """The parameters of `function` that take the whole config: annotated TrainConfig, or a bare `config`."""
    arguments = function.args.posonlyargs + function.args.args + function.args.kwonlyargs
    return [argument.arg for argument in arguments
            if "TrainConfig" in (ast.unparse(argument.annotation) if argument.annotation is not None else "")
            or (argument.arg == "config" and argument.annotation is None)]


def whole_config_parameters(module: str, source: str) -> list[str]:
    """Every parameter in `source` that takes the whole config."""
    return [f"{module}.{function.name}({argument})" for function in functions(ast.parse(source))
            for argument in whole_config_arguments(function)]


def names_used(source: str) -> set[str]:
    return {node.id for node in ast.walk(ast.parse(source)) if isinstance(node, ast.Name)} | {
        alias.name for node in ast.walk(ast.parse(source)) if isinstance(node, ast.ImportFrom) for alias in node.names
    }


def test_the_layers_that_train_receive_sections_not_the_whole_config():
    reaching = []
    for module, source in modules_and_sources():
        if module.startswith(SECTIONED):
            reaching += whole_config_parameters(module, source)
            reaching += [f"{module} names TrainConfig"] if "TrainConfig" in names_used(source) else []
    assert reaching == []


def below_the_entry_points() -> list[tuple[str, str]]:
    return [(module, source) for module, source in modules_and_sources()
            if module != "raysb.config" and layer_of(module) < layer_of("raysb.api")]


def test_below_the_entry_points_only_the_drivers_entry_takes_the_whole_config():
    below = [parameter for module, source in below_the_entry_points()
             for parameter in whole_config_parameters(module, source)]
    assert set(below) == TAKES_THE_WHOLE_CONFIG


# Where a part below the entry points works on the flat record again: TrainConfig's own methods, and
# the functions of the record's floor (raysb.config, raysb.resume) that read, rebuild or write it.
RECORD_MODULES = ("raysb.config", "raysb.resume")
RECORD_METHODS = {"settings", "selection_spec", "derived_values", "saved_values", "to_dict"}


def climbs_back_up(module: str, source: str) -> list[str]:
    """Where configuration climbs back up a floor in `module`. It goes down the floors: an entry point
    resolves the flat record (raysb.config, floor 1) into sections (raysb.core.settings, floor 0) and
    hands each part below the section it needs. It climbs back up wherever a part below the entry
    points goes back to the record: a function that takes the whole config, or, from the floors above
    the record's (data and models, training, distributed), a call into the record's floor on it (a
    name imported from raysb.config or raysb.resume other than ConfigError, or a TrainConfig method).
    The driver's entry (ENTRY_FUNCTIONS) resolves its own config, as every entry point does."""
    tree = ast.parse(source)
    from_record = {alias.asname or alias.name for node in ast.walk(tree)
                   if isinstance(node, ast.ImportFrom) and node.module in RECORD_MODULES
                   for alias in node.names} - {"ConfigError"}
    above_the_record = layer_of(module) > layer_of("raysb.config")

    def to_the_record(call: ast.Call) -> bool:
        target = call.func.value if isinstance(call.func, ast.Attribute) else call.func
        return (isinstance(target, ast.Name) and target.id in from_record) or \
            (isinstance(call.func, ast.Attribute) and call.func.attr in RECORD_METHODS)

    found = set()
    for function in functions(tree):
        name = f"{module}.{function.name}"
        if name in ENTRY_FUNCTIONS:
            continue
        found |= {f"{name}({argument})" for argument in whole_config_arguments(function)}
        # Its own calls: a function defined inside it counts for itself.
        inner = {id(node) for each in functions(function) if each is not function for node in ast.walk(each)}
        found |= {f"{name}: {ast.unparse(call.func)}()" for call in ast.walk(function)
                  if isinstance(call, ast.Call) and id(call) not in inner and above_the_record and to_the_record(call)}
    return sorted(found)


def test_config_climbs_back_up_a_floor_at_most_8_times():
    climbs = [climb for module, source in below_the_entry_points() for climb in climbs_back_up(module, source)]
    assert len(climbs) <= 8, climbs


def test_a_climb_back_up_to_the_record_is_caught():
    planted = ("from raysb.config import ConfigError, TrainConfig, write_config\n\n"
               "def start(record: dict, run):\n    config = TrainConfig.from_dict(record)\n"
               "    write_config(run.saved, 'x')\n    raise ConfigError('no')\n\n"
               "def check(config, settings):\n    return settings.run.seed\n")
    assert climbs_back_up("raysb.distributed.x", planted) == [
        "raysb.distributed.x.check(config)", "raysb.distributed.x.start: TrainConfig.from_dict()",
        "raysb.distributed.x.start: write_config()",
    ]
    # On the record's own floor, only a function that takes the whole config climbs.
    assert climbs_back_up("raysb.resume", planted) == ["raysb.resume.check(config)"]


def test_a_function_that_takes_the_whole_config_is_caught():
    planted = ("def build(config, spec: 'SelectionSpec'):\n    pass\n\n"
               "def run(settings, *, config: 'TrainConfig | None' = None):\n    pass\n")
    assert whole_config_parameters("raysb.training.x", planted) == [
        "raysb.training.x.build(config)", "raysb.training.x.run(config)"
    ]
    assert "TrainConfig" in names_used("from raysb.config import TrainConfig\n")
