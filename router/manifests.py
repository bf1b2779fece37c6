"""Worker manifests at the router: read, verified, and held for the membership edge (issue 17).

:class:`ManifestConsumer` reads ``RUDDER_MANIFESTS`` (an ordered consumer: the last manifest of
every worker, then live) and keeps, per worker, the last manifest whose signature verifies with
the router's policy verify keys under the manifest purpose (:class:`ManifestBook`). A message
that does not verify (unsigned, an unknown key, a bad signature: what a stolen NATS credential of
the control plane can publish without its signing key), does not decode, speaks for another
worker than its subject's, or is older than the manifest held (a replay) is dropped, counted on
``/metrics`` (``rudder_router_bus_dropped_total{kind="manifest"}``) and changes nothing: the
worker keeps the last good manifest, or the router's defaults if it never had one.

The membership edge (:class:`router.consumers.MembershipConsumer`) bounds each record by the
worker's manifest (:func:`controlplane.protocol.manifests.bound`); a worker without one by the
router's conservative :class:`~router.claims.ClaimCaps`. A new manifest applies from the worker's
next membership message (a heartbeat a second by default).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from bus.client import Bus, Message, Subscription
from controlplane.protocol.errors import InvalidRequest, SignatureInvalid, SubjectMismatch
from controlplane.protocol.guard import Drops
from controlplane.protocol.manifests import WorkerManifest, check_manifest_subject, decode_manifest
from controlplane.protocol.signing import Keyring, Purpose
from controlplane.protocol.subjects import MANIFESTS_SUBJECTS, STREAM_MANIFESTS

log = logging.getLogger(__name__)


class ManifestBook:
    """The verified manifest of each worker (pure; filled by :class:`ManifestConsumer`)."""

    def __init__(self) -> None:
        self._by_worker: dict[int, WorkerManifest] = {}

    def get(self, instance_id: int) -> WorkerManifest | None:
        return self._by_worker.get(instance_id)

    def put(self, manifest: WorkerManifest) -> bool:
        """Hold ``manifest`` unless the one held was issued later (a replay); True if held."""
        held = self._by_worker.get(manifest.instance_id)
        if held is not None and held.issued_at > manifest.issued_at:
            return False
        self._by_worker[manifest.instance_id] = manifest
        return True

    def __len__(self) -> int:
        return len(self._by_worker)


class ManifestConsumer:
    def __init__(self, bus: Bus, book: ManifestBook, *, keyring: Callable[[], Keyring], drops: Drops,
                 ready_timeout_s: float = 2.0) -> None:
        self.bus = bus
        self.book = book
        self.keyring = keyring
        self.drops = drops
        self.ready_timeout_s = ready_timeout_s
        self._subs: list[Subscription] = []
        self._loaded = asyncio.Event()

    async def start(self) -> None:
        """Subscribe, and wait (up to the timeout) until the manifests already issued are held, so
        the first membership records are bounded by them."""
        sub = await self.bus.ordered(STREAM_MANIFESTS, [MANIFESTS_SUBJECTS], self._on_msg)
        self._subs.append(sub)
        if await sub.nothing_to_replay():
            self._loaded.set()
        try:
            await asyncio.wait_for(self._loaded.wait(), self.ready_timeout_s)
        except TimeoutError:
            log.warning("manifest replay not confirmed in %.1fs; serving anyway", self.ready_timeout_s)

    async def stop(self) -> None:
        for sub in self._subs:
            await sub.stop()
        self._subs.clear()

    async def _on_msg(self, msg: Message) -> None:
        try:
            self.accept(msg.subject, msg.data, dict(msg.headers))
        finally:
            if msg.pending == 0:
                self._loaded.set()

    def accept(self, subject: str, data: bytes, headers: dict[str, str]) -> WorkerManifest | None:
        """Hold the manifest of one message if it verifies; else drop and count it."""
        try:
            self.keyring().for_purpose(Purpose.MANIFEST).verify(subject, data, headers)
            manifest = decode_manifest(data)
            check_manifest_subject(subject, manifest)
        except SignatureInvalid as exc:
            self.drops.drop("manifest", exc.reason_code, subject, exc.message)
            return None
        except InvalidRequest as exc:
            reason = "subject_mismatch" if isinstance(exc, SubjectMismatch) else "malformed"
            self.drops.drop("manifest", reason, subject, exc.message)
            return None
        if not self.book.put(manifest):
            self.drops.drop("manifest", "replayed", subject,
                            f"manifest of worker {manifest.instance_id} issued before the one held")
            return None
        log.info("manifest of worker %s held (issued by %s at %s)", manifest.instance_id,
                 manifest.issued_by, manifest.issued_at.isoformat())
        return manifest
