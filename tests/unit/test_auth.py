"""Roles, actions and token hashing (pure, no network)."""

from __future__ import annotations

import hashlib

from controlplane.auth import (
    ROLE_ACTIONS,
    Action,
    Principal,
    Role,
    generate_token,
    hash_token,
)


def test_role_table() -> None:
    def can(role: Role) -> set[Action]:
        p = Principal(name="t", role=role, token_id=1)
        return {a for a in Action if p.can(a)}

    assert can(Role.VIEWER) == {Action.READ_POLICY}
    assert can(Role.OPERATOR) == {Action.READ_POLICY, Action.WRITE_POLICY}
    assert can(Role.AUDITOR) == {Action.READ_POLICY, Action.READ_AUDIT}
    assert can(Role.ADMIN) == set(Action)
    assert set(ROLE_ACTIONS) == set(Role)


def test_tokens_are_random_prefixed_and_hashed_with_sha256() -> None:
    tokens = {generate_token() for _ in range(100)}
    assert len(tokens) == 100
    for token in tokens:
        assert token.startswith("rdr_") and len(token) >= 4 + 43
    token = next(iter(tokens))
    assert hash_token(token) == hashlib.sha256(token.encode()).hexdigest()
    assert token not in hash_token(token)
