"""The scheduler actor without a network: ordering, skipping, draining, targets."""

from __future__ import annotations

import asyncio
import itertools
import json
import random
import time
import uuid
from datetime import UTC, datetime, timedelta

import pytest

from controlplane.protocol.errors import InvalidRequest, Overloaded, ServiceUnavailable
from controlplane.protocol.events import (
    KvDumpRank,
    KvDumpReply,
    KvEvent,
    KvStored,
    MembershipEvent,
    MembershipOp,
    RankLoad,
    RouterRole,
    StoredBlock,
    WorkerRecord,
    WorkerRole,
)
from controlplane.protocol.policy import ALL_CACHE_INPUTS, PolicyKind, startup_values
from router.commands import (
    PREFILL_BOOKING,
    ApplyKvEvents,
    ApplyMembership,
    ApplyPolicy,
    Inspect,
    LoadKvDump,
    MarkUnavailable,
    Phase,
    RequestDone,
    RequestFirstToken,
    RoutingRequest,
    SelectWorker,
    Tick,
)
from router.discovery import Change
from router.scheduler import Scheduler
from router.settings import RoutingMode
from router.targets import parse_pin, parse_targets
from tests.policy_keys import session_keys

pytestmark = pytest.mark.timeout(20)


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def _sched(clock: Clock, mode: RoutingMode = RoutingMode.KV, models: tuple[str, ...] = ("m",)) -> Scheduler:
    now = datetime.now(UTC)
    startup = {k: startup_values(k) for k in PolicyKind}
    return Scheduler(
        router_id="r-test", models=list(models), role=RouterRole.AGGREGATED, mode=mode, kv_events=True,
        cache_inputs=ALL_CACHE_INPUTS, startup=startup, worker_ttl_s=10, worker_stale_s=3,
        clock=clock, wall=lambda: now, rng=random.Random(1), keyring=session_keys().keyring,
    )


def _join(wid: int, *, dp: int = 1, load: list[RankLoad] | None = None) -> MembershipEvent:
    rec = WorkerRecord(instance_id=wid, model="m", url=f"http://w{wid}", dp_size=dp, block_size=4,
                       kv_total_blocks=100, max_num_batched_tokens=64, started_at=datetime.now(UTC))
    return MembershipEvent(op=MembershipOp.JOIN, worker=rec, load=load or [], at=datetime.now(UTC))


def _req(i: int, **kw: object) -> RoutingRequest:
    return RoutingRequest(request_id=f"q{i}", model="m", prompt_tokens=16, hashes={}, **kw)  # type: ignore[arg-type]


def _signed(payload: bytes) -> dict[str, str]:
    return session_keys().headers_for("m", PolicyKind.SELECTION, payload)


def _policy(doc: dict[str, float], expected: int) -> bytes:
    return json.dumps({
        "event_id": str(uuid.uuid4()), "model": "m", "kind": "selection", "op": "patch",
        "expected_revision": expected, "changes": doc, "document": doc, "actor": "t",
        "request_id": "q", "at": datetime.now(UTC).isoformat(),
    }).encode()


async def test_policy_lands_between_queued_selections() -> None:
    s = _sched(Clock())
    for wid in (1, 2, 3):
        s.send(ApplyMembership(_join(wid)))
    before = [s.submit(SelectWorker(_req(i))) for i in range(200)]
    payload = _policy({"router_temperature": 0.3}, 0)
    applied = s.submit(ApplyPolicy("m", PolicyKind.SELECTION, 7, payload, _signed(payload)))
    after = [s.submit(SelectWorker(_req(1000 + i))) for i in range(200)]
    s.start()
    try:
        res_before = await asyncio.gather(*before)
        res_after = await asyncio.gather(*after)
        ack = await applied
    finally:
        await s.stop()
    assert ack.result.outcome.value == "ACK"
    assert all(r.revisions["selection"] == 0 and r.seq < ack.seq for r in res_before)
    assert all(r.revisions["selection"] == 7 and r.seq > ack.seq for r in res_after)


async def test_cancelled_selection_is_skipped_and_books_nothing() -> None:
    s = _sched(Clock())
    s.send(ApplyMembership(_join(1)))
    gone = s.submit(SelectWorker(_req(1)))
    gone.cancel()
    kept = s.submit(SelectWorker(_req(2)))
    s.start()
    try:
        sel = await kept
        assert sel.request_id == "q2"
        assert await s.inspect(lambda x: len(x.bookings)) == 1
        assert s.stats["skipped"] == 1
    finally:
        await s.stop()


async def test_the_actor_handles_a_turn_of_commands_then_lets_others_run() -> None:
    """Queued commands are handled for up to _TURN_S a turn of the loop (not one a turn: a task
    step per command cost the router a share of its CPU per request), and the loop runs others
    between turns (HTTP and NATS do not wait for a long queue to empty); a command that alone
    takes longer than a turn gets a turn of its own."""
    s = _sched(Clock())
    s.send(ApplyMembership(_join(1)))
    futs = [s.submit(SelectWorker(_req(i))) for i in range(300)]
    slow = [s.submit(Inspect(lambda _: time.sleep(0.002))) for _ in range(5)]  # 4x a turn each
    s.start()
    seen: list[tuple[int, int]] = []

    async def watch() -> None:
        while not slow[-1].done():
            seen.append((sum(f.done() for f in futs), sum(f.done() for f in slow)))
            await asyncio.sleep(0)

    watcher = asyncio.create_task(watch())
    try:
        await asyncio.gather(*futs, *slow)
        await watcher
    finally:
        await s.stop()
    steps = list(itertools.pairwise(seen))
    fast = [b[0] - a[0] for a, b in steps if b[0] > a[0]]
    assert max(fast) > 1, fast  # several selections a turn
    assert len(fast) > 1  # and others ran between the turns
    assert all(b[1] - a[1] <= 1 for a, b in steps)  # one slow command a turn
    assert sum(1 for a, b in steps if b[1] > a[1]) >= 4


async def test_liveness_commands_go_ahead_of_queued_requests_and_policy_keeps_its_place() -> None:
    """A worker's membership or its being unreachable is handled before the requests' commands
    queued ahead of it (a backlog of requests must not age a worker's heartbeat, decision 107);
    everything else in the order sent (a policy revision's place: the test above)."""
    s = _sched(Clock())
    s.send(ApplyMembership(_join(1)))
    order: list[int] = []

    def look(x: Scheduler, i: int) -> tuple[list[int], bool]:
        order.append(i)
        return sorted(x.discovery.workers), x.discovery.workers[1].unreachable

    futs = [s.submit(Inspect(lambda x, i=i: look(x, i))) for i in range(3)]
    s.send(MarkUnavailable(1))
    joined = s.submit(ApplyMembership(_join(2)))
    s.start()
    try:
        seen = await asyncio.gather(*futs)
        await joined
        assert seen == [([1, 2], True)] * 3  # the join and the mark went ahead of all three
        assert order == [0, 1, 2]
    finally:
        await s.stop()


async def test_a_backlogged_actor_takes_as_long_a_turn_as_the_rest_of_the_loop() -> None:
    """While commands wait, a turn of the actor lasts as long as the rest of the event loop took
    since its last one (up to _TURN_MAX_S), not a fixed _TURN_S: with thousands of connections
    the loop's other callbacks take far longer than _TURN_S, and the actor, left a sliver of the
    loop, fell behind by thousands of commands a second (decision 107). A fake clock: each
    command takes 0.1 ms, the rest of the loop 3 ms (then 30 ms) a round."""
    now = [0.0]

    def command(_: Scheduler) -> None:
        now[0] += 0.0001

    async def per_turn(others_s: float) -> list[int]:
        s = _sched(Clock())
        s.turn_clock = lambda: now[0]
        futs = [s.submit(Inspect(command)) for _ in range(1500)]
        s.start()
        done: list[int] = []
        try:
            while not futs[-1].done():
                done.append(sum(f.done() for f in futs))
                now[0] += others_s  # the loop's other callbacks of this round
                await asyncio.sleep(0)
        finally:
            await s.stop()
        return [b - a for a, b in itertools.pairwise(done) if b > a]

    idle = await per_turn(0.0)
    busy = await per_turn(0.003)
    flooded = await per_turn(0.03)
    assert max(idle) <= 6  # _TURN_S (0.5 ms): 5 commands, and the one that crosses it
    assert 25 <= sorted(busy)[len(busy) // 2] <= 31  # as long as the loop's other 3 ms
    assert 95 <= sorted(flooded)[len(flooded) // 2] <= 101  # capped at _TURN_MAX_S (10 ms)


async def test_a_command_sent_to_an_idle_actor_is_handled_at_once_else_queued_in_order() -> None:
    s = _sched(Clock(), RoutingMode.LEAST_LOADED)
    s.send(ApplyMembership(_join(1)))  # not started: queued
    assert s.queue_depth == 1
    s.start()
    try:
        sel = await s.select(_req(1))
        assert s.queue_depth == 0
        s.send(RequestDone("q1"))  # idle: handled before send returns
        assert len(s.bookings) == 0
        sel = await s.select(_req(2))
        queued = s.submit(SelectWorker(_req(3)))  # a selection waits: the completion goes behind it
        s.send(RequestDone(sel.booking_id))
        assert s.queue_depth == 2 and len(s.bookings) == 1
        await queued
        assert await s.inspect(lambda x: ("q3" in x.bookings, len(x.bookings))) == (True, 1)
    finally:
        await s.stop()


async def test_a_selection_is_made_by_its_caller_only_when_the_actor_is_idle() -> None:
    s = _sched(Clock(), RoutingMode.LEAST_LOADED)
    s.send(ApplyMembership(_join(1)))
    assert s.select_now(_req(0)) is None  # not started: the queue holds a command
    s.start()
    try:
        await s.inspect(lambda x: None)  # the join is handled
        sel = s.select_now(_req(1))  # idle: made before the call returns, booked as submit's
        assert sel is not None and sel.instance_id == 1 and s.queue_depth == 0
        assert len(s.bookings) == 1 and s.stats["selections"] == 1
        queued = s.submit(SelectWorker(_req(2)))  # a command waits: a selection goes behind it
        assert s.select_now(_req(3)) is None
        await queued
        with pytest.raises(InvalidRequest):  # what a selection raises, raised to the caller
            s.select_now(_req(4)._replace(model="not/served"))
    finally:
        await s.stop()
    assert s.select_now(_req(5)) is None  # stopped: submit answers it (refused)


async def test_stop_answers_every_waiter() -> None:
    s = _sched(Clock())
    futs = [s.submit(SelectWorker(_req(i))) for i in range(5)]
    await s.stop()
    for f in futs:
        with pytest.raises(ServiceUnavailable):
            await f
    with pytest.raises(ServiceUnavailable):
        s.submit(SelectWorker(_req(9)))


async def test_bookings_released_and_freed_through_the_actor() -> None:
    s = _sched(Clock(), RoutingMode.LEAST_LOADED)
    s.send(ApplyMembership(_join(1)))
    s.send(ApplyMembership(_join(2)))
    s.start()
    try:
        a = await s.select(_req(1))
        b = await s.select(_req(2))
        assert {a.instance_id, b.instance_id} == {1, 2}  # least loaded spreads
        s.send(RequestFirstToken("q1"))
        s.send(RequestDone("q1"))
        s.send(RequestDone("q2"))
        assert await s.inspect(lambda x: len(x.bookings)) == 0
    finally:
        await s.stop()


async def test_all_busy_is_overloaded_and_stale_is_unavailable() -> None:
    clock = Clock()
    s = _sched(clock)
    s.send(ApplyMembership(_join(1, load=[RankLoad(active_prefill_tokens=500)])))
    doc = {"active_prefill_tokens_threshold": 100}
    payload = json.dumps({
        "event_id": str(uuid.uuid4()), "model": "m", "kind": "busy_threshold", "op": "patch",
        "expected_revision": 0, "changes": doc, "document": doc, "actor": "t", "request_id": "q",
        "at": datetime.now(UTC).isoformat(),
    }).encode()
    s.start()
    try:
        await s.call(ApplyPolicy("m", PolicyKind.BUSY_THRESHOLD, 1, payload,
                                session_keys().headers_for("m", PolicyKind.BUSY_THRESHOLD, payload)))
        with pytest.raises(Overloaded):
            await s.select(_req(1))
        # The only worker falls silent: as long as that could be a bus outage (30 s of grace)
        # it is not stale; past the grace it is (1.5 s of the silence counted, then the clock).
        clock.t += 31.4
        await s.call(Tick())
        with pytest.raises(Overloaded):
            await s.select(_req(2))
        clock.t += 0.2
        await s.call(Tick())
        with pytest.raises(ServiceUnavailable):
            await s.select(_req(3))
        clock.t += 7
        assert await s.call(Tick()) == [1]
    finally:
        await s.stop()


def test_parse_pin_rules() -> None:
    agg = RouterRole.AGGREGATED
    assert parse_pin(None, {}, role=agg) is None
    pin = parse_pin({"backend_instance_id": 5, "decode_worker_id": 18446744073709551615}, {}, role=agg)
    assert pin is not None and pin.instance_id == 2**64 - 1 and pin.id_field == "nvext.decode_worker_id"
    pin = parse_pin({"decode_worker_id": 5, "dp_rank": 1}, {"X-Worker-Instance-Id": "7", "x-dp-rank": "0"}, role=agg)
    assert pin is not None and (pin.instance_id, pin.dp_rank) == (7, 0)
    assert pin.id_field == "header x-worker-instance-id"
    for bad in ({"decode_worker_id": 2**64}, {"decode_worker_id": -1}, {"decode_worker_id": 1.5},
                {"decode_worker_id": True}, {"decode_worker_id": "abc"}, {"dp_rank": 0},
                {"prefill_worker_id": 3}, {"decode_worker_id": 3, "dp_rank": -1}):
        with pytest.raises(InvalidRequest) as err:
            parse_pin(bad, {}, role=agg)
        assert err.value.status_code == 400
    with pytest.raises(InvalidRequest):
        parse_pin("x", {}, role=agg)
    pre = parse_pin({"prefill_worker_id": 3, "backend_instance_id": 4, "dp_rank": 2}, {}, role=RouterRole.PREFILL)
    assert pre is not None and (pre.instance_id, pre.dp_rank) == (3, 2)
    pre = parse_pin({"backend_instance_id": 4, "prefill_dp_rank": 1, "dp_rank": 2}, {}, role=RouterRole.PREFILL)
    assert pre is not None and (pre.instance_id, pre.dp_rank) == (4, 1)


def test_parse_targets_keeps_both_phases() -> None:
    t = parse_targets({"prefill_worker_id": 3, "decode_worker_id": 4, "prefill_dp_rank": 1, "dp_rank": 2}, {})
    assert t.prefill is not None and (t.prefill.instance_id, t.prefill.dp_rank) == (3, 1)
    assert t.decode is not None and (t.decode.instance_id, t.decode.dp_rank) == (4, 2)
    assert t.prefill_field == "nvext.prefill_worker_id"
    # backend_instance_id stands for both; dp_rank serves the prefill when it has no rank of its own.
    t = parse_targets({"backend_instance_id": 9, "dp_rank": 1}, {})
    assert (t.prefill, t.decode) == (t.decode, t.prefill) and t.decode is not None
    assert (t.decode.instance_id, t.decode.dp_rank, t.prefill_field) == (9, 1, None)
    t = parse_targets({"prefill_worker_id": 3, "dp_rank": 1}, {})
    assert t.decode is None and t.prefill is not None and t.prefill.dp_rank == 1
    t = parse_targets({}, {"x-prefill-instance-id": "5", "x-prefill-dp-rank": "0"})
    assert t.prefill is not None and t.prefill.id_field == "header x-prefill-instance-id"
    for bad in ({"prefill_dp_rank": 0}, {"prefill_worker_id": 3, "prefill_dp_rank": 0, "dp_rank": 1},
                {"prefill_worker_id": -3}):
        with pytest.raises(InvalidRequest):
            parse_targets(bad, {})


def _join_role(wid: int, role: WorkerRole) -> MembershipEvent:
    rec = WorkerRecord(instance_id=wid, model="m", url=f"http://w{wid}", role=role, block_size=4,
                       kv_total_blocks=100, max_num_batched_tokens=64, started_at=datetime.now(UTC))
    return MembershipEvent(op=MembershipOp.JOIN, worker=rec, at=datetime.now(UTC))


async def test_disaggregated_selection_runs_prefill_then_decode_pool() -> None:
    s = _sched(Clock())
    s.send(ApplyMembership(_join_role(1, WorkerRole.PREFILL)))
    s.send(ApplyMembership(_join_role(2, WorkerRole.DECODE)))
    s.start()
    try:
        assert await s.inspect(lambda x: x.chooser.disaggregated("m"))
        first = await s.select(_req(1, targets=parse_targets({}, {})))
        assert (first.instance_id, first.pool, first.disaggregated) == (1, WorkerRole.PREFILL, True)
        assert first.booking_id == "q1" + PREFILL_BOOKING
        second = await s.select(_req(1, targets=parse_targets({}, {}), phase=Phase.DECODE))
        assert (second.instance_id, second.pool, second.disaggregated) == (2, WorkerRole.DECODE, False)
        assert second.booking_id == "q1"
        assert await s.inspect(lambda x: len(x.bookings)) == 2
        s.send(RequestDone(first.booking_id))
        s.send(RequestDone(second.booking_id))
        assert await s.inspect(lambda x: len(x.bookings)) == 0
        with pytest.raises(InvalidRequest, match="in the prefill pool"):
            await s.select(_req(2, targets=parse_targets({"prefill_worker_id": 2}, {})))
        with pytest.raises(InvalidRequest, match="in the decode pool"):
            await s.select(_req(2, targets=parse_targets({"decode_worker_id": 1}, {}), phase=Phase.DECODE))
        # Without prefill workers, decode workers serve whole requests, and a prefill target is refused.
        leave = _join_role(1, WorkerRole.PREFILL).model_copy(update={"op": MembershipOp.LEAVE})
        s.send(ApplyMembership(leave))
        alone = await s.select(_req(3, targets=parse_targets({}, {})))
        assert (alone.instance_id, alone.pool, alone.disaggregated) == (2, WorkerRole.DECODE, False)
        assert alone.booking_id == "q3"
        with pytest.raises(InvalidRequest, match="aggregated deployment"):
            await s.select(_req(4, targets=parse_targets({"prefill_worker_id": 2}, {})))
    finally:
        await s.stop()


async def test_full_selection_queue_refuses_with_queue_full_and_frees_its_places() -> None:
    from controlplane.protocol.errors import QueueFull

    s = _sched(Clock())
    s.max_queued_selections = 3
    s.send(ApplyMembership(_join(1)))
    queued = [s.submit(SelectWorker(_req(i))) for i in range(3)]
    with pytest.raises(QueueFull) as refused:
        s.submit(SelectWorker(_req(99)))
    assert isinstance(refused.value, Overloaded) and refused.value.code == "queue_full"
    # Commands nobody waits for (completions, KV events) are never refused: bookings must free.
    for i in range(10):
        s.send(RequestDone(f"none-{i}"))
    s.start()
    try:
        assert [r.request_id for r in await asyncio.gather(*queued)] == ["q0", "q1", "q2"]
        # Answered selections, and cancelled ones, give their places back.
        skipped = s.submit(SelectWorker(_req(100)))
        skipped.cancel()
        await s.inspect(lambda x: None)  # the actor has passed (and skipped) the cancelled one
        again = [s.submit(SelectWorker(_req(200 + i))) for i in range(3)]
        assert len(await asyncio.gather(*again)) == 3
    finally:
        await s.stop()


async def test_a_client_request_id_that_names_another_requests_booking_gets_one_of_its_own() -> None:
    """A request whose id is in flight is booked as ``id#seq``; a client may have named that too
    (``x-request-id`` is its own to choose): the request still gets a booking of its own, and no
    other request's booking or pending timing is taken over (it once raised, a 500)."""
    s = _sched(Clock(), RoutingMode.LEAST_LOADED)
    s.send(ApplyMembership(_join(1)))
    s.start()
    try:
        first = await s.select(_req(0)._replace(request_id="dup"))
        # Ids ahead of the actor's command count, so that the next selections' ``dup#seq`` are taken.
        crafted = [await s.select(_req(0)._replace(request_id=f"dup#{n}")) for n in range(100, 400)]
        assert [c.booking_id for c in crafted] == [f"dup#{n}" for n in range(100, 400)]
        again = [await s.select(_req(0)._replace(request_id="dup")) for _ in range(3)]
        ids = [first.booking_id, *(c.booking_id for c in crafted), *(a.booking_id for a in again)]
        assert len(set(ids)) == len(ids) == 304
        assert all(a.request_id == "dup" for a in again)
        # Every booking has its own pending timing (none overwritten by another's).
        assert await s.inspect(lambda x: sorted(x.timings._pending)) == sorted(ids)
        for booking_id in ids:
            s.send(RequestDone(booking_id))
        assert await s.inspect(lambda x: (len(x.bookings), len(x.timings._pending))) == (0, 0)
    finally:
        await s.stop()


def _stored(wid: int, event_id: int, hashes: list[int]) -> ApplyKvEvents:
    blocks = [StoredBlock(block_hash=h, tokens_hash=h) for h in hashes]
    return ApplyKvEvents([KvEvent(instance_id=wid, event_id=event_id, data=KvStored(blocks=blocks))])


def _dump(wid: int, last_event_id: int, hashes: list[int]) -> LoadKvDump:
    blocks = [(None, h, h) for h in hashes]
    return LoadKvDump(wid, KvDumpReply(instance_id=wid, last_event_id=last_event_id,
                                       ranks=[KvDumpRank(blocks=blocks)] if blocks else []))


def test_a_worker_restarted_under_its_instance_id_is_a_new_worker() -> None:
    """Fixed instance ids (compose, a StatefulSet's pod index) come back after a crash: a process
    that died without leaving and was restarted within the TTL. Its cache is empty and its KV
    event ids start again at 1. The router forgets the old process (index, bookings), asks the
    new one for its dump and takes its events, instead of dropping them as duplicates of the old
    process's ids and routing by blocks the worker no longer holds."""
    clock = Clock()
    s = _sched(clock, RoutingMode.KV_BLOCKS)
    old = _join(1).worker
    s._dispatch(ApplyMembership(MembershipEvent(op=MembershipOp.JOIN, worker=old, at=datetime.now(UTC))))
    s._dispatch(ApplyMembership(_join(2)))
    for wid in (1, 2):
        s._dispatch(_dump(wid, -1, []))
    before = [11, 12, 13, 14]
    for event_id in range(1, 40):  # the old process's events: ids up to 39
        s._dispatch(_stored(1, event_id, before if event_id == 1 else [1000 + event_id]))
    assert s.index.overlaps(before)[(1, 0)].total == 4
    booked = s._dispatch(SelectWorker(_req(1)))
    assert s.bookings.rank((booked.instance_id, 0)) is not None

    # The same id, a later start: the new process's first heartbeat (or join).
    new = old.model_copy(update={"started_at": old.started_at + timedelta(seconds=5)})
    change = s._dispatch(ApplyMembership(MembershipEvent(op=MembershipOp.HEARTBEAT, worker=new,
                                                         at=datetime.now(UTC))))
    assert change is Change.RESTARTED
    assert (1, 0) not in s.index.overlaps(before)  # the old process's blocks are gone
    assert s.bookings.rank((1, 0)) is None or booked.instance_id != 1
    assert s.index.dump_pending(1)  # the consumer asks the new process for its dump
    after = [21, 22, 23]
    s._dispatch(_stored(1, 1, after))  # its ids start again at 1: buffered for the dump, not dropped
    s._dispatch(_dump(1, 0, []))
    assert s.index.overlaps(after)[(1, 0)].total == 3
    s._dispatch(_stored(1, 2, [31]))
    assert s.index.overlaps([31])[(1, 0)].total == 1
    # A record of the earlier process that comes after (a replay) changes nothing.
    stale = s._dispatch(ApplyMembership(MembershipEvent(op=MembershipOp.HEARTBEAT, worker=old, at=datetime.now(UTC))))
    assert stale is Change.IGNORED
    gone = s._dispatch(ApplyMembership(MembershipEvent(op=MembershipOp.LEAVE, worker=old, at=datetime.now(UTC))))
    assert gone is Change.IGNORED  # the old process's leave, late: the new one stays
    assert s.discovery.get(1).record.started_at == new.started_at  # type: ignore[union-attr]
    assert s.index.overlaps(after)[(1, 0)].total == 3
    # A join is sent once, as a process starts: one stamped earlier is a restart on a host whose
    # clock stepped back, not a replay.
    stepped = old.model_copy(update={"started_at": old.started_at - timedelta(seconds=60)})
    change = s._dispatch(ApplyMembership(MembershipEvent(op=MembershipOp.JOIN, worker=stepped, at=datetime.now(UTC))))
    assert change is Change.RESTARTED
    assert (1, 0) not in s.index.overlaps(after) and s.index.dump_pending(1)


def test_a_dead_process_s_late_kv_event_or_dump_never_reaches_its_successor_s_index() -> None:
    """KV events and dumps carry their process's stamp (schema 2): the worker's ``started_at``.
    A restart is seen from the membership stream, but the dead process's last KV events may reach
    the router later (its KV subscription lags). Unstamped, such an event with an id above the new
    process's dump was applied to the new process's index, and the new process's ids below it
    were then dropped as duplicates; a dump the dead process answered before it died was loaded
    as the new one's."""
    s = _sched(Clock(), RoutingMode.KV_BLOCKS)
    old = _join(1).worker
    s._dispatch(ApplyMembership(MembershipEvent(op=MembershipOp.JOIN, worker=old, at=datetime.now(UTC))))
    assert s._dispatch(_dump(1, -1, [])) is False

    def stored(event_id: int, hashes: list[int], started_at: datetime | None) -> ApplyKvEvents:
        [event] = _stored(1, event_id, hashes).events
        return ApplyKvEvents([event.model_copy(update={"started_at": started_at})])

    def dump(last_event_id: int, hashes: list[int], started_at: datetime | None, *, stale: bool = False) -> LoadKvDump:
        cmd = _dump(1, last_event_id, hashes)
        assert cmd.reply is not None
        return LoadKvDump(1, cmd.reply.model_copy(update={"started_at": started_at}), stale=stale)

    for event_id in range(1, 40):
        s._dispatch(stored(event_id, [100 + event_id], old.started_at))
    new = old.model_copy(update={"started_at": old.started_at + timedelta(seconds=5)})
    assert s._dispatch(ApplyMembership(MembershipEvent(op=MembershipOp.JOIN, worker=new, at=datetime.now(UTC)))) \
        is Change.RESTARTED
    assert s.index.dump_pending(1)
    # The dead process's last event, late (id 40), and its dump, asked for before the restart:
    # neither is taken, and the dump is asked for again (True) with the buffer kept.
    s._dispatch(stored(40, [666], old.started_at))
    assert s._dispatch(dump(40, [666, 667], old.started_at)) is True
    assert s.index.dump_pending(1) and s.index.other_process == 2
    s._dispatch(stored(1, [21], new.started_at))  # buffered for the new process's dump
    # A dump asked for while another was on its way (stale) is not loaded either.
    assert s._dispatch(dump(0, [], new.started_at, stale=True)) is True
    assert s._dispatch(dump(0, [], new.started_at)) is False
    assert not s.index.dump_pending(1)
    for event_id, h in ((2, 22), (3, 23)):  # ids from 1 again, applied in order
        s._dispatch(stored(event_id, [h], new.started_at))
    assert s.index.overlaps([21])[(1, 0)].total == 1
    assert s.index.overlaps([23])[(1, 0)].total == 1
    assert (1, 0) not in s.index.overlaps([666]) and (1, 0) not in s.index.overlaps([667])
    # Unstamped (schema 1) events and dumps are taken as before.
    s._dispatch(stored(4, [24], None))
    assert s.index.overlaps([24])[(1, 0)].total == 1
    assert s.index.other_process == 2


def test_an_instance_id_that_comes_back_serving_another_model_leaves_the_first() -> None:
    """Restarted under the same id for another model this router also serves: no slot of the first
    model is left pointing at it."""
    now = datetime.now(UTC)
    s = _sched(Clock(), models=("m", "n"))
    first = _join(1).worker
    s._dispatch(ApplyMembership(MembershipEvent(op=MembershipOp.JOIN, worker=first, at=now)))
    assert s._dispatch(SelectWorker(_req(1))).instance_id == 1
    second = first.model_copy(update={"model": "n", "started_at": first.started_at + timedelta(seconds=1)})
    assert s._dispatch(ApplyMembership(MembershipEvent(op=MembershipOp.JOIN, worker=second, at=now))) \
        is Change.RESTARTED
    with pytest.raises(ServiceUnavailable):
        s._dispatch(SelectWorker(_req(2)))
    got = s._dispatch(SelectWorker(_req(3)._replace(model="n")))
    assert got.instance_id == 1
    assert s.view.workers == {"m": 0, "n": 1}
