"""What a user names as `package.module:attribute`: an own model's factory, an own strategy's card."""

from __future__ import annotations

import importlib
import os
import sys
from types import ModuleType


def import_from_working_directory(module_name: str) -> ModuleType:
    """`module_name` imported as `python -m` would find it, the working directory first: raysb's
    console script alone would not look there. Raises ImportError as importing does."""
    if "" not in sys.path and os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    return importlib.import_module(module_name)


def import_named(module_name: str, what: str, error: type[Exception] = ValueError) -> ModuleType:
    """`module_name` imported as `import_from_working_directory` does; where it cannot be, `error`
    naming `what` needs it (e.g. "model 'pkg.mod:build'") and how to make it importable."""
    try:
        return import_from_working_directory(module_name)
    except ImportError as failure:
        raise error(
            f"{what}: cannot import {module_name} ({failure}); install it, or run from the folder that "
            "holds it (on a Ray cluster: ray job submit --working-dir that folder)"
        ) from None
