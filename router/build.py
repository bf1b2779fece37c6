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


def _built(root: Path) -> list[tuple[Path, Path]]:
    """(extension, its source) of every module of ``root``'s packages built next to its ``.py``,
    in path order (an extension's suffix is the most specific of the interpreter's that it ends
    with: ``.cpython-311-x86_64-linux-gnu.so`` before ``.so``)."""
    pairs = []
    for package in PACKAGES:
        for path in (root / package).rglob("*"):
            suffix = next((s for s in importlib.machinery.EXTENSION_SUFFIXES if path.name.endswith(s)), None)
            if suffix is not None:
                source = path.with_name(path.name[: -len(suffix)] + ".py")
                if source.exists():
                    pairs.append((path, source))
    return sorted(pairs)


def compiled_modules(root: Path = ROOT) -> list[Path]:
    """The C extensions built from this checkout's modules (each next to its ``.py``)."""
    return [ext for ext, _ in _built(root)]


def stale_modules(root: Path = ROOT) -> list[str]:
    """Modules of a source checkout whose ``.py`` changed after their extension was built, as
    paths relative to the checkout (empty outside one)."""
    if not (root / "pyproject.toml").exists():
        return []
    return [str(source.relative_to(root)) for ext, source in _built(root)
            if source.stat().st_mtime > ext.stat().st_mtime]


def running_compiled() -> bool:
    """Whether this process runs the compiled request path (the scheduler's module is an
    extension)."""
    from router import scheduler

    return not (scheduler.__file__ or "").endswith(".py")


def advice(stale: list[str]) -> str:
    return (f"compiled from older sources: {', '.join(stale)}; run `pip install -e .` again "
            "(or delete the modules' .so files to run their .py)")

