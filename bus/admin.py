"""The bus admin's one-shot job: create and update streams and buckets (``rudder bus init``)."""

from __future__ import annotations

from bus.connect import BusOptions, connect
from bus.streams import BusLayout, ensure_all_retrying


async def bus_init(opts: BusOptions, layout: BusLayout, *, timeout_s: float = 30.0) -> list[str]:
    """Connect as the admin identity and bring every stream and bucket to ``layout``.

    Returns what changed (empty when everything was already in place). Raises
    ConfigurationError when the credentials are refused, LogUnavailable when no server answers."""
    nc = await connect(opts)
    try:
        return await ensure_all_retrying(lambda wait: nc.jetstream(timeout=wait), layout, timeout_s=timeout_s)
    finally:
        await nc.close()
