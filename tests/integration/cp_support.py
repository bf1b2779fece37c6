"""Helpers for control-plane integration tests: a real control plane on real NATS and Postgres."""

from __future__ import annotations

import contextlib
import tempfile
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from pydantic import SecretStr

from bus.keyfiles import write_signing_key
from controlplane.audit.store import AuditStore
from controlplane.auth import Role, TokenStore
from controlplane.failpoints import Failpoints
from controlplane.protocol.signing import Purpose, SigningKey
from controlplane.server import Running, serving
from controlplane.settings import ControlPlaneSettings
from tests import buskit
from tests.policy_keys import session_keys

#: The checkpoint signing key of every test control plane (one per test session).
AUDIT_KEY = Path(tempfile.mkdtemp(prefix="rudder-audit-key-")) / "audit-signing.key"
AUDIT_SIGNER = SigningKey.generate(Purpose.CHECKPOINT)
write_signing_key(AUDIT_KEY, AUDIT_SIGNER)


def settings_for(nats_url: str, database_url: str, **overrides: Any) -> ControlPlaneSettings:
    values: dict[str, Any] = {
        "nats_url": nats_url, "database_url": SecretStr(database_url), "admin_port": 0,
        "reconcile_interval_s": 3600.0, "router_heartbeat_s": 1.0, "audit_signing_key": AUDIT_KEY,
        "nats_creds": buskit.controlplane_creds(),
        "policy_signing_key": session_keys().seed_path, "policy_verify_keys": session_keys().verify_path,
    }
    values.update(overrides)
    return ControlPlaneSettings(**values)


@dataclass
class Tokens:
    admin: str
    operator: str
    viewer: str
    auditor: str


async def make_tokens(database_url: str) -> Tokens:
    store = AuditStore.from_url(database_url)
    try:
        tokens = TokenStore(store.engine)
        out = {}
        for role in Role:
            plaintext, _ = await tokens.create(f"test-{role.value}", role)
            out[role.value] = plaintext
        return Tokens(**out)
    finally:
        await store.close()


@contextlib.asynccontextmanager
async def controlplane(nats_url: str, database_url: str, *, failpoints: Failpoints | None = None,
                       **overrides: Any) -> AsyncIterator[Running]:
    async with serving(settings_for(nats_url, database_url, **overrides), failpoints=failpoints) as running:
        yield running


def client(running: Running, token: str | None) -> httpx.AsyncClient:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    return httpx.AsyncClient(base_url=running.url, headers=headers, timeout=30)
