"""Serve an ASGI app with uvicorn inside our own event loop, on a socket we bind ourselves.

Binding first lets port 0 pick a free port whose real number we advertise. uvicorn's own signal
capture is disabled: the process's entry point owns SIGTERM/SIGINT (graceful leave first).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections.abc import Generator

import uvicorn
from starlette.types import ASGIApp

log = logging.getLogger(__name__)


class _Server(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        yield


def bind_socket(host: str, port: int) -> socket.socket:
    """A listening-ready TCP socket on ``host:port`` (port 0 = a free one). Raises OSError."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # proto must say TCP explicitly: asyncio sets TCP_NODELAY on accepted connections only when
    # ``sock.proto == IPPROTO_TCP``; with proto 0 every keep-alive response waits ~40 ms for a
    # delayed ACK (Nagle), which would dwarf the router's overhead in benchmarks.
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    sock.set_inheritable(True)
    return sock


class HttpServer:
    """One uvicorn server for one app; ``port`` is the real bound port."""

    def __init__(self, app: ASGIApp, *, host: str, port: int) -> None:
        self._sock = bind_socket(host, port)
        self.host = host
        self.port: int = self._sock.getsockname()[1]
        config = uvicorn.Config(
            app, log_config=None, access_log=False, lifespan="off", loop="none",
            timeout_keep_alive=30, timeout_graceful_shutdown=5, backlog=4096,
        )
        self._server = _Server(config)
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        """Start serving; raises RuntimeError if uvicorn does not come up."""
        self._task = asyncio.create_task(self._server.serve(sockets=[self._sock]),
                                         name=f"http:{self.port}")
        while not self._server.started:
            if self._task.done():
                exc = self._task.exception()
                raise RuntimeError(f"HTTP server on port {self.port} did not start") from exc
            await asyncio.sleep(0.005)
        log.info("HTTP server listening on %s:%d", self.host, self.port)

    async def stop(self) -> None:
        """Stop accepting, let in-flight responses finish (bounded), close the socket."""
        if self._task is None:
            self._sock.close()
            return
        self._server.should_exit = True
        try:
            await asyncio.wait_for(asyncio.shield(self._task), timeout=10)
        except TimeoutError:
            self._server.force_exit = True
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        self._sock.close()


def advertised_url(*, host: str, port: int, advertise_host: str | None = None) -> str:
    """The URL routers should call: the advertised host (or the bound one) and the real port."""
    name = advertise_host or host
    if name in ("0.0.0.0", "::", ""):
        name = socket.gethostname()
    if ":" in name:
        name = f"[{name}]"
    return f"http://{name}:{port}"
