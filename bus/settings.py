"""The bus fields every process's settings object carries (one definition, RUDDER_ prefix)."""

from __future__ import annotations

from pathlib import Path

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from bus.connect import BusOptions
from bus.streams import BusLayout


class BusSettings(BaseSettings):
    """Mixed into ControlPlaneSettings, RouterSettings and WorkerSettings.

    ``nats_creds`` is a *path*: the credentials themselves never sit in the environment, argv or a
    settings ``repr``."""

    # One URL or a comma-separated list of a cluster's servers (tls:// when TLS is on).
    nats_url: str = "nats://127.0.0.1:4222"
    nats_creds: Path | None = None
    nats_ca: Path | None = None
    stream_replicas: int = Field(default=1, ge=1, le=5)
    history_depth: int = Field(default=64, ge=2)
    # How long a service waits at start for the bus admin to create the streams it needs.
    stream_wait_s: float = Field(default=30.0, gt=0)
    # Liveness ages run on a bus clock that counts only part of a silence of the whole bus (broker
    # restart, leader election), for up to this long (controlplane.protocol.liveness).
    bus_outage_grace_s: float = Field(default=30.0, ge=0)

    def bus_options(self, name: str) -> BusOptions:
        return BusOptions.from_settings(nats_url=self.nats_url, nats_creds=self.nats_creds,
                                        nats_ca=self.nats_ca, name=name)

    def bus_layout(self, *, worker_ttl_s: float = 10.0, router_heartbeat_s: float = 1.0) -> BusLayout:
        return BusLayout(replicas=self.stream_replicas, history_depth=self.history_depth,
                         worker_ttl_s=worker_ttl_s, router_heartbeat_s=router_heartbeat_s)


class BusAdminSettings(BusSettings):
    """``rudder bus init`` / ``rudder bus creds``: the one-shot admin jobs.

    ``nats_creds`` must be the admin identity's credentials; ``bus_home`` is the authority folder
    (operator and account keys) that issuing credentials needs."""

    model_config = SettingsConfigDict(env_prefix="RUDDER_", extra="ignore")

    bus_home: Path | None = None
    worker_ttl_s: float = Field(default=10.0, gt=0)
    router_heartbeat_s: float = Field(default=1.0, gt=0)
    init_timeout_s: float = Field(default=30.0, gt=0)
