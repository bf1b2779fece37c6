"""Forwarding a request to the selected worker over HTTP (one upstream client per process).

Client errors are translated here, once: a failure to connect (or the connection dropping before
the response head) is :class:`WorkerUnreachable`, which the API retries on another worker unless
the request is pinned; anything else that stops the exchange is ``ServiceUnavailable``.
"""

from __future__ import annotations

from collections.abc import Mapping

from controlplane.protocol.errors import ServiceUnavailable
from router.upstream import UpstreamClient, UpstreamError, UpstreamResponse, UpstreamUnreachable


class WorkerUnreachable(ServiceUnavailable):
    code = "worker_unreachable"


class Proxy:
    def __init__(self, client: UpstreamClient) -> None:
        self.client = client

    async def open(
        self, url: str, path: str, body: bytes, headers: Mapping[str, str]
    ) -> UpstreamResponse:
        """Send the request and return once the response head is in (the body is streamed).
        Raises WorkerUnreachable (retry elsewhere) or ServiceUnavailable."""
        try:
            return await self.client.open(url, path, body, headers)
        except UpstreamUnreachable as exc:
            raise WorkerUnreachable(f"worker at {url} is unreachable: {exc}", retry_after=1) from exc
        except UpstreamError as exc:
            raise ServiceUnavailable(f"worker at {url} failed: {exc}", retry_after=1) from exc
