"""Worker manifests on the bus: issued (signed, published) and listed by the control plane.

A manifest (:mod:`controlplane.protocol.manifests`) is signed with the policy signing key under
the manifest purpose's own domain and stored on ``rudder.manifests.<instance_id>``; the last one
of a subject is the worker's manifest. Listing verifies each against the keys this control plane
trusts, so a message on the stream that the signing key did not sign (a stolen NATS credential
of the control plane can publish there) is listed as ``verified: false`` and routers ignore it.

Raises LogUnavailable (NATS) from :meth:`ManifestStore.issue` and :meth:`ManifestStore.list`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from bus.client import Bus
from controlplane.protocol.errors import InvalidRequest
from controlplane.protocol.events import utcnow
from controlplane.protocol.manifests import (
    ManifestSpec,
    WorkerManifest,
    check_manifest_subject,
    decode_manifest,
)
from controlplane.protocol.signing import Keyring, Purpose, SigningKey
from controlplane.protocol.subjects import MANIFESTS_SUBJECTS, STREAM_MANIFESTS, manifest_subject

log = logging.getLogger(__name__)


class ManifestStore:
    """Issue and list worker manifests. ``signer`` and ``keyring`` are read at each call, so a
    key rotation (re-read key files) applies at once."""

    def __init__(self, bus: Bus, *, signer: Callable[[], SigningKey], keyring: Callable[[], Keyring]) -> None:
        self.bus = bus
        self.signer = signer
        self.keyring = keyring

    async def issue(self, instance_id: int, spec: ManifestSpec, *, actor: str) -> tuple[WorkerManifest, int]:
        """Sign and publish ``spec`` as worker ``instance_id``'s manifest; the manifest and its
        stream sequence."""
        manifest = WorkerManifest(instance_id=instance_id, spec=spec, issued_by=actor, issued_at=utcnow())
        subject = manifest_subject(instance_id)
        payload = manifest.to_bytes()
        headers = self.signer().for_purpose(Purpose.MANIFEST).sign(subject, payload)
        seq = await self.bus.store(subject, payload, headers=headers)
        log.info("manifest of worker %s issued by %s (sequence %d)", instance_id, actor, seq)
        return manifest, seq

    async def list(self) -> list[dict[str, Any]]:
        """The last manifest of every worker, oldest subject first, each with ``verified`` (its
        signature checks against the trusted keys) and, when not, why (``problem``)."""
        last: dict[str, Any] = {}
        async for msg in self.bus.messages(STREAM_MANIFESTS, MANIFESTS_SUBJECTS):
            last[msg.subject] = msg
        keyring = self.keyring().for_purpose(Purpose.MANIFEST)
        out = []
        for subject, msg in last.items():
            entry: dict[str, Any] = {"subject": subject, "revision": msg.seq, "verified": False}
            try:
                manifest = decode_manifest(msg.data)
                check_manifest_subject(subject, manifest)
                entry.update(manifest.model_dump(mode="json"))
                entry["signed_by"] = keyring.verify(subject, msg.data, msg.headers)
                entry["verified"] = True
            except InvalidRequest as exc:
                entry["problem"] = exc.message
            out.append(entry)
        return out
