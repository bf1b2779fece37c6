"""A small asyncio TCP proxy for network faults: one client (a router) reaches NATS through it.

Three modes, switched at any time:

- ``PASS``: bytes flow both ways;
- ``STALL``: connections stay open but no byte moves either way (a black hole: what a switch
  that drops packets looks like to TCP); what was held flows when it passes again;
- ``DROP``: every open connection is closed and new ones are closed at once (a reset link).
"""

from __future__ import annotations

import asyncio
import contextlib
import enum

from cli.embedded import free_port


class Mode(enum.Enum):
    PASS = "pass"
    STALL = "stall"
    DROP = "drop"


class TcpProxy:
    """Listens on ``127.0.0.1:<port>`` and forwards to ``target`` (host, port)."""

    def __init__(self, target: tuple[str, int], *, port: int | None = None) -> None:
        self.target = target
        self.port = port or free_port()
        self.mode = Mode.PASS
        self._flowing = asyncio.Event()
        self._flowing.set()
        self._server: asyncio.Server | None = None
        self._conns: set[asyncio.Task[None]] = set()

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", self.port)

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        for task in list(self._conns):
            task.cancel()
        await asyncio.gather(*self._conns, return_exceptions=True)

    def set(self, mode: Mode) -> None:
        self.mode = mode
        if mode is Mode.STALL:
            self._flowing.clear()
        else:
            self._flowing.set()
        if mode is Mode.DROP:
            for task in list(self._conns):
                task.cancel()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self.mode is Mode.DROP:
            writer.close()
            return
        task = asyncio.current_task()
        assert task is not None
        self._conns.add(task)
        upstream_w: asyncio.StreamWriter | None = None
        try:
            upstream_r, upstream_w = await asyncio.open_connection(*self.target)
            await asyncio.gather(self._pipe(reader, upstream_w), self._pipe(upstream_r, writer))
        except (OSError, asyncio.CancelledError):
            pass
        finally:
            self._conns.discard(task)
            for w in (writer, upstream_w):
                if w is not None:
                    w.close()

    async def _pipe(self, src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
        try:
            while True:
                data = await src.read(65536)
                if not data:
                    break
                await self._flowing.wait()
                dst.write(data)
                await dst.drain()
        finally:
            with contextlib.suppress(OSError):
                dst.close()
