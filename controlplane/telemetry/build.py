"""``rudder_build_info``: which Rudder a process runs (every process's ``/metrics``)."""

from __future__ import annotations

import platform
from importlib import metadata

from prometheus_client import CollectorRegistry, Info


def version() -> str:
    try:
        return metadata.version("rudder")
    except metadata.PackageNotFoundError:  # run from a checkout without installing
        return "unknown"


def build_info(registry: CollectorRegistry, component: str) -> Info:
    """Register ``rudder_build_info{version, python, component} 1`` on ``registry``."""
    info = Info("rudder_build", "Rudder build running in this process", registry=registry)
    info.info({"version": version(), "python": platform.python_version(), "component": component})
    return info
