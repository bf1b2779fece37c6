"""Forwarding a request to the selected worker over HTTP (one upstream client per process).

Client errors are translated here, once: a failure to connect (or the connection dropping before
the response head) is :class:`WorkerUnreachable`, which the API retries on another worker unless
the request is pinned; anything else that stops the exchange is ``ServiceUnavailable``.
"""

from __future__ import annotations

from collections.abc import Mapping

from controlplane.protocol.errors import ServiceUnavailable
from router.upstream import UpstreamClient, UpstreamError, UpstreamResponse, UpstreamUnreachable

# Hop-by-hop and framing headers we never forward; and ``expect``: the router has read the whole
# body already, and a worker asked for 100-continue answers a 100 before its answer.
_DROP = frozenset({
    "host", "content-length", "connection", "keep-alive", "transfer-encoding", "te", "upgrade",
    "proxy-authorization", "proxy-connection", "accept-encoding", "expect",
})
# A client's credentials are for the router's edge, not for workers (a stolen worker credential
# must not harvest them): dropped unless RUDDER_FORWARD_CREDENTIAL_HEADERS names them.
CREDENTIAL_HEADERS = frozenset({"authorization", "cookie", "x-api-key", "api-key"})


class WorkerUnreachable(ServiceUnavailable):
    code = "worker_unreachable"


def forward_headers(headers: Mapping[str, str], *, allow: frozenset[str] = frozenset()) -> dict[str, str]:
    """The request's headers a worker receives: no hop-by-hop ones, no client credentials
    (:data:`CREDENTIAL_HEADERS`) but those in ``allow`` (lower case)."""
    return {k: v for k, v in headers.items()
            if (name := k.lower()) not in _DROP and (name not in CREDENTIAL_HEADERS or name in allow)}


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
