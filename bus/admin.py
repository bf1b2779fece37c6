"""The bus admin's one-shot job: create and update streams and buckets (``rudder bus init``)."""

from __future__ import annotations

from bus.connect import BusOptions, connect
from bus.streams import PROBE_TIMEOUT_S, BusLayout, ensure_all_retrying


async def bus_init(opts: BusOptions, layout: BusLayout, *, timeout_s: float = 30.0) -> list[str]:
    """Connect as the admin identity and bring every stream and bucket to ``layout``.

    Returns what changed (empty when everything was already in place). Raises
    ConfigurationError when the credentials are refused, LogUnavailable when no server answers."""
    nc = await connect(opts)
    try:
        return await ensure_all_retrying(nc.jetstream(timeout=5.0), layout, timeout_s=timeout_s,
                                         probe=nc.jetstream(timeout=PROBE_TIMEOUT_S))
    finally:
        await nc.close()
