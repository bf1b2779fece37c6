"""The admin-API client: one ``httpx.Client``, every outside error translated here.

httpx exceptions never leave this module: a refused connection or timeout becomes
``CliError(UNAVAILABLE)``, a non-2xx answer becomes the ``CliError`` of its status
(``cli.errors.error_for_status``), a body that is not JSON becomes ``CliError(ERROR)``.
"""

from __future__ import annotations

from types import TracebackType
from typing import Any

import httpx

from cli.config import Settings
from cli.errors import CliError, ExitCode, error_for_status

Params = dict[str, str | int | float | bool | None]


class AdminClient:
    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        headers = {"accept": "application/json", "user-agent": "rudder-cli/0.1"}
        if settings.token:
            headers["authorization"] = f"Bearer {settings.token}"
        self._http = httpx.Client(
            base_url=settings.server, headers=headers, timeout=settings.timeout
        )

    def __enter__(self) -> AdminClient:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def close(self) -> None:
        self._http.close()

    def get(self, path: str, params: Params | None = None) -> Any:
        return self.request("GET", path, params=params)

    def post(self, path: str, body: dict[str, Any]) -> Any:
        return self.request("POST", path, json=body)

    def patch(self, path: str, body: dict[str, Any]) -> Any:
        return self.request("PATCH", path, json=body)

    def put(self, path: str, body: dict[str, Any]) -> Any:
        return self.request("PUT", path, json=body)

    def request(
        self,
        method: str,
        path: str,
        *,
        params: Params | None = None,
        json: dict[str, Any] | None = None,
    ) -> Any:
        """Send one request and return the decoded JSON body; raises ``CliError``."""
        clean = {k: v for k, v in (params or {}).items() if v is not None}
        try:
            resp = self._http.request(method, path, params=clean, json=json)
        except httpx.TimeoutException as exc:
            raise CliError(
                ExitCode.UNAVAILABLE,
                f"control plane at {self.settings.server} did not answer in "
                f"{self.settings.timeout:g}s",
            ) from exc
        except httpx.TransportError as exc:
            raise CliError(
                ExitCode.UNAVAILABLE,
                f"cannot reach the control plane at {self.settings.server}: {exc}",
            ) from exc
        try:
            body = resp.json() if resp.content else None
        except ValueError as exc:
            if resp.is_success:
                raise CliError(
                    ExitCode.ERROR, f"{method} {path}: answer is not JSON (HTTP {resp.status_code})"
                ) from exc
            body = None
        if resp.is_success:
            return body
        err = error_for_status(resp.status_code, body)
        if resp.status_code == 401 and not self.settings.token:
            err.message += (
                " (no token: pass --token, set RUDDER_TOKEN, or run `rudder up` here to get"
                " .rudder/credentials)"
            )
        raise err
