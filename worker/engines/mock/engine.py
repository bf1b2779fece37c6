"""The mock engine's asyncio side: one loop per dp rank driving its pure scheduler in time.

Each rank sleeps for its step's modelled duration (catching up small timer overshoots so the
long-run rate follows the model), hands sampled tokens to waiting requests, and passes the block
pool's KV events to the agent's sink in order.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from bus.tasks import Tasks
from controlplane.protocol.events import KvDumpRank, RankLoad, WorkerRole
from controlplane.protocol.hashing import block_hashes
from worker.engines.base import KvSink
from worker.engines.mock.blocks import BlockPool
from worker.engines.mock.scheduler import Scheduler, Seq, output_token
from worker.engines.mock.timing import TimingModel
from worker.settings import MockEngineSettings

log = logging.getLogger(__name__)

# A step that ends later than this behind schedule restarts the clock instead of catching up.
_MAX_CATCH_UP_S = 0.05


class EngineStopped(RuntimeError):
    """The engine stopped (or a rank loop died) before the request finished."""


class RequestRejected(ValueError):
    """A request this engine cannot run; ``param`` names the offending field."""

    def __init__(self, message: str, *, param: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(eq=False, slots=True)
class RequestHandle:
    """What a request's HTTP handler reads: tokens as they are sampled, then ``finished``."""

    seq: Seq
    rank: int
    tokens: list[int] = field(default_factory=list)
    finished: bool = False
    error: BaseException | None = None
    changed: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def cached_tokens(self) -> int:
        return self.seq.cached_tokens

    @property
    def prompt_tokens(self) -> int:
        return self.seq.prompt_len


class RankEngine:
    """One dp rank: a block pool, a scheduler and the loop that runs it."""

    def __init__(
        self, rank: int, settings: MockEngineSettings, timing: TimingModel, kv_sink: KvSink,
        token_source: Callable[[int], int] = output_token,
    ) -> None:
        self.rank = rank
        self.pool = BlockPool(num_blocks=settings.num_blocks, block_size=settings.block_size)
        self.scheduler = Scheduler(
            pool=self.pool, timing=timing, max_num_seqs=settings.max_num_seqs,
            max_num_batched_tokens=settings.max_num_batched_tokens, token_source=token_source,
        )
        self._kv_sink = kv_sink
        self._handles: dict[Seq, RequestHandle] = {}
        self._wake = asyncio.Event()
        self.steps = 0

    def submit(self, request_id: str, prompt: Sequence[int], *, max_tokens: int,
               remote_prefill: bool = False) -> RequestHandle:
        """Queue a request; raises RequestRejected when it can never fit."""
        try:
            seq = self.scheduler.add(request_id, prompt, max_tokens=max_tokens,
                                     remote_prefill=remote_prefill)
        except ValueError as exc:
            raise RequestRejected(str(exc), param="prompt") from None
        handle = RequestHandle(seq, self.rank)
        self._handles[seq] = handle
        self._wake.set()
        return handle

    def abort(self, handle: RequestHandle) -> None:
        if self._handles.pop(handle.seq, None) is not None:
            self.scheduler.abort(handle.seq)
            self._flush_events()

    def reset_prefix_cache(self) -> bool:
        ok = self.pool.reset()
        self._flush_events()
        return ok

    def load(self) -> RankLoad:
        snap = self.scheduler.load()
        return RankLoad(
            dp_rank=self.rank, active_decode_blocks=snap.active_decode_blocks,
            active_prefill_tokens=snap.active_prefill_tokens, kv_used_blocks=snap.kv_used_blocks,
            running=snap.running, waiting=snap.waiting,
        )

    def dump(self) -> KvDumpRank:
        return KvDumpRank(dp_rank=self.rank, blocks=self.pool.dump())

    def fail_all(self, exc: BaseException) -> None:
        for handle in self._handles.values():
            handle.error = exc
            handle.changed.set()
        self._handles.clear()

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        sched = self.scheduler
        deadline = loop.time()
        try:
            while True:
                if not sched.has_work:
                    self._wake.clear()
                    await self._wake.wait()
                    deadline = loop.time()
                    continue
                batch = sched.schedule()
                self._flush_events()
                if not batch:
                    self._wake.clear()
                    await self._wake.wait()
                    continue
                now = loop.time()
                if now - deadline > _MAX_CATCH_UP_S:
                    deadline = now
                deadline += batch.duration_ms / 1000.0
                delay = deadline - loop.time()
                await asyncio.sleep(delay if delay > 0 else 0)
                self.steps += 1
                for out in sched.complete(batch):
                    handle = self._handles.get(out.seq)
                    if handle is None:
                        continue
                    handle.tokens.append(out.token)
                    if out.finished:
                        handle.finished = True
                        del self._handles[out.seq]
                    handle.changed.set()
        except asyncio.CancelledError:
            self.fail_all(EngineStopped("the engine is stopping"))
            raise
        except BaseException as exc:
            log.exception("dp rank %d loop died", self.rank)
            self.fail_all(EngineStopped(f"dp rank {self.rank} failed: {exc!r}"))
            raise

    def _flush_events(self) -> None:
        for data in self.pool.drain_events():
            self._kv_sink(self.rank, data)


class MockCore:
    """All dp ranks of one mock engine, and the role-specific request path."""

    def __init__(self, settings: MockEngineSettings, *, dp_size: int, role: WorkerRole,
                 kv_sink: KvSink, token_source: Callable[[int], int] = output_token) -> None:
        self.settings = settings
        self.role = role
        self.timing = TimingModel.from_settings(settings)
        self.ranks = [RankEngine(r, settings, self.timing, kv_sink, token_source) for r in range(dp_size)]
        self._ids = itertools.count(1)
        # A rank that dies stops the engine: /health turns 503 (the traceback is logged).
        self._tasks = Tasks("mock engine", on_death=lambda _task, _exc: self._died())
        self.stopped = False

    def start(self) -> None:
        for rank in self.ranks:
            self._tasks.spawn(rank.run(), name=f"mock-rank-{rank.rank}")

    async def stop(self) -> None:
        self.stopped = True
        await self._tasks.close()

    def _died(self) -> None:
        self.stopped = True

    def pick_rank(self, requested: int | None) -> RankEngine:
        """The named rank, else the least busy one. Raises RequestRejected when out of range."""
        if requested is not None:
            if not 0 <= requested < len(self.ranks):
                raise RequestRejected(
                    f"dp_rank={requested} is out of range (this worker has {len(self.ranks)})",
                    param="dp_rank",
                )
            return self.ranks[requested]
        return min(self.ranks, key=lambda r: len(r.scheduler.running) + len(r.scheduler.waiting))

    async def submit(self, prompt: Sequence[int], *, max_tokens: int,
                     dp_rank: int | None) -> RequestHandle:
        """Start a request with the role's semantics. Raises RequestRejected, EngineStopped."""
        if self.stopped:
            raise EngineStopped("the engine is stopping")
        if len(prompt) + max_tokens > self.settings.max_model_len:
            raise RequestRejected(
                f"prompt ({len(prompt)} tokens) + max_tokens ({max_tokens}) exceeds "
                f"max_model_len {self.settings.max_model_len}", param="max_tokens",
            )
        rank = self.pick_rank(dp_rank)
        request_id = f"req-{next(self._ids)}"
        if self.role is WorkerRole.PREFILL:
            return rank.submit(request_id, prompt, max_tokens=1)
        if self.role is WorkerRole.DECODE:
            # Receive the prompt's KV from the prefill worker: the blocks not cached here travel.
            bs = rank.pool.block_size
            local = rank.pool.match(block_hashes(prompt, bs))
            await asyncio.sleep(self.timing.kv_transfer_ms(-(-len(prompt) // bs) - local) / 1000)
            if self.stopped:
                raise EngineStopped("the engine is stopping")
            return rank.submit(request_id, prompt, max_tokens=max_tokens, remote_prefill=True)
        return rank.submit(request_id, prompt, max_tokens=max_tokens)

    def abort(self, handle: RequestHandle) -> None:
        self.ranks[handle.rank].abort(handle)

    def reset_prefix_cache(self) -> bool:
        return all([rank.reset_prefix_cache() for rank in self.ranks])

    def load(self) -> list[RankLoad]:
        return [rank.load() for rank in self.ranks]

    def dump(self) -> list[KvDumpRank]:
        return [rank.dump() for rank in self.ranks]
