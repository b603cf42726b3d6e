"""What scripts/setup.sh leaves besides the venv's packages: their bytecode, compiled at set-up.

Where Python may not write its cache (PYTHONDONTWRITEBYTECODE set, as on this project's machines), a
module without bytecode is compiled again by every process that imports it: each Ray worker spent 15.4
CPU-seconds on its imports instead of 5.7, and a fresh clone's suite ran 26 of its 33 minutes so
(BENCHMARKS.md, "Bytecode compiled at set-up"). A venv made without the compile fails here, not as a
slow CI run.
"""

import importlib
import importlib.util
from pathlib import Path

import pytest

# What every Ray Train worker imports (torch._dynamo: the first optimizer a process builds imports it).
WORKER_MODULES = ["torch", "torch._dynamo.convert_frame", "ray", "ray.train.torch", "raysb.distributed.worker"]


@pytest.mark.parametrize("name", WORKER_MODULES)
def test_what_a_ray_worker_imports_has_its_bytecode_in_the_venv(name):
    source = importlib.import_module(name).__file__
    compiled = Path(importlib.util.cache_from_source(source))
    assert compiled.is_file(), f"{name}: no {compiled}; set the venv up with `bash scripts/setup.sh`, which compiles it"
