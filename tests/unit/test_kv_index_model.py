"""The router's prefix index against a model of one worker, explored by hypothesis: whatever the
order of KV events, lost events, restarts under the same instance id, late events of a dead
process, dumps answered late, stale, by another process or not at all, and a small buffer that
overflows while a dump is on its way, once the bus is quiet (every event delivered, every dump
asked for answered) the router's index holds exactly the blocks the live process holds; and a
worker's events are buffered only while a dump is asked for.

The worker, the wire and the dump exchange are modelled here; the scheduler and the index are the
router's own (``Scheduler._dispatch``, no network). The dump exchange follows
``router.consumers.KvDumper``: a dump asked for while one is on its way marks that one stale, and
a reply the scheduler answers "ask again" is asked for again, ``KvDumper.MAX_ASKS`` times in a
row unless a stale reply restarts the count; then a last hand-over (``final``).

What it found when it was written (docs/decisions.md 121): a gap whose dump never came stayed a
hole for good (the buffer was replayed, the next ids followed on), and a count of asks that a
restart did not reset gave up on the new process's dump. A hole in the buffer (an event lost
while the dump was pending), which was only logged, it covers too. Its ``resume`` step (events
between the scheduler's answer and the dumper's next step) found a race in the first version of
the fix: a dump asked for in that window was never asked for."""

from __future__ import annotations

import itertools
import random
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from controlplane.protocol.events import (
    KvDumpRank,
    KvDumpReply,
    KvEvent,
    KvRemoved,
    KvStored,
    MembershipEvent,
    MembershipOp,
    RouterRole,
    StoredBlock,
    WorkerRecord,
)
from controlplane.protocol.policy import ALL_CACHE_INPUTS, PolicyKind, startup_values
from router.commands import ApplyKvEvents, ApplyMembership, LoadKvDump
from router.consumers import KvDumper
from router.discovery import Change
from router.scheduler import Scheduler
from router.settings import RoutingMode
from tests.policy_keys import session_keys

WID = 7
T0 = datetime(2026, 12, 3, 12, 0, tzinfo=UTC)


@dataclass
class Process:
    """One worker process under instance id WID: its blocks, its event ids, its events on the
    wire (in order: one connection), and whether the router has been told of it (its join)."""

    started_at: datetime
    blocks: set[int] = field(default_factory=set)
    last_event_id: int = 0
    wire: list[KvEvent] = field(default_factory=list)

    def emit(self, data: KvStored | KvRemoved) -> None:
        self.last_event_id += 1
        self.wire.append(KvEvent(instance_id=WID, event_id=self.last_event_id, data=data,
                                 started_at=self.started_at))

    def dump(self) -> KvDumpReply:
        blocks = [(None, h, h) for h in sorted(self.blocks)]
        return KvDumpReply(instance_id=WID, last_event_id=self.last_event_id, started_at=self.started_at,
                           ranks=[KvDumpRank(blocks=blocks)] if blocks else [])


def _record(started_at: datetime) -> WorkerRecord:
    return WorkerRecord(instance_id=WID, model="m", url="http://w", block_size=4, kv_total_blocks=10_000,
                        max_num_batched_tokens=64, started_at=started_at)


class IndexModel(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        startup = {k: startup_values(k) for k in PolicyKind}
        self.s = Scheduler(
            router_id="r-model", models=["m"], role=RouterRole.AGGREGATED, mode=RoutingMode.KV_BLOCKS,
            kv_events=True, cache_inputs=ALL_CACHE_INPUTS, startup=startup, worker_ttl_s=1e9,
            worker_stale_s=1e9, rng=random.Random(1), keyring=session_keys().keyring,
        )
        self.s.index.max_buffered = 3  # small, so that it overflows while a dump is on its way
        self.hashes = itertools.count(1)
        self.seen: set[int] = set()  # every hash any process ever stored
        self.live = Process(T0)
        self.dead: list[Process] = []  # earlier processes whose events may still arrive
        self.joined = False  # the live process's join applied
        # The dump exchange (KvDumper's state for WID). ``resuming``: the scheduler has answered
        # and the dumper's task has not run since (events may come in between).
        self.inflight = False
        self.stale = False
        self.asks = 0
        self.resuming = False

    # -- the dump exchange, as KvDumper runs it ---------------------------------------------

    def request_dump(self) -> None:
        if self.inflight:
            self.stale = True
        else:
            self.inflight, self.stale, self.asks = True, False, 0

    def hand(self, reply: KvDumpReply | None) -> None:
        stale, self.stale = self.stale, False
        if not self.s._dispatch(LoadKvDump(WID, reply, stale=stale)):
            self.resuming = True
            return
        self.asks = 0 if stale else self.asks + 1
        if self.asks >= KvDumper.MAX_ASKS:
            assert self.s._dispatch(LoadKvDump(WID, None, final=True)) is False
            self.resuming = True

    @precondition(lambda self: self.resuming)
    @rule()
    def resume(self) -> None:
        """The dumper's task runs again after a hand-over that needs no other dump: it ends,
        unless it was asked again meanwhile."""
        self.resuming = False
        if self.stale:
            self.stale, self.asks = False, 0
        else:
            self.inflight = False

    def deliver(self, process: Process) -> None:
        event = process.wire.pop(0)
        need = self.s._dispatch(ApplyKvEvents([event]))
        if WID in need:
            self.request_dump()

    # -- the worker -------------------------------------------------------------------------

    @rule(n=st.integers(1, 3))
    def store(self, n: int) -> None:
        hashes = [next(self.hashes) for _ in range(n)]
        self.live.blocks.update(hashes)
        self.seen.update(hashes)
        self.live.emit(KvStored(blocks=[StoredBlock(block_hash=h, tokens_hash=h) for h in hashes]))

    @precondition(lambda self: self.live.blocks)
    @rule(data=st.data())
    def remove(self, data: st.DataObject) -> None:
        h = data.draw(st.sampled_from(sorted(self.live.blocks)))
        self.live.blocks.discard(h)
        self.live.emit(KvRemoved(block_hashes=[h]))

    @rule()
    def restart(self) -> None:
        """Killed (no leave) and started again under the same id: empty cache, ids from 1."""
        self.dead.append(self.live)
        self.live = Process(self.live.started_at + timedelta(seconds=1))
        self.joined = False

    # -- the bus ------------------------------------------------------------------------------

    @precondition(lambda self: not self.joined)
    @rule()
    def join(self) -> None:
        change = self.s._dispatch(ApplyMembership(MembershipEvent(
            op=MembershipOp.JOIN, worker=_record(self.live.started_at), at=T0)))
        assert change in (Change.JOINED, Change.RESTARTED)
        self.joined = True
        self.request_dump()

    @precondition(lambda self: self.live.wire)
    @rule()
    def deliver_live(self) -> None:
        self.deliver(self.live)

    @precondition(lambda self: any(p.wire for p in self.dead))
    @rule(data=st.data())
    def deliver_late(self, data: st.DataObject) -> None:
        """An event of a dead process, late (its subscription lagged)."""
        process = data.draw(st.sampled_from([p for p in self.dead if p.wire]))
        self.deliver(process)

    @precondition(lambda self: self.live.wire)
    @rule()
    def lose(self) -> None:
        """A core NATS message lost on the way (a gap)."""
        self.live.wire.pop(0)

    @precondition(lambda self: self.inflight and not self.resuming)
    @rule(answer=st.sampled_from(["live", "dead", "none"]))
    def answer_dump(self, answer: str) -> None:
        """The dump comes back: from the live process, from a dead one (it answered before it
        died, the reply late), or not at all (a timeout)."""
        if answer == "dead" and self.dead:
            self.hand(self.dead[-1].dump())
        elif answer == "none":
            self.hand(None)
        else:
            self.hand(self.live.dump())

    # -- the property -------------------------------------------------------------------------

    def held(self) -> set[int]:
        return {h for h in self.seen if (WID, 0) in self.s.index.overlaps([h])}

    def settle(self) -> None:
        """The bus goes quiet: the live process joins (if it has not), every late event arrives,
        one more event follows the last (a lost last event shows as a gap only then), and every
        dump asked for is answered by the live process."""
        if not self.joined:
            self.join()
        for process in self.dead:
            while process.wire:
                self.deliver(process)
        self.store(1)
        for _ in range(100):
            while self.live.wire:
                self.deliver(self.live)
            if self.resuming:
                self.resume()
            if not self.inflight:
                break
            self.hand(self.live.dump())
        assert not self.inflight and not self.s.index.dump_pending(WID)

    @invariant()
    def a_pending_dump_is_asked_for(self) -> None:
        """Events are buffered only while a dump is on its way: else they would wait for good."""
        assert self.inflight or not self.s.index.dump_pending(WID)

    def teardown(self) -> None:
        self.settle()
        assert self.held() == self.live.blocks


IndexModel.TestCase.settings = settings(max_examples=300, stateful_step_count=40, deadline=None,
                                        suppress_health_check=[HealthCheck.too_slow])
test_the_index_converges_to_the_live_process_s_blocks = pytest.mark.timeout(300)(IndexModel.TestCase)
