"""Exit codes and the one CLI error type.

    CliError(exit_code, message)     raised anywhere below a command, printed once on stderr
    └── built by ``error_for_status``  from an admin-API answer (status → exit code below)

| code | meaning                                                        |
|------|----------------------------------------------------------------|
| 0    | ok                                                             |
| 1    | error (5xx other than 503, audit chain broken, reconcile dirty) |
| 2    | usage / bad input (click usage errors, 400, 413, 415, 422, ...) |
| 3    | revision conflict (409)                                        |
| 4    | authentication / authorization (401, 403)                      |
| 5    | unavailable (503, connection refused, timeout)                 |
| 6    | not found (404)                                                |

Scripts branch on these numbers, so they are part of the CLI's contract (docs/operator-guide.md).
"""

from __future__ import annotations

import enum
from typing import Any


class ExitCode(enum.IntEnum):
    OK = 0
    ERROR = 1
    USAGE = 2
    CONFLICT = 3
    AUTH = 4
    UNAVAILABLE = 5
    NOT_FOUND = 6


EXIT_CODES_HELP = (
    "Exit codes: 0 ok, 1 error, 2 usage or bad input (4xx), 3 revision conflict (409), "
    "4 authentication (401/403), 5 unavailable (503, connection refused), 6 not found (404)."
)


def exit_code_for_status(status: int) -> ExitCode:
    """Map an HTTP status of the admin API to the CLI's exit code."""
    if status < 400:
        return ExitCode.OK
    if status == 409:
        return ExitCode.CONFLICT
    if status in (401, 403):
        return ExitCode.AUTH
    if status == 404:
        return ExitCode.NOT_FOUND
    if status == 503:
        return ExitCode.UNAVAILABLE
    if status < 500:
        return ExitCode.USAGE
    return ExitCode.ERROR


class CliError(Exception):
    """An error the CLI reports on stderr before exiting with ``exit_code``.

    ``body`` keeps the server's error object (``{"code", "message", ...facts}``) so ``--json``
    callers can print it.
    """

    def __init__(
        self, exit_code: ExitCode, message: str, *, body: dict[str, Any] | None = None
    ) -> None:
        super().__init__(message)
        self.exit_code = exit_code
        self.message = message
        self.body = body or {}


def error_for_status(status: int, body: Any) -> CliError:
    """Build the CLI error for a non-2xx answer, using the API's error shape when present."""
    err: dict[str, Any] = {}
    if isinstance(body, dict) and isinstance(body.get("error"), dict):
        err = dict(body["error"])
    message = str(err.get("message") or f"HTTP {status}")
    code = err.get("code")
    if code:
        message = f"{code}: {message}"
    if status == 409 and "head_revision" in err and str(err["head_revision"]) not in message:
        message += (f" (expected revision {err.get('expected_revision')}, "
                    f"head is {err['head_revision']})")
    if err.get("field") and str(err["field"]) not in message:
        message += f" [field {err['field']}]"
    return CliError(exit_code_for_status(status), message, body=err or {"status": status})
