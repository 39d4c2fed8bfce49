"""Import an object by its dotted name: the one way diffbatch resolves names to objects.

Pipeline classes, executor backends and worker runner factories may all be named
by text ("pkg.module.Class" or "pkg.module:Class"), so a config can cross processes
and command lines as plain strings.
"""

from __future__ import annotations

import importlib
from typing import Any

from diffbatch.errors import ConfigError


def import_by_name(name: str, *, what: str) -> Any:
    """Import "pkg.module.attr" or "pkg.module:attr" (attr may be dotted) and return it.

    Args:
        name: the dotted name.
        what: the option being resolved, for the error ("pipeline_class", "executor").

    Raises:
        ConfigError: the name is malformed, or the module or attribute does not import;
            the message names `what`, the name given and the import error.
    """
    module_name, sep, attr = name.partition(":")
    if not sep:
        module_name, _, attr = name.rpartition(".")
    if not module_name or not attr:
        raise ConfigError(
            f"{what} must be a dotted name 'pkg.module.Name' or 'pkg.module:Name', got {name!r}"
        )
    try:
        obj: Any = importlib.import_module(module_name)
        for part in attr.split("."):
            obj = getattr(obj, part)
    except Exception as exc:  # ImportError, AttributeError, or the module failed to import
        raise ConfigError(
            f"{what} {name!r} could not be imported: expected an object importable as "
            f"{module_name}.{attr} ({type(exc).__name__}: {exc})"
        ) from exc
    return obj
