"""The control plane's one settings object (``RUDDER_*`` environment variables)."""

from __future__ import annotations

import ipaddress
import os
import socket
from pathlib import Path

from pydantic import Field, SecretStr, field_validator
from pydantic_settings import SettingsConfigDict

from bus.keyfiles import load_keyring, load_signing_key
from bus.settings import BusSettings
from controlplane.protocol.errors import KeyFileInvalid
from controlplane.protocol.subjects import ACKS_CONSUMER_DEFAULT


class ControlPlaneSettings(BusSettings):
    model_config = SettingsConfigDict(env_prefix="RUDDER_", extra="ignore")

    database_url: SecretStr = SecretStr("postgresql+asyncpg://postgres@127.0.0.1:5432/rudder")
    admin_host: str = "127.0.0.1"
    admin_port: int = Field(default=8080, ge=0, le=65535)
    max_body_bytes: int = Field(default=64 * 1024, gt=0)
    worker_ttl_s: float = Field(default=10.0, gt=0)
    router_heartbeat_s: float = Field(default=1.0, gt=0)
    router_status_timeout_s: float = Field(default=0.5, gt=0)
    reconcile_interval_s: float = Field(default=30.0, gt=0)
    reconcile_grace_s: float = Field(default=5.0, ge=0)
    busy_threshold_retries: int = Field(default=20, ge=1)
    startup_timeout_s: float = Field(default=30.0, gt=0)
    log_level: str = "INFO"
    # Admin ingress limits (docs/controlplane.md, "Failed authentication"). Failed
    # authentications per source address and window: past the limit that source is answered 429
    # with Retry-After until the window ends; a window's failures after its first are written as
    # one audit row with their count.
    auth_failure_limit: int = Field(default=10, ge=1)
    auth_failure_window_s: float = Field(default=60.0, gt=0)
    auth_failure_max_sources: int = Field(default=10_000, ge=1)
    # Audit rows failed authentications may write per window, across every source (issue 17).
    auth_failure_max_rows: int = Field(default=100, ge=1)
    # The listener's connection limits, the router's (router/ingress.py, docs/router.md "Ingress
    # limits"): request line and headers in bytes (431) and in time (408, closed), the whole body
    # within body_timeout_s of the head (408), a client that reads nothing for write_timeout_s is
    # cut off, and past max_connections a new connection is answered 503 and closed.
    max_header_bytes: int = Field(default=32 * 1024, ge=1024)
    header_timeout_s: float = Field(default=10.0, gt=0)
    body_timeout_s: float = Field(default=30.0, gt=0)
    write_timeout_s: float = Field(default=30.0, gt=0)
    max_connections: int = Field(default=256, ge=1)
    # Peers (IPs or CIDRs) whose X-Forwarded-For names the source address; none by default.
    trusted_proxies: list[str] = Field(default_factory=list)
    # Audited header values (User-Agent) are cut to this many characters.
    audit_header_max_chars: int = Field(default=256, ge=16)
    # Policy event signatures (DESIGN §9). The signing key is required: without it the control
    # plane does not start. The verify-keys file (the routers' file) lets it read back events
    # signed by another valid key, e.g. the previous one during a rotation. Both files are
    # re-read when they change (every key_poll_s), so a rotation needs no restart.
    policy_signing_key: Path | None = Field(default=None, validate_default=True)
    policy_verify_keys: Path | None = None
    key_poll_s: float = Field(default=1.0, gt=0)

    @field_validator("policy_signing_key")
    @classmethod
    def _signing_key(cls, value: Path | None) -> Path:
        if value is None:
            raise ValueError("required: the path of the policy signing key seed file "
                             "(RUDDER_POLICY_SIGNING_KEY; make one with `rudder keys new`)")
        try:
            load_signing_key(value)
        except KeyFileInvalid as exc:
            raise ValueError(exc.message) from exc
        return value

    @field_validator("policy_verify_keys")
    @classmethod
    def _verify_keys(cls, value: Path | None) -> Path | None:
        if value is not None:
            try:
                load_keyring(value)
            except KeyFileInvalid as exc:
                raise ValueError(exc.message) from exc
        return value

    #: This replica's name in the checkpoints it signs.
    instance_name: str = Field(default_factory=lambda: f"{socket.gethostname()}-{os.getpid()}",
                               min_length=1, max_length=128)
    #: The durable consumer on RUDDER_ACKS, one per fleet, shared by its control-plane replicas.
    acks_consumer: str = Field(default=ACKS_CONSUMER_DEFAULT, pattern=r"^[A-Za-z0-9_-]{1,64}$")
    #: Signed checkpoints of the audit and ACK chains (RUDDER_AUDIT_CHECKPOINTS stream).
    audit_checkpoints: bool = True
    audit_checkpoint_interval_s: float = Field(default=10.0, gt=0)
    audit_checkpoint_every_rows: int = Field(default=256, ge=1, le=1000)
    #: Checkpoint signing key: a seed file (`rudder keys new --purpose checkpoint`), mode 0600;
    #: required while checkpoints are on. Re-read when it changes (rotation).
    audit_signing_key: Path | None = None
    #: Trusted checkpoint public keys ("<key id> <base64 key>" a line); the signing key's own is
    #: always trusted. Keep every key that ever signed a checkpoint here.
    audit_verify_keys: Path | None = None
    #: Run even when the database role is a superuser or the audit tables' owner (development
    #: only: such a role can disable the insert-only triggers).
    allow_privileged_database_role: bool = False

    @field_validator("trusted_proxies")
    @classmethod
    def _proxies(cls, value: list[str]) -> list[str]:
        for item in value:
            try:
                ipaddress.ip_network(item, strict=False)
            except ValueError as exc:
                raise ValueError(f"trusted_proxies: {item!r} is not an IP address or CIDR") from exc
        return value
