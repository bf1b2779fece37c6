"""The Rudder account's JetStream limits (bus/jwt.py), no network: consumers are bounded."""

from __future__ import annotations

import nkeys

from bus import jwt


def test_the_jetstream_account_bounds_its_consumers() -> None:
    acc = jwt.KeyPair.generate(nkeys.PREFIX_BYTE_ACCOUNT)
    limits = jwt.account_claims(acc, name="RUDDER", jetstream=True)["nats"]["limits"]
    assert 0 < limits["consumer"] == jwt.MAX_CONSUMERS <= 100_000
