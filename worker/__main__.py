"""``python -m worker``: one worker from ``RUDDER_*`` environment variables (used by tests and
containers; the CLI's ``rudder serve worker`` calls :func:`worker.agent.run` the same way)."""

from __future__ import annotations

import sys

from pydantic import ValidationError

from worker.agent import run
from worker.settings import WorkerSettings


def main() -> None:
    try:
        settings = WorkerSettings()
    except ValidationError as exc:
        for err in exc.errors():
            name = "RUDDER_" + "__".join(str(p) for p in err["loc"]).upper()
            print(f"rudder worker: bad setting {name}: {err['msg']}", file=sys.stderr)
        raise SystemExit(2) from None
    run(settings)


if __name__ == "__main__":
    main()
