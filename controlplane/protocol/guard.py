"""Hostile but well-formed bus input: the worker URL allow-list and the drop report (DESIGN §9).

Pure, apart from logging: no NATS, no sockets, no DNS.

- :class:`UrlAllowList` decides whether a worker URL may receive traffic. Entries are CIDR networks
  (``10.0.0.0/8``, ``fd00::/8``, a single address) and host names (``worker-1``, or ``*.svc`` for
  every name below ``svc``), or exact addresses with a port (``127.0.0.1:8123``, ``[::1]:8123``,
  ``worker-1:8000``: that host on that port only, which is what ``rudder up`` lists, so a worker
  cannot point routers at the control plane on the same host). An IP-literal host must fall inside
  a listed network; a named host must match a listed name. Names are never resolved: resolving at
  discovery would be I/O inside the scheduler and would answer differently at connect time (DNS
  rebinding). The scheme must be ``http`` or ``https``; user information in a URL
  (``http://user:pass@host``) is refused.
  :data:`DEFAULT_WORKER_URL_ALLOW` is loopback and the private ranges; link-local
  (``169.254.0.0/16``, where cloud metadata services answer) is deliberately not in it.
- :class:`Drops` reports a dropped message: logged once per (kind, reason, source) with its ids,
  counted every time through a callback (the process's metric).
"""

from __future__ import annotations

import ipaddress
import logging
from collections.abc import Callable
from dataclasses import dataclass
from urllib.parse import urlsplit

from controlplane.protocol.errors import ValidationFailed

DEFAULT_WORKER_URL_ALLOW = (
    "127.0.0.0/8,::1/128,10.0.0.0/8,172.16.0.0/12,192.168.0.0/16,fc00::/7,localhost"
)
ALLOWED_SCHEMES = frozenset({"http", "https"})

Network = ipaddress.IPv4Network | ipaddress.IPv6Network


@dataclass(frozen=True, slots=True)
class UrlAllowList:
    networks: tuple[Network, ...]
    names: frozenset[str]  # exact host names, lower case
    suffixes: tuple[str, ...]  # ".svc" for an entry "*.svc"
    addresses: frozenset[tuple[str, int]] = frozenset()  # (host, port) for an entry "host:port"

    @classmethod
    def parse(cls, spec: str, *, field: str = "worker_url_allow") -> UrlAllowList:
        """Parse a comma-separated list. Raises ValidationFailed naming ``field`` and the entry."""
        networks: list[Network] = []
        names: set[str] = set()
        suffixes: list[str] = []
        addresses: set[tuple[str, int]] = set()
        for raw in spec.split(","):
            entry = raw.strip().lower()
            if not entry:
                continue
            address = _host_port(entry)
            if address is not None:
                addresses.add(address)
                continue
            try:
                networks.append(ipaddress.ip_network(entry, strict=False))
                continue
            except ValueError:
                pass
            name = entry[2:] if entry.startswith("*.") else entry
            if not name or not all(_label_ok(label) for label in name.split(".")):
                raise ValidationFailed(
                    f"{field}: {raw.strip()!r} is neither a CIDR network nor a host name", field=field
                )
            if entry.startswith("*."):
                suffixes.append("." + name)
            else:
                names.add(name)
        if not networks and not names and not suffixes and not addresses:
            raise ValidationFailed(f"{field}: the allow-list is empty; no worker could be reached",
                                   field=field)
        return cls(tuple(networks), frozenset(names), tuple(suffixes), frozenset(addresses))

    def check(self, url: str) -> None:
        """Raise ValidationFailed (field ``url``) unless ``url`` may receive traffic."""
        try:
            parts = urlsplit(url)
            host = parts.hostname
            parts.port  # noqa: B018 - raises ValueError for a port that is not a number in range
        except ValueError as exc:
            raise ValidationFailed(f"url {url!r} is not a URL: {exc}", field="url") from exc
        if parts.scheme not in ALLOWED_SCHEMES:
            raise ValidationFailed(f"url {url!r}: scheme must be http or https", field="url")
        if parts.username is not None or parts.password is not None:
            raise ValidationFailed(f"url {url!r}: user information is not allowed", field="url")
        if not host:
            raise ValidationFailed(f"url {url!r} has no host", field="url")
        port = parts.port if parts.port is not None else (443 if parts.scheme == "https" else 80)
        if (host, port) in self.addresses:
            return
        try:
            address = ipaddress.ip_address(host)
        except ValueError:
            address = None
        if address is not None:
            if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
                address = address.ipv4_mapped
            if any(address in net for net in self.networks):
                return
        elif host in self.names or any(host.endswith(s) for s in self.suffixes):
            return
        raise ValidationFailed(
            f"url {url!r}: host {host} is not in the worker URL allow-list", field="url"
        )

    def allows(self, url: str) -> bool:
        try:
            self.check(url)
        except ValidationFailed:
            return False
        return True


def _host_port(entry: str) -> tuple[str, int] | None:
    """``host:port`` or ``[v6]:port`` as (host, port); None for anything else (a CIDR, a name)."""
    host, sep, port = entry.rpartition(":")
    if not sep or not port.isdigit() or not 0 < int(port) < 65536:
        return None
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
        try:
            return str(ipaddress.IPv6Address(host)), int(port)
        except ValueError:
            return None
    if ":" in host or not host:
        return None  # a bare IPv6 network, not an address with a port
    try:
        return str(ipaddress.IPv4Address(host)), int(port)
    except ValueError:
        pass
    return (host, int(port)) if all(_label_ok(label) for label in host.split(".")) else None


def _label_ok(label: str) -> bool:
    return 0 < len(label) <= 63 and all(c.isascii() and (c.isalnum() or c in "-_") for c in label)


class Drops:
    """Report dropped bus messages: one log line per (kind, reason, source), a count every time.

    ``source`` is the subject or key the message came on. The set of sources already logged is
    bounded, so a flood of distinct subjects cannot grow memory; past the bound, drops are still
    counted and one line says that further sources are not logged.
    """

    def __init__(
        self, logger: logging.Logger, *, count: Callable[[str, str], None] | None = None,
        max_sources: int = 4096,
    ) -> None:
        self.log = logger
        self.count = count
        self.max_sources = max_sources
        self._logged: set[tuple[str, str, str]] = set()
        self._full_noted = False
        self.totals: dict[tuple[str, str], int] = {}

    def drop(self, kind: str, reason: str, source: str, detail: str) -> None:
        key = (kind, reason)
        self.totals[key] = self.totals.get(key, 0) + 1
        if self.count is not None:
            self.count(kind, reason)
        seen = (kind, reason, source)
        if seen in self._logged:
            return
        if len(self._logged) >= self.max_sources:
            if not self._full_noted:
                self._full_noted = True
                self.log.warning("more than %d sources of dropped bus messages; no longer logging "
                                 "new ones (still counted)", self.max_sources)
            return
        self._logged.add(seen)
        self.log.warning("dropped %s from %s (%s): %s", kind, _printable(source), reason, _printable(detail))


def _printable(text: str, limit: int = 500) -> str:
    """Payload-chosen text made safe for one log line: control characters escaped, truncated."""
    clean = text if text.isprintable() else repr(text)[1:-1]
    return clean if len(clean) <= limit else clean[:limit] + "…"
