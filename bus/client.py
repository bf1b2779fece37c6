"""The bus client: every NATS and JetStream operation Rudder uses, behind one class.

No module outside ``bus/`` imports ``nats`` (tests aside). A process opens one :class:`Bus`
(:meth:`Bus.connect`) in its lifespan and hands it to its edges (the control plane's policy log,
checkpoint log, ACK consumer and fleet view; a router's consumers; a worker's agent). They see
:class:`Message` values, never nats objects, and Rudder's error tree, never nats exceptions:

- anything that means "the bus did not answer" (timeouts, no responders, a closed or
  reconnecting connection, no stream leader, JetStream "temporarily unavailable") and any other
  refusal by JetStream becomes :class:`~controlplane.protocol.errors.LogUnavailable` (503);
- a compare-and-set whose expectation is stale becomes
  :class:`~controlplane.protocol.errors.RevisionConflict` carrying the head; every "wrong last
  sequence" code counts (10071, and 10164, which a clustered nats-server 2.15 answers);
- a CAS publish whose answer was lost becomes
  :class:`~controlplane.protocol.errors.LogAmbiguous` unless reading the subject's last message
  back shows our own ``Nats-Msg-Id`` (then it succeeded: ``recovered``).

The translation happens here and nowhere else (``_translate``).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, TypeVar

import nats.errors
import nats.js.errors
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy
from nats.js.errors import APIError, NotFoundError

from bus.connect import BusOptions, connect
from bus.streams import BusLayout, check, wait_ready
from controlplane.protocol.errors import LogAmbiguous, LogUnavailable, RevisionConflict
from controlplane.protocol.subjects import (
    HDR_EXPECTED_LAST_SUBJECT_SEQ,
    HDR_MSG_ID,
    JS_ERRS_WRONG_LAST_SEQUENCE,
)

log = logging.getLogger(__name__)
T = TypeVar("T")

#: Everything nats-py raises, and the socket/timeout errors under it.
NATS_ERRORS: tuple[type[BaseException], ...] = (nats.errors.Error, asyncio.TimeoutError, OSError)
# JetStream API answers that mean "try again later": 503 (no leader / cluster unavailable) and
# err_code 10008 (JetStream temporarily unavailable).
_UNAVAILABLE_API_CODES = frozenset({10008})

#: Ordered consumers notice a consumer lost with a node, or messages lost with a dropped
#: connection, after two missed idle heartbeats: short heartbeats bound how long a process misses
#: messages. A router cut from NATS for 3 s applied the first policy written after the link came
#: back in 0.95 s at 0.5 s, 0.45 s at 0.25 s. (0.25 s made test_full_disk_fleet fail until the
#: fleet view's watch restarts were understood and fixed: decisions 92-93.)
IDLE_HEARTBEAT_S = 0.25


def _api_unavailable(exc: APIError) -> bool:
    return exc.code == 503 or exc.err_code in _UNAVAILABLE_API_CODES


def _wrong_last_sequence(exc: BaseException) -> bool:
    return isinstance(exc, APIError) and exc.err_code in JS_ERRS_WRONG_LAST_SEQUENCE


def _translate(exc: BaseException, what: str) -> LogUnavailable:
    """The one mapping of a nats error to Rudder's error tree."""
    if isinstance(exc, APIError):
        if _api_unavailable(exc):
            return LogUnavailable(f"JetStream unavailable ({what}): {exc.description}", retry_after=5)
        return LogUnavailable(f"JetStream refused ({what}): {exc.description} (err_code {exc.err_code})",
                              retry_after=5, err_code=exc.err_code)
    return LogUnavailable(f"NATS did not answer ({what}): {type(exc).__name__}", retry_after=2)


@dataclass(frozen=True, slots=True)
class Message:
    """A message from the bus. ``seq``, ``stored_at`` and ``pending`` are set for JetStream
    messages (stream sequence, when the stream stored it, what the consumer still has to
    deliver after this one); ``headers`` is empty when there are none."""

    subject: str
    data: bytes
    headers: Mapping[str, str] = field(default_factory=dict)
    seq: int | None = None
    stored_at: datetime | None = None
    pending: int | None = None
    _raw: Any = field(default=None, repr=False, compare=False)

    @property
    def msg_id(self) -> str | None:
        return self.headers.get(HDR_MSG_ID)

    async def respond(self, data: bytes) -> None:
        """Answer a request (nothing when the sender asked for no reply)."""
        if self._raw is None or not self._raw.reply:
            return
        try:
            await self._raw.respond(data)
        except NATS_ERRORS as exc:
            raise _translate(exc, "respond") from exc

    async def ack(self) -> None:
        try:
            await self._raw.ack()
        except NATS_ERRORS as exc:
            raise _translate(exc, "ack") from exc

    async def nak(self, delay: float | None = None) -> None:
        try:
            await self._raw.nak(delay=delay)
        except NATS_ERRORS as exc:
            raise _translate(exc, "nak") from exc

    async def term(self) -> None:
        """Never deliver this message again (it can never be processed)."""
        try:
            await self._raw.term()
        except NATS_ERRORS as exc:
            raise _translate(exc, "term") from exc


def _delivered(msg: Msg) -> Message:
    """A message as a subscription delivers it (JetStream metadata when it has some)."""
    seq = stored_at = pending = None
    if msg.reply and msg.reply.startswith("$JS.ACK."):
        try:
            meta = msg.metadata
            seq, pending = int(meta.sequence.stream), int(meta.num_pending)
            stored_at = meta.timestamp if meta.timestamp.tzinfo is not None else None
        except (ValueError, AttributeError, IndexError):
            pass
    return Message(subject=msg.subject, data=msg.data or b"", headers=msg.headers or {}, seq=seq,
                   stored_at=stored_at, pending=pending, _raw=msg)


def _stored(raw: Any) -> Message:
    """A message read from a stream (direct get)."""
    return Message(subject=raw.subject, data=raw.data or b"", headers=raw.headers or {},
                   seq=int(raw.seq), stored_at=raw.time)


@dataclass(frozen=True, slots=True)
class CasResult:
    seq: int
    recovered: bool  # the ack was lost; the message was found on the stream by its msg id


@dataclass(frozen=True, slots=True)
class StreamState:
    created: datetime | None
    first_seq: int
    last_seq: int
    subjects: Mapping[str, int]  # only when asked for with a filter


@dataclass(frozen=True, slots=True)
class KvEntry:
    key: str
    value: bytes
    deleted: bool
    stored_at: datetime | None


Handler = Callable[[Message], Awaitable[None]]


class Subscription:
    """A core subscription or a push consumer; :meth:`stop` is safe on a bus that is gone."""

    def __init__(self, sub: Any) -> None:
        self._sub = sub

    async def nothing_to_replay(self) -> bool:
        """For a consumer: it has delivered nothing and has nothing pending (the stream holds no
        message for it). False when that cannot be told (the bus did not answer)."""
        try:
            info = await self._sub.consumer_info()
        except NATS_ERRORS:
            return False
        return bool(info.num_pending == 0 and (info.delivered is None or not info.delivered.consumer_seq))

    async def stop(self) -> None:
        try:
            await self._sub.unsubscribe()
        except NATS_ERRORS:
            pass


class PullConsumer:
    """A durable pull consumer (shared by every replica that binds it)."""

    def __init__(self, sub: Any) -> None:
        self._sub = sub

    async def fetch(self, batch: int, *, wait_s: float) -> list[Message]:
        """Up to ``batch`` messages; [] when none arrived within ``wait_s``."""
        try:
            msgs = await self._sub.fetch(batch, timeout=wait_s)
        except (TimeoutError, nats.errors.TimeoutError):
            return []
        except NATS_ERRORS as exc:
            raise _translate(exc, "fetch") from exc
        return [_delivered(m) for m in msgs]

    async def stop(self) -> None:
        """Leave the consumer (a durable stays on the server for the other replicas)."""
        try:
            await self._sub.unsubscribe()
        except NATS_ERRORS:
            pass


class KvWatch:
    def __init__(self, watcher: Any) -> None:
        self._watcher = watcher

    async def next(self, *, wait_s: float) -> KvEntry | None:
        """The next update; None for the marker after the initial values. Raises TimeoutError
        when nothing arrived within ``wait_s``, LogUnavailable when the bus failed."""
        try:
            entry = await self._watcher.updates(timeout=wait_s)
        except nats.errors.TimeoutError as exc:
            raise TimeoutError(f"no update within {wait_s:g} s") from exc
        except NATS_ERRORS as exc:
            raise _translate(exc, "watch") from exc
        if entry is None:
            return None
        created = entry.created if isinstance(entry.created, datetime) and entry.created.tzinfo else None
        return KvEntry(key=entry.key, value=entry.value or b"",
                       deleted=entry.operation in ("DEL", "PURGE") or not entry.value, stored_at=created)

    async def stop(self) -> None:
        try:
            await self._watcher.stop()
        except NATS_ERRORS:
            pass


class Bucket:
    """A JetStream key-value bucket."""

    def __init__(self, kv: Any, name: str) -> None:
        self._kv = kv
        self.name = name

    async def put(self, key: str, value: bytes) -> int:
        try:
            return int(await self._kv.put(key, value))
        except NATS_ERRORS as exc:
            raise _translate(exc, f"put {self.name}/{key}") from exc

    async def delete(self, key: str) -> None:
        try:
            await self._kv.delete(key)
        except NATS_ERRORS as exc:
            raise _translate(exc, f"delete {self.name}/{key}") from exc

    async def watch_all(self) -> KvWatch:
        try:
            return KvWatch(await self._kv.watchall())
        except NATS_ERRORS as exc:
            raise _translate(exc, f"watch {self.name}") from exc


class Bus:
    """One process's connection to NATS (see the module docstring)."""

    def __init__(self, nc: NATS, *, timeout_s: float = 2.0) -> None:
        self._nc = nc
        self.timeout_s = timeout_s
        self._js: JetStreamContext = nc.jetstream(timeout=timeout_s)
        # Direct reads that came back older than the caller knew (or missing), then read again
        # from the stream's leader: how often a replica behind the stream answered (see last()).
        self.behind_reads = 0

    @classmethod
    async def connect(cls, opts: BusOptions, *, timeout_s: float = 2.0) -> Bus:
        """Open the connection (:func:`bus.connect.connect`: raises ConfigurationError or
        LogUnavailable)."""
        return cls(await connect(opts), timeout_s=timeout_s)

    @property
    def nc(self) -> NATS:
        """The nats-py client, for code inside ``bus/`` and for tests."""
        return self._nc

    @property
    def connected(self) -> bool:
        return bool(self._nc.is_connected)

    @property
    def closed(self) -> bool:
        return bool(self._nc.is_closed)

    @property
    def max_payload(self) -> int:
        return int(self._nc.max_payload)

    async def _call(self, what: str, fn: Callable[[], Awaitable[T]]) -> T:
        if not self._nc.is_connected:
            raise LogUnavailable(f"NATS is not connected ({what})", retry_after=2)
        try:
            return await asyncio.wait_for(fn(), self.timeout_s + 0.5)
        except NATS_ERRORS as exc:
            raise _translate(exc, what) from exc

    # ---- lifecycle -----------------------------------------------------------------------

    async def wait_ready(self, layout: BusLayout, streams: list[str], *, timeout_s: float) -> None:
        """Wait for the streams the bus admin creates and check their settings
        (:func:`bus.streams.wait_ready`)."""
        await wait_ready(self._js, layout, streams, timeout_s=timeout_s)

    async def check_streams(self, layout: BusLayout, streams: list[str], *, timeout_s: float = 1.5) -> None:
        """Raise ConfigurationError when a stream is missing or differs from ``layout``
        (readiness), LogUnavailable when JetStream does not answer within ``timeout_s``."""
        js = self._nc.jetstream(timeout=max(timeout_s - 0.5, 0.5))
        for stream in streams:
            try:
                await asyncio.wait_for(check(js, layout, stream), timeout_s)
            except NATS_ERRORS as exc:
                raise _translate(exc, f"check {stream}") from exc

    async def flush(self, wait_s: float = 1.0) -> None:
        try:
            await self._nc.flush(timeout=wait_s)  # type: ignore[arg-type]
        except NATS_ERRORS as exc:
            raise _translate(exc, "flush") from exc

    async def close(self, *, drain_s: float | None = None) -> None:
        """Close (after draining subscriptions for up to ``drain_s``); never raises."""
        if self._nc.is_closed:
            return
        if drain_s is not None:
            try:
                await asyncio.wait_for(self._nc.drain(), timeout=drain_s)
            except Exception:
                pass
        try:
            await self._nc.close()
        except Exception:
            pass

    # ---- core NATS -----------------------------------------------------------------------

    async def publish(self, subject: str, data: bytes, headers: Mapping[str, str] | None = None) -> None:
        try:
            await self._nc.publish(subject, data, headers=dict(headers) if headers else None)
        except NATS_ERRORS as exc:
            raise _translate(exc, f"publish {subject}") from exc

    async def subscribe(self, subject: str, handler: Handler) -> Subscription:
        async def cb(msg: Msg) -> None:
            await handler(_delivered(msg))

        try:
            return Subscription(await self._nc.subscribe(subject, cb=cb))
        except NATS_ERRORS as exc:
            raise _translate(exc, f"subscribe {subject}") from exc

    async def request(self, subject: str, data: bytes = b"", *, wait_s: float) -> Message:
        try:
            msg = await self._nc.request(subject, data, timeout=wait_s)
        except NATS_ERRORS as exc:
            raise _translate(exc, f"request {subject}") from exc
        return Message(subject=msg.subject, data=msg.data or b"", headers=msg.headers or {})

    # ---- JetStream: writes ---------------------------------------------------------------

    async def store(self, subject: str, data: bytes, *, headers: Mapping[str, str] | None = None,
                    ack_wait_s: float | None = None) -> int:
        """Publish to the stream that holds ``subject`` and wait for its ack; the stream
        sequence. Raises LogUnavailable (stored or not: a retry with the same ``Nats-Msg-Id``
        header is stored once)."""
        try:
            ack = await self._js.publish(subject, data, timeout=ack_wait_s or self.timeout_s,
                                         headers=dict(headers) if headers else None)
        except NATS_ERRORS as exc:
            raise _translate(exc, f"store {subject}") from exc
        return int(ack.seq)

    async def publish_cas(self, stream: str, subject: str, data: bytes, *, expected_seq: int,
                          msg_id: str, headers: Mapping[str, str] | None = None) -> CasResult:
        """Publish only if the last message of ``subject`` is still ``expected_seq`` (0: none).

        Raises RevisionConflict (with the head's sequence), LogUnavailable (refused: nothing
        was stored) or LogAmbiguous (the outcome is unknown: a reconciler must decide)."""
        hdrs = {HDR_EXPECTED_LAST_SUBJECT_SEQ: str(expected_seq), HDR_MSG_ID: msg_id, **(headers or {})}
        if not self._nc.is_connected:
            raise LogUnavailable("NATS is not connected; nothing was published", retry_after=2)
        try:
            ack = await self._js.publish(subject, data, timeout=self.timeout_s, headers=hdrs)
            return CasResult(seq=int(ack.seq), recovered=False)
        except APIError as exc:
            if _api_unavailable(exc):
                raise LogAmbiguous(f"JetStream unavailable at publish: {exc.description}",
                                   retry_after=5) from exc
            if not _wrong_last_sequence(exc):
                raise _translate(exc, f"publish {subject}") from exc
            # CAS is checked before de-duplication: our own earlier attempt may be the head.
            # The leader's head: a replica's could predate our own attempt, or the head we lost to.
            head = await self.last(stream, subject, leader=True)
            if head is not None and head.msg_id == msg_id:
                return CasResult(seq=head.seq or 0, recovered=True)
            head_seq = (head.seq or 0) if head is not None else 0
            raise RevisionConflict(
                f"expected revision {expected_seq} but the head is {head_seq}",
                expected_revision=expected_seq, head_revision=head_seq,
            ) from exc
        except NATS_ERRORS as exc:
            # Unknown outcome: read back once; if that fails too, leave it to the reconciler.
            try:
                head = await self.last(stream, subject, leader=True)
            except LogUnavailable:
                raise LogAmbiguous(f"publish outcome unknown: {type(exc).__name__}", retry_after=2) from exc
            if head is not None and head.msg_id == msg_id:
                return CasResult(seq=head.seq or 0, recovered=True)
            raise LogAmbiguous(f"publish outcome unknown: {type(exc).__name__}", retry_after=2) from exc

    # ---- JetStream: reads ----------------------------------------------------------------

    # Reads come in two strengths. A *direct get* (``$JS.API.DIRECT.GET``) is answered by any
    # replica of the stream (and by mirrors): cheap, but a replica that has not yet applied the
    # newest writes answers without them (no read-your-writes; nats.docs#815, and seen here: 1 in
    # 5 direct reads right after an acknowledged publish missed it on a loaded 3-node cluster).
    # A *leader read* (``$JS.API.STREAM.MSG.GET``) is answered by the stream's leader, which
    # acknowledged every write. A stored message never changes, so a direct read can be wrong
    # only by what it lacks: a message it returns is right, a miss or an older head may be stale.
    # Each read below is direct first and asks the leader only when the answer could be stale
    # and it matters (docs/decisions.md 89).

    async def last(self, stream: str, subject: str, *, at_least: int = 0, leader: bool = False) -> Message | None:
        """The last message of ``subject``, or None when it has none. A direct get, read again
        from the stream's leader if it gives no message or one older than ``at_least`` (a
        revision the caller knows exists, or expects), or always from the leader with ``leader``."""
        async def go(direct: bool) -> Message | None:
            try:
                return _stored(await self._js.get_last_msg(stream, subject, direct=direct))
            except NotFoundError:
                return None

        if not leader:
            msg = await self._call(f"last {subject}", lambda: go(True))
            if msg is not None and (msg.seq or 0) >= at_least:
                return msg
            if msg is None and at_least <= 0:
                return None
            self.behind_reads += 1
        return await self._call(f"last {subject} (leader)", lambda: go(False))

    async def get(self, stream: str, seq: int, *, subject: str | None = None) -> Message | None:
        """The message at ``seq``, or with a ``subject``, the first of that subject at or after
        ``seq``; None when there is none. A direct get; a miss is confirmed by the leader (a
        replica behind the stream misses what it has not applied yet)."""
        async def go(direct: bool) -> Message | None:
            try:
                if subject is None:
                    return _stored(await self._js.get_msg(stream, seq=seq, direct=direct))
                return _stored(await self._js.get_msg(stream, seq=seq, subject=subject, next=True, direct=direct))
            except NotFoundError:
                return None

        found = await self._call(f"get {stream}#{seq}", lambda: go(True))
        if found is not None:
            return found
        found = await self._call(f"get {stream}#{seq} (leader)", lambda: go(False))
        self.behind_reads += found is not None
        return found

    async def messages(self, stream: str, subject: str) -> AsyncIterator[Message]:
        """Every retained message of ``subject`` (wildcards allowed), oldest first."""
        seq = 1
        while True:
            msg = await self.get(stream, seq, subject=subject)
            if msg is None or msg.seq is None:
                return
            yield msg
            seq = msg.seq + 1

    async def stream_state(self, stream: str, *, subjects: str | None = None) -> StreamState:
        """The stream's creation time and sequences (and message counts per subject matching
        ``subjects``). Raises LogUnavailable (also when the stream does not exist)."""
        async def go() -> StreamState:
            info = await self._js.stream_info(stream, subjects_filter=subjects)
            return StreamState(created=info.created, first_seq=int(info.state.first_seq or 0),
                               last_seq=int(info.state.last_seq or 0),
                               subjects=dict(info.state.subjects or {}))

        return await self._call(f"info {stream}", go)

    # ---- JetStream: consumers and buckets ------------------------------------------------

    async def ordered(self, stream: str, filters: list[str], handler: Handler, *,
                      idle_heartbeat_s: float = IDLE_HEARTBEAT_S) -> Subscription:
        """An ordered push consumer on ``stream`` over every subject in ``filters``, starting
        with the last message per subject (the current state), then live."""
        async def cb(msg: Msg) -> None:
            await handler(_delivered(msg))

        config = ConsumerConfig(filter_subjects=filters) if len(filters) > 1 else None
        try:
            sub = await self._js.subscribe(
                filters[0] if len(filters) == 1 else "", stream=stream, cb=cb, ordered_consumer=True,
                deliver_policy=DeliverPolicy.LAST_PER_SUBJECT, idle_heartbeat=idle_heartbeat_s,
                config=config,
            )
        except NATS_ERRORS as exc:
            raise _translate(exc, f"consume {stream}") from exc
        return Subscription(sub)

    async def durable(self, stream: str, subject: str, *, name: str, ack_wait_s: float,
                      max_ack_pending: int) -> PullConsumer:
        """Bind (creating it if needed) the durable pull consumer ``name``, from the start of
        the stream, explicit acks."""
        config = ConsumerConfig(
            durable_name=name, ack_policy=AckPolicy.EXPLICIT, deliver_policy=DeliverPolicy.ALL,
            ack_wait=ack_wait_s, filter_subject=subject, max_ack_pending=max_ack_pending,
        )
        try:
            return PullConsumer(await self._js.pull_subscribe(subject, durable=name, stream=stream, config=config))
        except NATS_ERRORS as exc:
            raise _translate(exc, f"consumer {name}") from exc

    async def bucket(self, name: str) -> Bucket:
        try:
            return Bucket(await self._js.key_value(name), name)
        except NATS_ERRORS as exc:
            raise _translate(exc, f"bucket {name}") from exc
