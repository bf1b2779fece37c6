"""The trust boundary on the bus (DESIGN §9), against a real nats-server in operator mode.

- Anonymous connections, and credentials minted by any other authority, are refused.
- Table-driven: every identity's forbidden publishes (policy, another worker's membership and KV,
  another router's ACK and status key, stream create/update/delete/purge) are refused by the
  server (reported on the connection's error callback) and nothing reaches the stream; what each
  identity must do still works.
- Streams are owned by the bus admin: a service started before they exist waits for them, and a
  stream that differs from its settings stops it with a message naming the setting.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

import nats
import pytest
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.js.errors import NotFoundError

from bus.authority import BusAuthority
from bus.connect import BusOptions, connect
from bus.identities import Identity, IdentityKind
from bus.streams import BusLayout, wait_ready
from cli.embedded import EmbeddedNats
from controlplane.protocol.errors import ConfigurationError
from controlplane.protocol.subjects import (
    BUCKET_ROUTERS,
    STREAM_MEMBERSHIP,
    STREAM_POLICY,
    acks_subject,
    kv_subject,
    membership_subject,
    policy_subject,
)
from tests import buskit

pytestmark = pytest.mark.timeout(60)

MODEL = "sec/model-1"
OTHER_MODEL = "sec/model-2"
ROUTER = Identity(IdentityKind.ROUTER, router_id="r-a")
WORKER = Identity(IdentityKind.WORKER, model=MODEL, instance_id=1)
CONTROLPLANE = Identity(IdentityKind.CONTROLPLANE)


async def test_anonymous_connection_is_refused(nats_url: str) -> None:
    with pytest.raises(nats.errors.Error, match="Authorization Violation"):
        await nats.connect(nats_url, allow_reconnect=False, connect_timeout=2)


async def test_credentials_of_another_authority_are_refused(nats_url: str, tmp_path: Path) -> None:
    forged = BusAuthority.open(tmp_path / "forged").issue(Identity(IdentityKind.ADMIN))
    with pytest.raises(ConfigurationError) as err:
        await connect(BusOptions(servers=(nats_url,), creds=forged, name="forger"))
    assert err.value.field == "nats_creds"


async def test_a_process_without_credentials_does_not_start(nats_url: str) -> None:
    with pytest.raises(ConfigurationError, match="RUDDER_NATS_CREDS"):
        await connect(BusOptions(servers=(nats_url,), creds=None))


@dataclass
class Refusal:
    who: Identity
    subject: str
    what: str  # the stream whose contents must stay untouched ("" for core subjects)


def _refusals() -> list[Refusal]:
    stream_api = [
        ("$JS.API.STREAM.CREATE.EVIL", ""),
        (f"$JS.API.STREAM.UPDATE.{STREAM_POLICY}", STREAM_POLICY),
        (f"$JS.API.STREAM.DELETE.{STREAM_POLICY}", STREAM_POLICY),
        (f"$JS.API.STREAM.PURGE.{STREAM_POLICY}", STREAM_POLICY),
        (f"$JS.API.STREAM.DELETE.{STREAM_MEMBERSHIP}", STREAM_MEMBERSHIP),
        (f"$JS.API.STREAM.MSG.DELETE.{STREAM_MEMBERSHIP}", STREAM_MEMBERSHIP),
    ]
    out: list[Refusal] = []
    for who in (CONTROLPLANE, ROUTER, WORKER):
        out += [Refusal(who, s, stream) for s, stream in stream_api]
        out += [
            Refusal(who, membership_subject(MODEL, 2), STREAM_MEMBERSHIP),  # another worker
            Refusal(who, kv_subject(MODEL, 2), ""),
            Refusal(who, acks_subject("r-b"), ""),  # another router's ACKs
            Refusal(who, f"$KV.{BUCKET_ROUTERS}.r-b", f"KV_{BUCKET_ROUTERS}"),  # its status key
        ]
    for who in (ROUTER, WORKER):
        out.append(Refusal(who, policy_subject(MODEL, "selection"), STREAM_POLICY))
    out += [
        Refusal(WORKER, membership_subject(OTHER_MODEL, 1), STREAM_MEMBERSHIP),  # its id, another model
        Refusal(WORKER, kv_subject(OTHER_MODEL, 1), ""),
        Refusal(WORKER, acks_subject("r-a"), ""),
        Refusal(CONTROLPLANE, membership_subject(MODEL, 1), STREAM_MEMBERSHIP),
        Refusal(ROUTER, f"$JS.API.CONSUMER.DURABLE.CREATE.{STREAM_POLICY}.evil", ""),
    ]
    return out


@contextlib.asynccontextmanager
async def connected(url: str, who: Identity) -> AsyncIterator[tuple[NATS, list[str]]]:
    errors: list[str] = []

    async def on_error(exc: Exception) -> None:
        errors.append(str(exc))

    nc = await connect(buskit.options(url, buskit.creds_for(who), name=f"t-{who.name}"), on_error=on_error)
    try:
        yield nc, errors
    finally:
        await nc.close()


def _collect(into: list[bytes]) -> Callable[[Msg], Awaitable[None]]:
    async def on_msg(msg: Msg) -> None:
        into.append(msg.data)

    return on_msg


async def _stream_digest(admin: NATS, stream: str) -> tuple[int, int, str]:
    info = await admin.jetstream().stream_info(stream)
    return info.state.messages, info.state.last_seq, json.dumps(info.config.as_dict(), sort_keys=True, default=str)


@pytest.mark.parametrize("case", _refusals(), ids=lambda c: f"{c.who.name}:{c.subject}")
async def test_forbidden_publish_is_refused_and_changes_nothing(nats_url: str, nc: NATS, case: Refusal) -> None:
    seen: list[bytes] = []
    if not case.what:  # a core subject: nobody may receive it
        sub = await nc.subscribe(case.subject, cb=_collect(seen))
        await nc.flush()
    before = await _stream_digest(nc, case.what) if case.what else None
    async with connected(nats_url, case.who) as (client, errors):
        await client.publish(case.subject, b'{"forged": true}', reply=client.new_inbox())
        await client.flush()
        for _ in range(200):
            if any("permissions violation" in e and case.subject.lower() in e.lower() for e in errors):
                break
            await asyncio.sleep(0.01)
        assert any("permissions violation" in e and case.subject.lower() in e.lower() for e in errors), errors
    await nc.flush()
    if case.what:
        assert await _stream_digest(nc, case.what) == before
    else:
        await sub.unsubscribe()
        assert seen == []
    if case.subject == "$JS.API.STREAM.CREATE.EVIL":
        with pytest.raises(NotFoundError):
            await nc.jetstream().stream_info("EVIL")


async def test_a_worker_cannot_listen_to_another_workers_kvdump(nats_url: str) -> None:
    async with connected(nats_url, WORKER) as (client, errors):
        await client.subscribe("rudder.kvdump.2")
        await client.flush()
        for _ in range(200):
            if any("permissions violation for subscription" in e for e in errors):
                break
            await asyncio.sleep(0.01)
        assert any("permissions violation for subscription" in e and "rudder.kvdump.2" in e for e in errors)


async def test_each_identity_can_do_its_own_work(nats_url: str, nc: NATS) -> None:
    js_admin = nc.jetstream()
    async with connected(nats_url, WORKER) as (worker, errors):
        ack = await worker.jetstream().publish(membership_subject(MODEL, 1), b"{}")
        assert ack.stream == STREAM_MEMBERSHIP
        got: list[bytes] = []
        sub = await nc.subscribe(kv_subject(MODEL, 1), cb=_collect(got))
        await nc.flush()
        await worker.publish(kv_subject(MODEL, 1), b"kv")
        await worker.flush()

        async def answer(msg: Msg) -> None:
            await msg.respond(b"dump")

        await worker.subscribe("rudder.kvdump.1", cb=answer)
        await worker.flush()
        async with connected(nats_url, ROUTER) as (router, router_errors):
            reply = await router.request("rudder.kvdump.1", b"", timeout=2)
            assert reply.data == b"dump"
            kv = await router.jetstream().key_value(BUCKET_ROUTERS)
            await kv.put("r-a", b"status")
            await router.publish(acks_subject("r-a"), b"ack")
            sub_policy = await router.jetstream().subscribe(
                policy_subject(MODEL, "selection"), ordered_consumer=True)
            await sub_policy.unsubscribe()
            assert router_errors == []
        # Core NATS is at most once (the router's KV path recovers a lost event with a dump): a
        # message that did not arrive is sent again, a few times, before the check. A refused
        # publish would never arrive, and would show in ``errors``.
        for _ in range(5):
            for _ in range(200):
                if got:
                    break
                await asyncio.sleep(0.01)
            if got:
                break
            await worker.publish(kv_subject(MODEL, 1), b"kv")
            await worker.flush()
        assert got and set(got) == {b"kv"}, got
        await sub.unsubscribe()
        assert errors == []
    assert (await (await js_admin.key_value(BUCKET_ROUTERS)).get("r-a")).value == b"status"
    async with connected(nats_url, CONTROLPLANE) as (cp, cp_errors):
        ack = await cp.jetstream().publish(policy_subject(MODEL, "selection"), b"{}")
        assert ack.stream == STREAM_POLICY
        last = await cp.jetstream().get_last_msg(STREAM_POLICY, policy_subject(MODEL, "selection"), direct=True)
        assert last.data == b"{}"
        assert cp_errors == []


async def test_a_service_waits_for_the_bus_admin_then_checks_replicas(tmp_path: Path) -> None:
    server = EmbeddedNats(tmp_path / "nats", auth=buskit.authority().server_config)
    server.start()
    try:
        async with connected(server.url, ROUTER) as (router, _):
            layout = BusLayout()
            waiting = asyncio.create_task(
                wait_ready(router.jetstream(), layout, [STREAM_POLICY, STREAM_MEMBERSHIP], timeout_s=20))
            await asyncio.sleep(0)
            assert not waiting.done()
            await asyncio.to_thread(buskit.init_streams, server.url)
            await asyncio.wait_for(waiting, 15)
            # Configured for 3 replicas, the stream has 1: the service stops, naming the setting.
            with pytest.raises(ConfigurationError, match="RUDDER_STREAM_REPLICAS") as err:
                await wait_ready(router.jetstream(), BusLayout(replicas=3), [STREAM_POLICY], timeout_s=5)
            assert err.value.field == "RUDDER_STREAM_REPLICAS"
    finally:
        server.stop()


def test_secrets_stay_out_of_repr_and_settings(tmp_path: Path) -> None:
    from router.settings import RouterSettings
    from tests.policy_keys import session_keys

    creds = buskit.router_creds("r-repr")
    seed_line = next(line for line in creds.read_text().splitlines() if line.startswith("SU"))
    settings = RouterSettings(router_id="r-repr", nats_creds=creds, models=["m"],
                              policy_verify_keys=session_keys().verify_path)
    assert seed_line not in repr(settings) and seed_line not in str(settings.model_dump())
    authority = buskit.authority()
    assert "seed" not in repr(authority).lower()
    assert oct(creds.stat().st_mode & 0o777) == "0o600"


async def test_revoked_credentials_are_refused_after_a_restart_and_new_ones_work(tmp_path: Path) -> None:
    """A worker's credentials are stolen: ``rudder bus revoke --creds`` puts the user in the
    account JWT's revocations, and once nats-server restarts with the rewritten include it refuses
    them (a connection open before is dropped by the restart, and its reconnect is a connect with
    the same credentials); credentials issued afterwards for the same identity work, and other
    users' credentials are untouched."""
    import time

    from cli import bus as bus_cli
    from cli.embedded import LocalBus
    from tests.cli_runner import invoke

    local = LocalBus(tmp_path)
    local.start()
    try:
        authority = local.authority
        stolen = authority.issue(WORKER, tmp_path / "stolen.creds")
        other = authority.issue(ROUTER, tmp_path / "router.creds")

        def opts(creds: Path) -> BusOptions:
            return BusOptions(servers=(local.url,), creds=creds, name="revocation-test",
                              connect_timeout_s=2, initial_timeout_s=2)

        holder = await connect(opts(stolen))  # the thief's connection, open before the revocation
        assert holder.is_connected
        result = invoke(bus_cli.app, ["revoke", "--creds", str(stolen), "--home", str(authority.home)])
        assert result.exit_code == 0, result.output
        [(revoked_at, name)] = authority.revocations().values()
        assert name == WORKER.name
        local.restart(local.server)

        async def refused() -> bool:  # the server is back and refuses the stolen credentials
            try:
                nc = await connect(opts(stolen))
            except ConfigurationError as exc:
                assert exc.field == "nats_creds"
                return True
            except Exception:  # not up yet
                return False
            await nc.close()
            raise AssertionError("revoked credentials were accepted")

        deadline = time.monotonic() + 30
        while not await refused():
            assert time.monotonic() < deadline, "nats-server did not come back"
            await asyncio.sleep(0.2)
        untouched = await connect(opts(other))  # another user's credentials still work
        assert untouched.is_connected
        await untouched.close()
        # A JWT issued in the revocation's second is revoked too: the new one is issued after it.
        await asyncio.sleep(max(revoked_at + 1 - time.time(), 0.0))
        fresh = await connect(opts(authority.issue(WORKER, tmp_path / "fresh.creds")))
        assert fresh.is_connected
        await fresh.close()
        await holder.close()
    finally:
        local.stop()
