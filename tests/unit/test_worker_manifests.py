"""Worker manifests (issue 17 item 1), without a network: a record is bounded by its manifest,
refused outside it; a manifest signature never verifies as a policy event; the router holds only
verified manifests and never an older one over a newer one."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from controlplane.protocol.errors import SignatureInvalid, ValidationFailed
from controlplane.protocol.events import EngineTiming, MembershipEvent, MembershipOp, RankLoad, WorkerRecord
from controlplane.protocol.guard import Drops
from controlplane.protocol.manifests import ManifestSpec, WorkerManifest, bound, parse_spec
from controlplane.protocol.signing import Keyring, Purpose, SigningKey
from controlplane.protocol.subjects import manifest_subject
from router.manifests import ManifestBook, ManifestConsumer

pytestmark = pytest.mark.timeout(20)

SPEC = {"model": "m", "max_dp_size": 2, "block_size": 16, "max_kv_blocks": 1000, "url_allow": "10.0.0.0/8"}


def _event(**update: object) -> MembershipEvent:
    rec = WorkerRecord(instance_id=7, model="m", url="http://10.1.2.3:8000", dp_size=1024, block_size=16,
                       kv_total_blocks=2**32, max_num_batched_tokens=8192, started_at=datetime.now(UTC))
    rec = rec.model_copy(update=update)
    return MembershipEvent(op=MembershipOp.HEARTBEAT, worker=rec,
                           load=[RankLoad(dp_rank=r) for r in range(min(4, rec.dp_size))], at=datetime.now(UTC))


def _manifest(at: datetime | None = None, **spec: object) -> WorkerManifest:
    return WorkerManifest(instance_id=7, spec=parse_spec({**SPEC, **spec}), issued_by="admin",
                          issued_at=at or datetime.now(UTC))


def test_a_record_is_cut_to_its_manifest_and_takes_the_issued_prior() -> None:
    timing = EngineTiming(prefill_ms=(10.0, 0.01, 0.0), decode_ms=(5.0, 0.0, 0.0))
    zero = EngineTiming(prefill_ms=(0.0, 0.0, 0.0), decode_ms=(0.0, 0.0, 0.0))
    capped, cut = bound(_event(timing=zero), _manifest(timing=timing.model_dump()))
    assert cut == ["dp_size", "kv_total_blocks"]
    assert (capped.worker.dp_size, capped.worker.kv_total_blocks) == (2, 1000)
    assert capped.worker.timing == timing and [r.dp_rank for r in capped.load] == [0, 1]
    honest = _event(dp_size=2, kv_total_blocks=1000)
    assert bound(honest, _manifest()) == (honest, [])


@pytest.mark.parametrize(("update", "field"), [
    ({"model": "other"}, "model"), ({"block_size": 32}, "block_size"), ({"engine": "vllm"}, "engine"),
    ({"url": "http://127.0.0.1:8080"}, "url"),
])
def test_a_record_outside_its_manifest_is_refused_naming_the_field(update: dict[str, object], field: str) -> None:
    with pytest.raises(ValidationFailed) as err:
        bound(_event(**update), _manifest())
    assert err.value.field == field


def test_a_bad_spec_names_the_field() -> None:
    for body, field in (({**SPEC, "max_dp_size": 0}, "max_dp_size"), ({**SPEC, "max_dp_size": True}, "max_dp_size"),
                        ({**SPEC, "extra": 1}, "extra"), ({**SPEC, "url_allow": "a b"}, "url_allow"),
                        ({**SPEC, "role": "boss"}, "role")):
        with pytest.raises(ValidationFailed) as err:
            parse_spec(body)
        assert err.value.field == field, body
    assert parse_spec(SPEC) == ManifestSpec.model_validate(SPEC)


def test_a_manifest_signature_is_not_a_policy_signature() -> None:
    key = SigningKey.generate()
    subject, payload = manifest_subject(7), _manifest().to_bytes()
    headers = key.for_purpose(Purpose.MANIFEST).sign(subject, payload)
    policy_keys = Keyring.of([key.public_key])
    assert policy_keys.for_purpose(Purpose.MANIFEST).verify(subject, payload, headers) == key.key_id
    with pytest.raises(SignatureInvalid):
        policy_keys.verify(subject, payload, headers)
    with pytest.raises(SignatureInvalid):
        policy_keys.for_purpose(Purpose.MANIFEST).verify(subject, payload, key.sign(subject, payload))


def test_the_router_holds_only_verified_manifests_and_never_an_older_one() -> None:
    import logging

    key = SigningKey.generate().for_purpose(Purpose.MANIFEST)
    book = ManifestBook()
    drops = Drops(logging.getLogger("test"))
    consumer = ManifestConsumer(None, book, keyring=lambda: Keyring.of([key.public_key]), drops=drops)  # type: ignore[arg-type]
    subject = manifest_subject(7)
    now = datetime.now(UTC)
    new, old = _manifest(now).to_bytes(), _manifest(now - timedelta(hours=1), max_dp_size=1024).to_bytes()
    assert consumer.accept(subject, new, key.sign(subject, new)) is not None
    assert consumer.accept(subject, old, key.sign(subject, old)) is None  # a replay of an older one
    assert consumer.accept(subject, old, {}) is None
    other = SigningKey.generate(Purpose.MANIFEST)
    assert consumer.accept(subject, old, other.sign(subject, old)) is None
    assert consumer.accept(manifest_subject(8), new, key.sign(manifest_subject(8), new)) is None
    held = book.get(7)
    assert held is not None and held.spec.max_dp_size == 2 and len(book) == 1
    assert drops.totals == {("manifest", "replayed"): 1, ("manifest", "signature_missing"): 1,
                            ("manifest", "signature_unknown_key"): 1, ("manifest", "subject_mismatch"): 1}
