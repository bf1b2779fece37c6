"""Run a Python module or script with its function calls counted by cProfile from the moment it
gets SIGUSR1 (a bench sends it once the process is ready, so that its start-up is not counted), and
written to ``OUT`` when it exits (SIGTERM is made a clean exit). ``bench/proxy_overhead.py
--count-calls`` runs Rudder's router, the baseline and the Python floors this way and divides by
the requests each served: Python function calls per request, a count that a busy machine does not
move, where its timings are noise.

    python bench/count_calls.py OUT -m cli.main serve router
    python bench/count_calls.py OUT bench/python_floor.py --port 8100 --upstream http://...
"""

from __future__ import annotations

import atexit
import cProfile
import os
import runpy
import signal
import sys
from typing import Any


def main() -> None:
    out, target = sys.argv[1], sys.argv[2:]
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != here]  # bench/controlplane.py
    # would shadow the package of that name
    profile = cProfile.Profile()

    def start(*_: Any) -> None:
        profile.enable()

    def dump() -> None:
        profile.disable()
        profile.dump_stats(out)

    signal.signal(signal.SIGUSR1, start)
    # A server that catches SIGTERM restores this handler and raises the signal again once it has
    # stopped (uvicorn does): an exit through SystemExit runs ``dump``; the default would not.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    atexit.register(dump)
    if target[0] == "-m":
        sys.argv = [target[1], *target[2:]]
        runpy.run_module(target[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = target
        runpy.run_path(target[0], run_name="__main__")


if __name__ == "__main__":
    main()
