"""Explicit worker targets through the router's HTTP API (DESIGN §5), one case per test."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from controlplane.protocol.policy import PolicyKind
from tests import buskit
from tests.support_router.policy import publish_policy
from tests.support_router.workers import InProcessRouter, MockWorker, held, mock_workers, router_settings, wait_for

pytestmark = pytest.mark.timeout(60)
MODEL = "pin-model"
U64_MAX = 18446744073709551615


@dataclass
class Fleet:
    router: InProcessRouter
    a: MockWorker  # id 2^64 - 1, its bus link can be paused
    b: MockWorker  # id 42, runs one sequence at a time (to be made busy)
    multi: MockWorker  # id 7, 4 dp ranks
    http: httpx.AsyncClient

    async def post(self, body: dict[str, Any] | None = None, **kw: Any) -> httpx.Response:
        payload = {"model": MODEL, "prompt": "hi"}
        payload.update(body or {})
        return await self.http.post("/v1/completions", json=payload, **kw)


@pytest.fixture(scope="module")
async def fleet(nats_url: str) -> AsyncIterator[Fleet]:
    async with mock_workers(nats_url, MODEL, each=[
        {"instance_id": U64_MAX, "bus_link": True},
        {"instance_id": 42, "mock": {"max_num_seqs": 1, "speedup_ratio": 5.0}},
        {"instance_id": 7, "dp_size": 4},
    ]) as (a, b, multi):
        router = await InProcessRouter(router_settings(nats_url, MODEL)).start()
        await wait_for(lambda: router.runtime.scheduler.view.workers.get(MODEL) == 3)
        async with httpx.AsyncClient(base_url=router.url) as http:
            yield Fleet(router, a, b, multi, http)
        await router.stop()


def _served(r: httpx.Response) -> tuple[int, int]:
    assert r.status_code == 200, r.text
    return int(r.headers["x-worker-instance-id"]), int(r.headers["x-dp-rank"])


def _error(r: httpx.Response, status: int) -> dict[str, Any]:
    assert r.status_code == status, r.text
    err: dict[str, Any] = r.json()["error"]
    return err


async def test_worker_with_max_u64_id_is_accepted(fleet: Fleet) -> None:
    r = await fleet.post({"nvext": {"decode_worker_id": U64_MAX}})
    assert _served(r) == (U64_MAX, 0)
    assert fleet.a.requests[-1]["nvext"]["backend_instance_id"] == U64_MAX


async def test_u64_id_as_decimal_string_is_accepted(fleet: Fleet) -> None:
    r = await fleet.post({"nvext": {"backend_instance_id": str(U64_MAX)}})
    assert _served(r) == (U64_MAX, 0)


async def test_backend_instance_id_pins(fleet: Fleet) -> None:
    for _ in range(3):
        assert _served(await fleet.post({"nvext": {"backend_instance_id": 42}})) == (42, 0)


async def test_decode_worker_id_wins_over_backend_instance_id(fleet: Fleet) -> None:
    r = await fleet.post({"nvext": {"decode_worker_id": 42, "backend_instance_id": U64_MAX}})
    assert _served(r) == (42, 0)


async def test_header_overrides_nvext(fleet: Fleet) -> None:
    r = await fleet.post({"nvext": {"decode_worker_id": 42}}, headers={"x-worker-instance-id": str(U64_MAX)})
    assert _served(r) == (U64_MAX, 0)


async def test_dp_rank_header_overrides_nvext_dp_rank(fleet: Fleet) -> None:
    r = await fleet.post({"nvext": {"decode_worker_id": 7, "dp_rank": 1}}, headers={"x-dp-rank": "3"})
    assert _served(r) == (7, 3)
    assert fleet.multi.requests[-1]["nvext"]["dp_rank"] == 3


async def test_unknown_id_is_400_naming_field_and_id(fleet: Fleet) -> None:
    err = _error(await fleet.post({"nvext": {"decode_worker_id": 12345}}), 400)
    assert err["message"] == "nvext.decode_worker_id=12345 does not identify a known worker"
    assert err["param"] == "nvext.decode_worker_id"
    assert err["type"] == "invalid_request_error"


async def test_unknown_id_from_header_names_the_header(fleet: Fleet) -> None:
    err = _error(await fleet.post(headers={"x-worker-instance-id": "12345"}), 400)
    assert err["message"] == "header x-worker-instance-id=12345 does not identify a known worker"


async def test_prefill_worker_id_on_aggregated_is_400(fleet: Fleet) -> None:
    err = _error(await fleet.post({"nvext": {"prefill_worker_id": 42}}), 400)
    assert err["param"] == "nvext.prefill_worker_id"
    assert "aggregated" in err["message"]
    err = _error(await fleet.post(headers={"x-prefill-instance-id": "42"}), 400)
    assert err["param"] == "header x-prefill-instance-id"


@pytest.mark.parametrize("bad", [U64_MAX + 1, -1, 1.5, "12a", True, [1]])
async def test_id_not_an_integer_in_range_is_400(fleet: Fleet, bad: Any) -> None:
    err = _error(await fleet.post({"nvext": {"decode_worker_id": bad}}), 400)
    assert err["param"] == "nvext.decode_worker_id"
    assert "0..18446744073709551615" in err["message"]


async def test_dp_rank_outside_the_workers_ranks_is_400(fleet: Fleet) -> None:
    err = _error(await fleet.post({"nvext": {"decode_worker_id": 7, "dp_rank": 4}}), 400)
    assert err["message"] == "nvext.dp_rank=4 is not a dp rank of worker 7 (it has 4: 0..3)"


async def test_several_ranks_and_none_named_is_400(fleet: Fleet) -> None:
    err = _error(await fleet.post({"nvext": {"decode_worker_id": 7}}), 400)
    assert "has 4 dp ranks and none is named" in err["message"]


async def test_dp_rank_without_worker_is_400(fleet: Fleet) -> None:
    err = _error(await fleet.post({"nvext": {"dp_rank": 1}}), 400)
    assert err["param"] == "nvext.dp_rank"


async def test_nvext_not_an_object_is_400(fleet: Fleet) -> None:
    err = _error(await fleet.post({"nvext": "worker-1"}), 400)
    assert err["param"] == "nvext"


async def test_pinned_busy_worker_gets_overload_status_and_is_not_rerouted(
    fleet: Fleet, nats_url: str
) -> None:
    nc = await buskit.admin_connect(nats_url)
    try:
        # b runs one sequence at a time: a long generation runs, a 10000-token prompt waits.
        async with held(fleet.b, ["a long generation", "q" * 10_000], max_tokens=50_000):
            await publish_policy(nc.jetstream(), MODEL, {"active_prefill_tokens_threshold": 1000},
                                 expected_revision=0, kind=PolicyKind.BUSY_THRESHOLD)
            sched = fleet.router.runtime.scheduler
            await wait_for(lambda: sched.inspect(lambda s: s._slots[MODEL][(42, 0)].busy))
            before = len(fleet.b.requests)
            err = _error(await fleet.post({"nvext": {"backend_instance_id": 42}}), 529)
            assert err["code"] == "overloaded" and err["type"] == "overloaded_error"
            assert len(fleet.b.requests) == before
            # unpinned requests still go to the others
            assert _served(await fleet.post())[0] != 42
    finally:
        await nc.close()


async def test_pinned_stale_worker_is_503(fleet: Fleet) -> None:
    fleet.a.pause_bus()  # a's link to the bus fails: its heartbeats stop reaching it
    try:
        sched = fleet.router.runtime.scheduler
        await wait_for(lambda: sched.inspect(
            lambda s: s.discovery.health(s.discovery.get(U64_MAX), s.clock()).value == "stale"))
        err = _error(await fleet.post({"nvext": {"decode_worker_id": U64_MAX}}), 503)
        assert "stale" in err["message"] and err["code"] == "service_unavailable"
    finally:
        fleet.a.resume_bus()
    await wait_for(lambda: sched.inspect(
        lambda s: s.discovery.health(s.discovery.get(U64_MAX), s.clock()).value == "live"))
