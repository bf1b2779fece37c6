"""The fleet harness (tests/reliability/fleet.py) with a short schedule: the production shape as
real processes (3-node NATS cluster, PostgreSQL, two control planes, three routers, four mock
workers) under CAS writers, threshold writers, rollbacks and chats, while the stream leader's NATS
node and a control plane are killed and restarted, PostgreSQL and a router are paused (SIGSTOP),
one router's link to NATS is cut and a worker's KV events flood the routers (55-80 s; the other
faults run in ``python bench/reliability.py``). The history checker then finds the CAS histories
linearizable, every router apply in order, every live router on the head within 2 s, no
acknowledged write lost or unaudited, the audit true, every chat answered (or refused for
overload), and reconcile and verify clean."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.reliability.fleet import Fleet
from tests.reliability.fleet_traffic import run
from tests.reliability.history import Answer, check

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

#: (fault, seconds): each short, ~2 s apart; the whole test stays under 90 s on 2 loaded cores.
SCHEDULE = [("nats_node_kill", 0.5), ("controlplane_kill", 0.3), ("partition_drop", 1.0),
            ("postgres_stop", 1.0), ("router_stop", 1.0), ("kv_burst", 0.5)]


async def test_the_fleet_keeps_its_promises_through_a_short_fault_schedule(tmp_path: Path) -> None:
    os.chmod(tmp_path, 0o755)  # PostgreSQL runs as its own system user when we are root
    fleet = Fleet(tmp_path / "fleet")
    try:
        await fleet.start()
        result = await run(fleet, SCHEDULE, gap_s=1.0, tail_s=2.0, tail_until_written=True)
    finally:
        await fleet.stop()
    h = result.history
    verdict = check(h)
    accepted = [a for a in h.attempts if a.answer is Answer.ACCEPTED]
    counts = {answer.value: sum(a.answer is answer for a in h.attempts) for answer in Answer}
    print(counts, len(h.chats), [(f.name, f.target, round(f.back - f.began, 2)) for f in result.faults])
    print(verdict, result.unknown_why, result.unexpected[:5], result.passed_over[:10], result.reconcile, result.verify)
    assert len(result.faults) == len(SCHEDULE)
    assert {a.document for a in accepted} == set(h.stream), counts  # both documents were written
    assert any(a.invoked > result.faults[-1].back for a in accepted), "no write accepted after the last fault"
    assert sum(c.ok for c in h.chats) > 20, len(h.chats)
    assert result.unexpected == [], result.unexpected
    assert result.kv_dropped > 0  # the burst was faster than the routers take a worker's events
    assert verdict.ok, (str(verdict), counts)
    assert result.reconcile["ok"], result.reconcile
    # Every router's prefix index is live and true after the faults (the KV burst among them).
    assert all(t.ok for t in result.kv_truth.values()), result.kv_truth
    assert result.verify["ok"], result.verify
