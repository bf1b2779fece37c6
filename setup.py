"""The build: the package as pyproject.toml declares it, with the router's request-path modules
compiled to C extensions by mypyc (docs/decisions.md 131).

The modules below are the router's request path: the scheduler actor and its selection, bookings,
calibration and returns, the express path and its worker client, the SSE reader, the tokenizer's
cache and the prefix index. They are type-checked with ``mypy --strict`` anyway; compiled, the
actor's work a request and a selection over a model's pool take about half the time
(bench/request_commands.py, bench/selection.py), while the router's CPU a request end to end moved
within the bench's noise (bench/proxy_overhead.py). Nothing else changes: the same source is the
pure-Python module where no C compiler is found (each extension is optional: a failed one is left
out and its ``.py`` imported), or with ``RUDDER_PURE_PYTHON=1``.

An editable install (``pip install -e .``) builds them next to their sources; after editing one of
these modules, run ``pip install -e .`` again (``router.build.stale_modules`` names the stale ones,
and the router logs them at start; the test suite refuses to run on them).
"""

from __future__ import annotations

import os

from setuptools import setup

# Relative to the project's root. Left out: modules with classes built on another package's classes
# (router.ingress, router.cycle: uvicorn's), the FastAPI app (router.api: it reads its functions'
# signatures), generic dataclasses mypyc cannot build (router.commands), and what runs once.
COMPILED = [
    "router/scheduler.py",
    "router/choose.py",
    "router/loadvec.py",
    "router/pools.py",
    "router/bookings.py",
    "router/calibration.py",
    "router/returns.py",
    "router/express.py",
    "router/requestwork.py",
    "router/upstream.py",
    "router/sse.py",
    "router/tokenize.py",
    "router/index.py",
    "router/targets.py",
    "router/peers.py",
    "router/peersync.py",
    "router/discovery.py",
    "router/claims.py",
    "router/decisions.py",
    "router/busy.py",
    "router/fastmetrics.py",
    "router/policy_state.py",
    "router/timing_fit.py",
    "router/cost/__init__.py",
    "router/cost/blocks.py",
    "router/cost/common.py",
    "router/cost/time.py",
    "controlplane/protocol/hashing.py",
]


def ext_modules() -> list[object]:
    if os.environ.get("RUDDER_PURE_PYTHON", "").strip().lower() in ("1", "true", "yes"):
        return []
    try:
        from mypyc.build import mypycify
    except ImportError:  # (a build without its build requirements: pure Python)
        return []
    # The build's own environment (pyproject.toml's build requirements) holds the packages whose
    # types the compiled modules use; the others are typed Any. The project's mypy settings are
    # not read (CI checks every module with them), and the modules the compiled ones import are
    # read for their types only (their errors, where a package is missing here, are not this
    # build's).
    options = ["--config-file", "", "--ignore-missing-imports", "--follow-imports", "silent",
               "--python-version", "3.11"]
    extensions = mypycify([*options, *COMPILED], opt_level="3", debug_level="0")
    for ext in extensions:
        ext.optional = True  # no C compiler: the .py modules are used
    return list(extensions)


setup(ext_modules=ext_modules())
