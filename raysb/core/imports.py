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
