"""The worker agent: one engine on the bus (DESIGN §2, §6).

- Membership on JetStream (``RUDDER_MEMBERSHIP``, last state per worker): ``join`` when the engine
  is up, ``heartbeat`` every ``heartbeat_s`` with per-rank load, ``leave`` on graceful shutdown.
- KV events as core NATS publishes on ``rudder.kv.<model_key>.<instance_id>``. The engine reports
  cache changes synchronously; the agent numbers them there (``event_id`` 1, 2, ... per worker
  process) and a publisher task sends them in order.
- A responder on ``rudder.kvdump.<instance_id>`` answers with the full cache state and the last
  event id given out. Both are read in one synchronous section, so they agree; events numbered at
  or below ``last_event_id`` may still arrive after the reply and are already in it.

Entry points: :func:`serve` (async, until SIGTERM/SIGINT or ``stop``) and :func:`run`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import threading
from collections.abc import Callable

from bus.client import Bus, Message
from bus.streams import WORKER_STREAMS
from bus.tasks import Tasks
from controlplane.protocol.errors import RudderError
from controlplane.protocol.events import (
    KvDumpRank,
    KvDumpReply,
    KvEvent,
    MembershipEvent,
    MembershipOp,
    WorkerRecord,
    utcnow,
)
from controlplane.protocol.policy import CacheInput
from controlplane.protocol.subjects import kv_subject, kvdump_subject, membership_subject
from controlplane.telemetry import logs
from controlplane.telemetry.logs import configure_logging
from worker.engines.base import Engine, EngineInfo, KvData
from worker.settings import EngineKind, WorkerSettings

log = logging.getLogger(__name__)



def make_engine(settings: WorkerSettings) -> Engine:
    if settings.engine is EngineKind.MOCK:
        from worker.engines.mock.service import MockEngine

        return MockEngine(settings)
    from worker.engines.vllm import VllmEngine

    return VllmEngine(settings)


class Worker:
    """An engine plus its agent. ``async with Worker(settings) as w:`` serves until the block ends.

    Start order: NATS, stream, engine (HTTP up), ``join``, heartbeats. Stop order: ``leave`` (so
    routers stop sending), engine (in-flight requests drain), remaining KV events, NATS.
    """

    def __init__(self, settings: WorkerSettings, *, engine: Engine | None = None) -> None:
        self.settings = settings
        self.engine: Engine = engine if engine is not None else make_engine(settings)
        self.instance_id = settings.instance_id
        self.info: EngineInfo | None = None
        self.record: WorkerRecord | None = None
        self.last_event_id = 0
        # This process's stamp: its membership record's ``started_at``, carried by each KV event
        # and dump (schema 2) so that routers tell it from an earlier process under the same id.
        self.started_at = utcnow()
        self._bus: Bus | None = None
        self._kv_subject = kv_subject(settings.model, settings.instance_id)
        self._membership_subject = membership_subject(settings.model, settings.instance_id)
        self._kv_out: list[bytes] = []
        self._kv_ready = asyncio.Event()
        self._failed = asyncio.Event()
        self._tasks = Tasks(f"worker {settings.instance_id}", on_death=lambda _t, _e: self._failed.set())
        self._closing = False

    @property
    def url(self) -> str:
        if self.info is None:
            raise RuntimeError("the worker is not started")
        return self.info.url

    @property
    def failed(self) -> asyncio.Event:
        """Set when a background task died: the process should stop (and be restarted)."""
        return self._failed

    async def __aenter__(self) -> Worker:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    # -- lifecycle -------------------------------------------------------------------------

    async def start(self) -> None:
        """Connect, start the engine, join. Raises on any failure (after cleaning up)."""
        s = self.settings
        opts = s.bus_options(f"rudder-worker-{s.instance_id}")
        try:
            # Reconnect forever once connected, but fail start-up when NATS is not there at all.
            self._bus = await asyncio.wait_for(Bus.connect(opts), timeout=s.nats_connect_timeout_s)
        except (TimeoutError, RudderError) as exc:
            raise ConnectionError(
                f"cannot connect to NATS at {s.nats_url} (RUDDER_NATS_URL) within "
                f"{s.nats_connect_timeout_s:g} s"
            ) from exc
        try:
            await self._bus.wait_ready(s.bus_layout(worker_ttl_s=s.worker_ttl_s), WORKER_STREAMS,
                                       timeout_s=s.stream_wait_s)
            await self._bus.subscribe(kvdump_subject(s.instance_id), self._on_dump)
            self._tasks.spawn(self._publish_kv_events(), name="kv-publisher")
            self.info = await self.engine.start(self._on_kv)
            self.record = WorkerRecord(
                instance_id=s.instance_id, model=s.model, role=s.role, url=self.info.url,
                dp_size=self.info.dp_size, block_size=self.info.block_size,
                kv_total_blocks=self.info.kv_total_blocks,
                max_num_batched_tokens=self.info.max_num_batched_tokens,
                tokenizer=self.info.tokenizer, cache_tiers=[CacheInput.DEVICE],
                engine=self.info.engine, started_at=self.started_at, timing=self.info.timing,
            )
            await self._publish_membership(MembershipOp.JOIN)
            self._tasks.spawn(self._heartbeats(), name="heartbeats")
        except BaseException:
            await self._shutdown(leave=False)
            raise
        log.info("worker %d joined: model=%s role=%s url=%s dp_size=%d engine=%s",
                 s.instance_id, s.model, s.role.value, self.info.url, self.info.dp_size,
                 self.info.engine)

    async def stop(self) -> None:
        """Leave, drain the engine, flush KV events, close NATS. Safe to call twice."""
        await self._shutdown(leave=self.record is not None)

    async def _shutdown(self, *, leave: bool) -> None:
        if self._closing:
            return
        self._closing = True
        self._tasks.closing = True
        await self._tasks.cancel("heartbeats")
        if leave and self._bus is not None and self._bus.connected:
            try:
                await self._publish_membership(MembershipOp.LEAVE, ack_wait=2.0)
                log.info("worker %d left", self.instance_id)
            except Exception:
                log.warning("worker %d could not publish leave", self.instance_id, exc_info=True)
        try:
            await self.engine.stop()
        except Exception:
            log.exception("engine stop failed")
        self._kv_ready.set()  # let the publisher flush what the engine reported last
        await self._tasks.close(keep=lambda task: task.get_name() == "kv-publisher")
        if self._bus is not None:
            await self._bus.close(drain_s=2.0)

    # -- membership ------------------------------------------------------------------------

    async def _publish_membership(self, op: MembershipOp, *, ack_wait: float = 5.0) -> None:
        assert self._bus is not None and self.record is not None
        event = MembershipEvent(op=op, worker=self.record, load=self.engine.load(), at=utcnow())
        await self._bus.store(self._membership_subject, event.to_bytes(), ack_wait_s=ack_wait)

    async def _heartbeats(self) -> None:
        loop = asyncio.get_running_loop()
        period = self.settings.heartbeat_s
        next_at = loop.time() + period
        down = False  # the engine stopped serving: this worker left, until it serves again
        while True:
            await asyncio.sleep(max(next_at - loop.time(), 0))
            next_at = max(next_at + period, loop.time())
            op = MembershipOp.HEARTBEAT
            # An engine that died or hangs under this live agent (a CUDA error, a deadlock): the
            # worker leaves, so routers stop routing here at once (a silent worker would age out
            # only after their worker_stale_s, or up to their bus-outage grace when it is the only
            # one), and heartbeats stop; once the engine serves again it joins again.
            if not self.engine.healthy():
                if down:
                    continue
                log.warning("worker %d: engine not serving; leaving until it does", self.instance_id)
                op = MembershipOp.LEAVE
            elif down:
                log.info("worker %d: engine serving again; joining", self.instance_id)
                op = MembershipOp.JOIN
            try:
                await self._publish_membership(op, ack_wait=min(max(period, 0.5), 5.0))
                down = op is MembershipOp.LEAVE
            except Exception as exc:  # NATS away: keep trying (a leave or a join, at the next tick);
                log.warning("worker %d %s failed: %r", self.instance_id, op.value, exc)  # routers
                # expire a silent worker after their TTL

    # -- KV events -------------------------------------------------------------------------

    def _on_kv(self, dp_rank: int, data: KvData, tier: CacheInput = CacheInput.DEVICE) -> None:
        self.last_event_id += 1
        event = KvEvent(instance_id=self.instance_id, dp_rank=dp_rank, event_id=self.last_event_id,
                        tier=tier, data=data, started_at=self.started_at)
        self._kv_out.append(event.to_bytes())
        self._kv_ready.set()

    async def _publish_kv_events(self) -> None:
        assert self._bus is not None
        bus = self._bus
        while True:
            await self._kv_ready.wait()
            self._kv_ready.clear()
            batch, self._kv_out = self._kv_out, []
            for payload in batch:
                try:
                    await bus.publish(self._kv_subject, payload)
                except RudderError as exc:  # a gap: routers notice it and ask for a dump
                    log.warning("worker %d dropped a KV event: %s", self.instance_id, exc.message)
            if self._closing and not self._kv_out:
                with contextlib.suppress(RudderError):
                    await bus.flush(2)
                return

    def dump(self) -> KvDumpReply:
        """The full cache state and the last event id, taken together (no await in between)."""
        ranks = self.engine.dump()
        return KvDumpReply(instance_id=self.instance_id, last_event_id=self.last_event_id,
                           ranks=ranks, partial=self.engine.partial_view, started_at=self.started_at)

    async def _on_dump(self, msg: Message) -> None:
        reply = self.dump()
        payload = reply.to_bytes()
        limit = self._bus.max_payload if self._bus is not None else len(payload)
        if len(payload) > limit:
            payload = _truncate_dump(reply, limit).to_bytes()
        log.info("worker %d kv dump: %d blocks, last_event_id=%d", self.instance_id,
                 sum(len(r.blocks) for r in reply.ranks), reply.last_event_id)
        await msg.respond(payload)


def _truncate_dump(reply: KvDumpReply, limit: int) -> KvDumpReply:
    """Fit a dump into one NATS message by dropping the deepest blocks; marked ``partial``.

    Blocks are listed parents first, so cutting each rank's tail keeps every listed block's
    parent listed. The router sees ``partial`` and can rely on later events for the rest.
    """
    size = len(reply.to_bytes())
    keep = 1.0
    ranks: list[KvDumpRank] = list(reply.ranks)
    while size > limit and keep > 0.01:
        keep *= max(min(limit / size, 0.95), 0.1)
        ranks = [r.model_copy(update={"blocks": r.blocks[: int(len(r.blocks) * keep)]})
                 for r in reply.ranks]
        size = len(reply.model_copy(update={"ranks": ranks}).to_bytes())
    log.warning("kv dump of %d bytes exceeds max_payload %d: sent %.0f%% of the blocks",
                len(reply.to_bytes()), limit, keep * 100)
    return reply.model_copy(update={"ranks": ranks, "partial": True})


# -- entry points ---------------------------------------------------------------------------


async def serve(
    settings: WorkerSettings,
    *,
    stop: asyncio.Event | None = None,
    on_ready: Callable[[Worker], None] | None = None,
) -> None:
    """Run one worker until SIGTERM/SIGINT (main thread only) or ``stop`` is set.

    Raises whatever prevents start-up (NATS unreachable, port in use, engine failure); returns
    after a graceful ``leave``. ``on_ready`` is called once the worker has joined.
    """
    stop = stop if stop is not None else asyncio.Event()
    logs.bind(worker_id=settings.instance_id, model=settings.model)  # this task and those it starts
    loop = asyncio.get_running_loop()
    installed: list[signal.Signals] = []
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGINT):
            with contextlib.suppress(NotImplementedError, RuntimeError):
                loop.add_signal_handler(sig, stop.set)
                installed.append(sig)
    try:
        async with Worker(settings) as worker:
            if on_ready is not None:
                on_ready(worker)
            stopped = asyncio.create_task(stop.wait())
            failed = asyncio.create_task(worker.failed.wait())
            await asyncio.wait({stopped, failed}, return_when=asyncio.FIRST_COMPLETED)
            for task in (stopped, failed):
                task.cancel()
            if worker.failed.is_set():
                log.error("worker %d stops after a background task failed", worker.instance_id)
    finally:
        for sig in installed:
            loop.remove_signal_handler(sig)


def run(settings: WorkerSettings) -> None:
    """Blocking entry point for ``rudder serve worker``: configure logging, serve until signal."""
    configure_logging(settings.log_level)
    asyncio.run(serve(settings))
