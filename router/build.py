"""Which of the router's compiled modules (setup.py: mypyc) are older than their source.

An editable install builds each compiled module's C extension next to its ``.py``, and Python
imports the extension first: a module edited since the last ``pip install -e .`` would run as it
was. The router logs such modules at start; the test suite refuses to run on them. Only a source
checkout is looked at (a ``pyproject.toml`` beside the packages): an installed wheel's files carry
the time they were unpacked, not the time they were built.
"""

from __future__ import annotations

import importlib.machinery
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("router", "controlplane")


def compiled_modules(root: Path = ROOT) -> list[Path]:
    """The C extensions built from this checkout's modules (each next to its ``.py``)."""
    found: list[Path] = []
    for package in PACKAGES:
        for suffix in importlib.machinery.EXTENSION_SUFFIXES:
            found += [p for p in (root / package).rglob(f"*{suffix}") if p.with_name(_source(p, suffix)).exists()]
    return sorted(set(found))


def stale_modules(root: Path = ROOT) -> list[str]:
    """Modules of a source checkout whose ``.py`` changed after their extension was built, as
    paths relative to the checkout (empty outside one)."""
    if not (root / "pyproject.toml").exists():
        return []
    stale = []
    for ext in compiled_modules(root):
        suffix = next(s for s in importlib.machinery.EXTENSION_SUFFIXES if ext.name.endswith(s))
        source = ext.with_name(_source(ext, suffix))
        if source.stat().st_mtime > ext.stat().st_mtime:
            stale.append(str(source.relative_to(root)))
    return stale


def running_compiled() -> bool:
    """Whether this process runs the compiled request path (the scheduler's module is an
    extension)."""
    from router import scheduler

    return not (scheduler.__file__ or "").endswith(".py")


def advice(stale: list[str]) -> str:
    return (f"compiled from older sources: {', '.join(stale)}; run `pip install -e .` again "
            "(or delete the modules' .so files to run their .py)")


def _source(ext: Path, suffix: str) -> str:
    return ext.name[: -len(suffix)] + ".py"
