"""Router replicas as separate processes converge on the head revision (DESIGN §2, §5)."""

from __future__ import annotations

import os
import signal
import subprocess
from collections.abc import Iterator
from typing import Any

import nats
import pytest

from controlplane.protocol.events import RouterStatus, decode_router_status
from controlplane.protocol.policy import PolicyKind
from controlplane.protocol.subjects import BUCKET_ROUTERS
from tests import buskit
from tests.support_router.policy import publish_policy
from tests.support_router.workers import free_port, spawn_router, wait_for, wait_http_ok

pytestmark = [pytest.mark.timeout(90), pytest.mark.slow]
MODEL = "meta-llama/Llama-3.1-8B-Instruct"


@pytest.fixture
def procs() -> Iterator[dict[str, subprocess.Popen[bytes]]]:
    running: dict[str, subprocess.Popen[bytes]] = {}
    yield running
    for p in running.values():
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGTERM)
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)


async def test_three_replicas_converge_and_a_restarted_one_catches_up(
    nats_url: str, procs: dict[str, subprocess.Popen[bytes]]
) -> None:
    nc = await buskit.admin_connect(nats_url)
    js = nc.jetstream()
    kv = await js.key_value(BUCKET_ROUTERS)
    ports = {f"rep-{i}": free_port() for i in range(3)}
    try:
        for rid, port in ports.items():
            procs[rid] = spawn_router(nats_url, MODEL, port=port, router_id=rid)
        for port in ports.values():
            await wait_http_ok(f"http://127.0.0.1:{port}/live")

        heads = {PolicyKind.SELECTION: 0, PolicyKind.BUSY_THRESHOLD: 0}
        for i in range(100):
            if i % 4 == 3:
                kind = PolicyKind.BUSY_THRESHOLD
                doc: dict[str, Any] = {"active_prefill_tokens_threshold": 1000 + i}
            else:
                kind = PolicyKind.SELECTION
                doc = {"router_temperature": i / 100, "overlap_score_credit": 1 + i / 100}
            heads[kind] = await publish_policy(js, MODEL, doc, expected_revision=heads[kind], kind=kind)

        async def statuses() -> dict[str, RouterStatus]:
            out = {}
            for rid in ports:
                try:
                    entry = await kv.get(rid)
                except nats.js.errors.KeyNotFoundError:
                    continue
                out[rid] = decode_router_status(entry.value or b"")
            return out

        def on_head(st: RouterStatus) -> bool:
            return all(st.applied[f"{MODEL}|{k.value}"].revision == rev for k, rev in heads.items())

        async def all_on_head() -> bool:
            sts = await statuses()
            return len(sts) == 3 and all(on_head(s) for s in sts.values())

        await wait_for(all_on_head, within=20)
        before = await statuses()
        effective = {rid: {k: st.applied[k].effective for k in st.applied} for rid, st in before.items()}
        assert effective["rep-0"] == effective["rep-1"] == effective["rep-2"]
        assert effective["rep-0"][f"{MODEL}|selection"]["router_temperature"] == 0.98
        assert effective["rep-0"][f"{MODEL}|busy_threshold"]["active_prefill_tokens_threshold"] == 1099

        # Kill one for real, restart it under the same id: it converges on the same values.
        victim = procs["rep-1"]
        os.killpg(victim.pid, signal.SIGKILL)
        victim.wait(10)
        old_start = before["rep-1"].started_at
        procs["rep-1"] = spawn_router(nats_url, MODEL, port=ports["rep-1"], router_id="rep-1")

        async def restarted_on_head() -> bool:
            st = (await statuses()).get("rep-1")
            return st is not None and st.started_at > old_start and on_head(st)

        await wait_for(restarted_on_head, within=30)
        after = (await statuses())["rep-1"]
        assert {k: after.applied[k].effective for k in after.applied} == effective["rep-0"]
    finally:
        await nc.close()
