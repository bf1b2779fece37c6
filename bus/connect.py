"""Connecting to NATS: the one place every Rudder process opens its bus connection.

A :class:`BusOptions` says where (a server list: one URL or a comma-separated cluster list),
as whom (a ``.creds`` file issued by the bus authority) and how (TLS with a CA bundle).
:func:`connect` reconnects forever, does not buffer publishes while disconnected (a publish
reaches a server now or fails, never replayed behind our back), uses the identity's own inbox
prefix, and logs and counts disconnects, reconnects and the server's permission refusals.
Credentials are a file path: the secret never enters settings, logs, ``repr`` or argv.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import ssl
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

import nats
from nats.aio.client import Client as NATS

from bus import jwt
from controlplane.protocol.errors import ConfigurationError, LogUnavailable

log = logging.getLogger(__name__)


class _TlsEofNoise(logging.Filter):
    """asyncio warns "returning true from eof_received() has no effect when using ssl" each time
    nats-py closes a TLS connection: noise that says nothing about the connection."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "eof_received()" not in record.getMessage()


logging.getLogger("asyncio").addFilter(_TlsEofNoise())


def split_servers(url: str) -> list[str]:
    """``"nats://a:4222, nats://b:4222"`` → both; nats-py needs a list for a cluster."""
    servers = [u.strip() for u in url.split(",") if u.strip()]
    if not servers:
        raise ConfigurationError("RUDDER_NATS_URL names no server", field="nats_url")
    return servers


@dataclass
class BusStats:
    """Connection events, for logs and metrics (``rudder_bus_*``)."""

    disconnects: int = 0
    reconnects: int = 0
    permission_errors: int = 0
    last_error: str | None = None


@dataclass(frozen=True)
class BusOptions:
    servers: tuple[str, ...]
    creds: Path | None
    ca: Path | None = None
    name: str = "rudder"
    connect_timeout_s: float = 2.0
    # First connect: how long to keep trying the servers before giving up.
    initial_timeout_s: float = 30.0
    stats: BusStats = field(default_factory=BusStats, compare=False)

    @classmethod
    def from_settings(cls, *, nats_url: str, nats_creds: Path | None, nats_ca: Path | None,
                      name: str, connect_timeout_s: float = 2.0) -> BusOptions:
        return cls(servers=tuple(split_servers(nats_url)), creds=nats_creds, ca=nats_ca, name=name,
                   connect_timeout_s=connect_timeout_s)

    def inbox_prefix(self) -> str | None:
        """The identity's own inbox prefix, read from its JWT (``_INBOX.<name>.>`` in sub allow)."""
        if self.creds is None:
            return None
        claims = jwt.decode_unverified(jwt.jwt_from_creds(self.creds.read_text()))
        for subject in claims.get("nats", {}).get("sub", {}).get("allow", []):
            if subject.startswith("_INBOX.") and subject.endswith(".>"):
                return str(subject[:-2])
        return None

    def identity_name(self) -> str | None:
        if self.creds is None:
            return None
        claims = jwt.decode_unverified(jwt.jwt_from_creds(self.creds.read_text()))
        name = claims.get("name")
        return str(name) if name else None

    def tls_context(self) -> ssl.SSLContext | None:
        if self.ca is None and not any(s.startswith("tls://") for s in self.servers):
            return None
        ctx = ssl.create_default_context(cafile=str(self.ca) if self.ca else None)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        return ctx


def _check_creds(opts: BusOptions) -> None:
    if opts.creds is None:
        raise ConfigurationError(
            "no NATS credentials: set RUDDER_NATS_CREDS to the .creds file issued for this process "
            "(`rudder bus creds`); the bus refuses anonymous connections", field="nats_creds")
    try:
        text = opts.creds.read_text()
        jwt.jwt_from_creds(text)
    except OSError as exc:
        raise ConfigurationError(f"RUDDER_NATS_CREDS: cannot read {opts.creds}: {exc.strerror}",
                                 field="nats_creds") from exc
    except ValueError as exc:
        raise ConfigurationError(f"RUDDER_NATS_CREDS: {opts.creds} is not a NATS credentials file",
                                 field="nats_creds") from exc
    if opts.ca is not None and not opts.ca.is_file():
        raise ConfigurationError(f"RUDDER_NATS_CA: {opts.ca} is not a file", field="nats_ca")


async def connect(opts: BusOptions, *, on_error: Callable[[Exception], Awaitable[None]] | None = None) -> NATS:
    """Open the connection, or raise :class:`ConfigurationError` (credentials refused or missing)
    or :class:`LogUnavailable` (no server answered)."""
    _check_creds(opts)
    stats = opts.stats
    name = opts.name

    refused = asyncio.Event()
    connected = False

    async def error_cb(exc: Exception) -> None:
        text = str(exc)
        stats.last_error = text
        if "authorization violation" in text.lower() and not connected:
            refused.set()  # wrong credentials: retrying will not help, stop start-up
            return
        if "permissions violation" in text:
            stats.permission_errors += 1
            log.error("bus %s: the server refused: %s", name, text)
        else:
            log.warning("bus %s: %s", name, text)
        if on_error is not None:
            await on_error(exc)

    async def disconnected_cb() -> None:
        stats.disconnects += 1
        log.info("bus %s: disconnected (%d so far)", name, stats.disconnects)

    async def reconnected_cb() -> None:
        stats.reconnects += 1
        log.info("bus %s: reconnected", name)

    kwargs: dict[str, object] = {}
    prefix = opts.inbox_prefix()
    if prefix:
        kwargs["inbox_prefix"] = prefix
    tls = opts.tls_context()
    if tls is not None:
        kwargs["tls"] = tls
    connecting = asyncio.ensure_future(nats.connect(
        list(opts.servers), name=name, user_credentials=str(opts.creds),
        max_reconnect_attempts=-1, reconnect_time_wait=0.5, pending_size=0,
        connect_timeout=max(1, int(opts.connect_timeout_s)), allow_reconnect=True,
        error_cb=error_cb, disconnected_cb=disconnected_cb, reconnected_cb=reconnected_cb,
        **kwargs,
    ))
    refusal = asyncio.ensure_future(refused.wait())
    try:
        done, _ = await asyncio.wait({connecting, refusal}, timeout=opts.initial_timeout_s,
                                     return_when=asyncio.FIRST_COMPLETED)
    finally:
        refusal.cancel()
    if connecting in done:
        nc: NATS = connecting.result()
        connected = True
        return nc
    connecting.cancel()
    with contextlib.suppress(BaseException):
        await connecting
    if refused.is_set():
        raise ConfigurationError(
            f"NATS refused the credentials in RUDDER_NATS_CREDS ({opts.creds}) as {name}",
            field="nats_creds")
    raise LogUnavailable(f"no NATS server answered at {', '.join(opts.servers)} within "
                         f"{opts.initial_timeout_s:g} s: {stats.last_error}", retry_after=2)
