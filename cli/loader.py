"""Late imports of the parts the CLI starts (control plane, migrations, router, worker).

They are imported inside the commands, not at module level, so ``rudder --help`` works and stays
fast whatever is installed; a missing part is a clear ``CliError`` rather than a traceback.
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import Any

from cli.errors import CliError, ExitCode


def available(module: str) -> bool:
    """Whether ``module`` can be imported, without importing it."""
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def load(module: str, attr: str) -> Any:
    """``module.attr``; raises ``CliError`` naming what is missing."""
    try:
        mod = importlib.import_module(module)
    except ModuleNotFoundError as exc:
        raise CliError(ExitCode.ERROR,
                       f"{module} is not available in this installation ({exc})") from exc
    try:
        return getattr(mod, attr)
    except AttributeError as exc:
        raise CliError(ExitCode.ERROR, f"{module}.{attr} is not available in this installation"
                       ) from exc
