"""The control plane's one settings object (``RUDDER_*`` environment variables)."""

from __future__ import annotations

from pydantic import Field, SecretStr
from pydantic_settings import SettingsConfigDict

from bus.settings import BusSettings


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
