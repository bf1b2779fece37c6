"""Policy signing keys for tests (DESIGN §9): signatures are on in every test, there is no switch.

:func:`make_policy_keys` makes a keypair and its two files (seed 0600, verify keys) in a folder;
:func:`session_keys` is the one pair of the test session, shared by the default control-plane and
router settings of the fixtures (``tests/integration/cp_support.py``,
``tests/support_router/workers.py``) and by the helpers that publish policy events straight to the
stream as the control plane would (``tests/support_router/policy.py``).
"""

from __future__ import annotations

import atexit
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from nats.aio.client import Client as NATS

from bus.client import Bus
from bus.keyfiles import load_keyring, write_keyring, write_signing_key
from controlplane.eventlog import PolicyLog
from controlplane.protocol.policy import PolicyKind
from controlplane.protocol.signing import Keyring, SigningKey
from controlplane.protocol.subjects import policy_subject


@dataclass(frozen=True)
class PolicyKeys:
    signer: SigningKey
    seed_path: Path
    verify_path: Path

    @property
    def keyring(self) -> Keyring:
        return load_keyring(self.verify_path)

    def sign(self, subject: str, payload: bytes) -> dict[str, str]:
        return self.signer.sign(subject, payload)

    def headers_for(self, model: str, kind: PolicyKind | str, payload: bytes) -> dict[str, str]:
        kind_name = kind.value if isinstance(kind, PolicyKind) else kind
        return self.signer.sign(policy_subject(model, kind_name), payload)

    def env(self) -> dict[str, str]:
        """The variables a control plane and a router process need."""
        return {"RUDDER_POLICY_SIGNING_KEY": str(self.seed_path),
                "RUDDER_POLICY_VERIFY_KEYS": str(self.verify_path)}

    def policy_log(self, nc: NATS) -> PolicyLog:
        """A PolicyLog that signs and verifies as the test control planes do."""
        return PolicyLog(Bus(nc), signer=self.signer, keyring=self.keyring)


def make_policy_keys(directory: Path, *, name: str = "policy") -> PolicyKeys:
    """A fresh keypair: ``<name>.seed`` (mode 0600) and ``<name>.pub`` (its verify-keys file)."""
    signer = SigningKey.generate()
    seed, pub = directory / f"{name}.seed", directory / f"{name}.pub"
    write_signing_key(seed, signer)
    write_keyring(pub, Keyring.of([signer.public_key]))
    return PolicyKeys(signer=signer, seed_path=seed, verify_path=pub)


_session: PolicyKeys | None = None


def session_keys() -> PolicyKeys:
    """The session's keypair (made on first use, removed at exit)."""
    global _session
    if _session is None:
        folder = Path(tempfile.mkdtemp(prefix="rudder-test-keys-"))
        atexit.register(shutil.rmtree, folder, True)
        _session = make_policy_keys(folder)
    return _session
