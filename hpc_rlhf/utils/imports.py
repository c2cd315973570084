"""A user's Python object named `path/to/file.py:name` or `package.module:name` (reward functions, environments)."""

from __future__ import annotations

import importlib
import importlib.util
from pathlib import Path


class ModuleFileMissing(LookupError):
    """The named .py file does not exist (kept apart from errors raised while the user's module runs)."""


def import_target(target: str, prefix: str):
    """The module `target` names: a .py file, loaded as a module named `prefix` + its stem (not put in
    sys.modules: two files of one name in different folders stay apart), or a module on sys.path."""
    if not target.endswith(".py"):
        return importlib.import_module(target)
    path = Path(target)
    if not path.is_file():
        raise ModuleFileMissing(f"file {path} does not exist")
    module_spec = importlib.util.spec_from_file_location(f"{prefix}{path.stem}", path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module
