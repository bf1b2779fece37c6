"""The router's request cycle: uvicorn's, with what the router's answers need cheaper
(docs/decisions.md 99). The router's connection protocol (router.ingress.GuardedHttpProtocol)
turns each cycle uvicorn makes into one before the app runs.

* A response head is held and written with the first body message: one write and one wake-up of
  the client instead of two. A head with no body message in the same turn of the event loop is
  written at the turn's end, so nothing waits on it.
* ``on_disconnect(callback)``, offered to the app as the scope extension :data:`DISCONNECT`
  (:func:`disconnect_hook`): callbacks run when the client goes away, where the app would
  otherwise keep a task per request waiting for ``http.disconnect``.
* ``push(chunk)``, offered as the scope extension :data:`PUSH` (:func:`push_hook`): a chunk of a
  started chunked answer taken from a callback (the relay pushes what a worker sends from its
  connection's ``data_received``: no task wakes per chunk) and written, with whatever else was
  pushed in the same turn of the event loop, at the turn's end. It takes the chunk only when a
  body message could be written without waiting (the client takes bytes) and says so; otherwise
  the caller sends the chunk as a body message, which waits for the client.
* A response start message with :data:`HOLD` set is rendered at once and held, with no write at
  the turn's end, until the first body message: the relay renders its head while the worker
  computes the first token, and the token's bytes then go out without waiting on it.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import cast

from starlette.types import Receive, Scope
from uvicorn._types import ASGISendEvent
from uvicorn.protocols.http.httptools_impl import RequestResponseCycle

log = logging.getLogger(__name__)

# The scope extension under which a DirectCycle offers ``on_disconnect``.
DISCONNECT = "rudder.disconnect"
OnDisconnect = Callable[[Callable[[], None]], Callable[[], None]]
# The scope extension under which a DirectCycle offers ``push``.
PUSH = "rudder.push"
Push = Callable[[bytes], bool]
# A key of a response start message: hold the head until the first body message (the module's text).
HOLD = "rudder.hold"


def disconnect_hook(scope: Scope) -> OnDisconnect | None:
    """``on_disconnect`` of the cycle serving ``scope`` (``on_disconnect(callback)`` runs the
    callback when the client goes away, at once if it is gone, and returns a function that
    removes it), or None under another server, whose app then waits for ``http.disconnect``."""
    extension = (scope.get("extensions") or {}).get(DISCONNECT)
    return extension["on_disconnect"] if extension else None


def push_hook(scope: Scope) -> Push | None:
    """``push`` of the cycle serving ``scope`` (``push(chunk)`` writes a body chunk of a started
    chunked answer now and returns True, or writes nothing and returns False), or None under
    another server."""
    extension = (scope.get("extensions") or {}).get(PUSH)
    return extension["push"] if extension else None


def watch_disconnect(scope: Scope, receive: Receive, callback: Callable[[], None]) -> Callable[[], None]:
    """Run ``callback`` once when the client of ``scope`` goes away; returns a function that
    stops watching. Under the router's server its cycle runs it (:func:`disconnect_hook`); under
    another ASGI server a task waits for ``http.disconnect`` (only once the body is read)."""
    hook = disconnect_hook(scope)
    if hook is not None:
        return hook(callback)

    async def watch() -> None:
        while (await receive())["type"] != "http.disconnect":
            pass
        callback()

    task = asyncio.create_task(watch())

    def stop() -> None:
        task.cancel()

    return stop


class _Capture:
    """Stands in for the transport while uvicorn renders a response head: keeps the bytes."""

    __slots__ = ("data",)

    def __init__(self) -> None:
        self.data = b""

    def write(self, data: bytes) -> None:
        self.data += data


class _Prefixed:
    """Stands in for the transport while uvicorn writes the first body message: the held head
    goes out in the same write."""

    __slots__ = ("_head", "_transport")

    def __init__(self, transport: asyncio.Transport, head: bytes) -> None:
        self._transport = transport
        self._head = head

    def write(self, data: bytes) -> None:
        head, self._head = self._head, b""
        self._transport.write(head + data)

    def flush(self) -> None:
        if self._head and not self._transport.is_closing():
            self._transport.write(self._head)
        self._head = b""

    def close(self) -> None:
        self.flush()
        self._transport.close()

    def is_closing(self) -> bool:
        return self._transport.is_closing()


class DirectCycle(RequestResponseCycle):
    """uvicorn's request cycle with a held head and disconnect callbacks (the module's text);
    the protocol makes one of uvicorn's with :meth:`adopt`, calls :meth:`gone` from its
    ``connection_lost`` and :meth:`withdraw` when the answer is complete."""

    _held: bytes | None = None
    _callbacks: list[Callable[[], None]] | None = None

    @classmethod
    def adopt(cls, cycle: RequestResponseCycle) -> None:
        """``cycle`` made one of these (it adds methods and no state: the same object, before the
        app sees it), its methods offered in its scope's extensions."""
        cycle.__class__ = cls
        direct = cast(DirectCycle, cycle)
        direct.scope["extensions"] = {DISCONNECT: {"on_disconnect": direct.on_disconnect},
                                      PUSH: {"push": direct.push}}

    def withdraw(self) -> None:
        """Take the extensions back: they are this cycle's own methods (a reference cycle: cycle →
        scope → bound method → cycle), so without them a request's objects are freed by reference
        counting, no collector pass per request (docs/decisions.md 114). An app that asks for them
        afterwards gets None (:func:`disconnect_hook`, :func:`push_hook`) and falls back on
        ``receive``."""
        self.scope.pop("extensions", None)

    def on_disconnect(self, callback: Callable[[], None]) -> Callable[[], None]:
        if self.disconnected:
            callback()
            return _nothing
        if self._callbacks is None:
            self._callbacks = []
        callbacks = self._callbacks
        callbacks.append(callback)

        def remove() -> None:
            if callback in callbacks:
                callbacks.remove(callback)

        return remove

    def gone(self) -> None:
        """The client went away (the protocol's ``connection_lost``): run the callbacks once."""
        callbacks, self._callbacks = self._callbacks, None
        for callback in callbacks or ():
            try:
                callback()
            except Exception:
                log.exception("disconnect callback failed")
        self.withdraw()

    def push(self, chunk: bytes) -> bool:
        """Write ``chunk`` as a body chunk of the started chunked answer if a body message could
        go now without waiting: True if taken, else False and nothing taken (the client takes no
        bytes, it is gone, the answer is not chunked or is complete). What is pushed in one turn
        of the event loop goes out in one write at the turn's end, or before the next body
        message, with a head still held."""
        if (not self.response_started or self.response_complete or not self.chunked_encoding
                or self.flow.write_paused or self.disconnected or not chunk):
            return False
        framed = b"%x\r\n%b\r\n" % (len(chunk), chunk)
        held = self._held
        if held is None:  # held, as a head is, until the turn's end or the next body message
            self._held = framed
            asyncio.get_running_loop().call_soon(self._flush)
        else:
            self._held = held + framed
        return True

    async def send(self, message: ASGISendEvent) -> None:
        if self.flow.write_paused or self.disconnected:
            self._flush()
            await super().send(message)
            return
        transport = self.transport
        if message["type"] == "http.response.start" and not self.response_started:
            capture = _Capture()
            self.transport = capture  # type: ignore[assignment]
            try:
                await super().send(message)  # renders and validates the head; no await inside
            finally:
                self.transport = transport
            self._held = capture.data
            if not message.get(HOLD):
                asyncio.get_running_loop().call_soon(self._flush)
            return
        held = self._held
        if held is None or message["type"] != "http.response.body":
            await super().send(message)
            return
        self._held = None
        prefixed = _Prefixed(transport, held)
        self.transport = prefixed  # type: ignore[assignment]
        try:
            await super().send(message)  # no await inside: not paused, not disconnected
        finally:
            self.transport = transport
            prefixed.flush()  # a body message that wrote nothing (an answer to HEAD) sends the head

    def _flush(self) -> None:
        held, self._held = self._held, None
        if held and not self.transport.is_closing():
            self.transport.write(held)


def _nothing() -> None:
    pass
