"""NATS JWTs (operator, account and user claims, version 2), signed with nkeys.

NATS's decentralised authentication: an *operator* key signs *account* JWTs, an account key
signs *user* JWTs. The server trusts the operator (its JWT is in the server config) and the
accounts it is preloaded with; a client proves it holds the user's seed by signing the server's
nonce, and the server takes the user's permissions from the JWT itself. So a new identity
needs no change to the server: it needs a JWT signed by the account key, which only
``rudder bus`` (the bus admin) holds.

This module is pure: claims in, compact JWT out, no files and no network.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import time
from dataclasses import dataclass
from typing import Any

import nkeys

_HEADER = {"typ": "JWT", "alg": "ed25519-nkey"}
_NO_LIMIT = -1


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


@dataclass(frozen=True, slots=True)
class KeyPair:
    """An nkey pair: ``seed`` is the secret (``S…``), ``public`` names it (``O…``, ``A…``, ``U…``)."""

    seed: bytes
    public: str

    def __repr__(self) -> str:  # the seed never reaches a log
        return f"KeyPair(public={self.public!r})"

    @classmethod
    def generate(cls, prefix: int) -> KeyPair:
        # An nkey seed is a random 32-byte Ed25519 seed in NATS's own encoding; nkeys signs.
        return cls.from_seed(nkeys.encode_seed(os.urandom(32), prefix))

    @classmethod
    def from_seed(cls, seed: bytes) -> KeyPair:
        kp = nkeys.from_seed(bytearray(seed))
        return cls(seed=bytes(seed), public=kp.public_key.decode())

    def sign(self, data: bytes) -> bytes:
        signed: bytes = nkeys.from_seed(bytearray(self.seed)).sign(data)
        return signed


def operator_key() -> KeyPair:
    return KeyPair.generate(nkeys.PREFIX_BYTE_OPERATOR)


def account_key() -> KeyPair:
    return KeyPair.generate(nkeys.PREFIX_BYTE_ACCOUNT)


def user_key() -> KeyPair:
    return KeyPair.generate(nkeys.PREFIX_BYTE_USER)


def encode(claims: dict[str, Any], issuer: KeyPair) -> str:
    """Sign ``claims`` (``iss`` is set to the issuer, ``jti`` to the hash of the claims)."""
    body = dict(claims, iss=issuer.public, iat=int(claims.get("iat") or time.time()), jti="")
    digest = hashlib.new("sha512_256", json.dumps(body, sort_keys=True).encode()).digest()
    body["jti"] = base64.b32encode(digest).decode().rstrip("=")
    head = _b64(json.dumps(_HEADER, separators=(",", ":")).encode())
    payload = _b64(json.dumps(body, separators=(",", ":")).encode())
    signature = issuer.sign(f"{head}.{payload}".encode())
    return f"{head}.{payload}.{_b64(signature)}"


def decode_unverified(token: str) -> dict[str, Any]:
    """The claims of a JWT, not verified (the server verifies; we only read our own files)."""
    try:
        _, payload, _ = token.split(".")
        claims = json.loads(_unb64(payload))
    except (ValueError, json.JSONDecodeError) as exc:
        raise ValueError("not a NATS JWT") from exc
    if not isinstance(claims, dict):
        raise ValueError("not a NATS JWT")
    return claims


def operator_claims(op: KeyPair, *, name: str, system_account: str) -> dict[str, Any]:
    return {
        "sub": op.public, "name": name,
        "nats": {"type": "operator", "version": 2, "system_account": system_account},
    }


#: JetStream consumers the Rudder account may hold at once, every identity together: each router
#: holds a few ordered consumers (policy, membership, its status), the control plane a few more;
#: this leaves room for thousands of routers and stops a runaway (or hostile) creator.
MAX_CONSUMERS = 16_384


def account_claims(acc: KeyPair, *, name: str, jetstream: bool,
                   revocations: dict[str, int] | None = None) -> dict[str, Any]:
    """An account's claims; ``revocations``: user public key → a time (epoch seconds); the
    server refuses that user's JWTs issued at or before it."""
    limits: dict[str, Any] = {
        "subs": _NO_LIMIT, "data": _NO_LIMIT, "payload": _NO_LIMIT, "imports": _NO_LIMIT,
        "exports": _NO_LIMIT, "wildcards": True, "conn": _NO_LIMIT, "leaf": _NO_LIMIT,
    }
    if jetstream:
        # Consumers are bounded (issue 17): a stolen router credential may create consumers on
        # the streams it reads, and without a bound it could create them until the server fails.
        limits.update({"mem_storage": _NO_LIMIT, "disk_storage": _NO_LIMIT, "streams": _NO_LIMIT,
                       "consumer": MAX_CONSUMERS})
    else:
        limits.update({"mem_storage": 0, "disk_storage": 0, "streams": 0, "consumer": 0})
    nats: dict[str, Any] = {"type": "account", "version": 2, "limits": limits,
                            "default_permissions": {"pub": {}, "sub": {}}}
    if revocations:
        nats["revocations"] = dict(revocations)
    return {"sub": acc.public, "name": name, "nats": nats}


@dataclass(frozen=True, slots=True)
class Permissions:
    """Subjects a user may publish to and subscribe to (allow-lists: all else is denied)."""

    publish: tuple[str, ...]
    subscribe: tuple[str, ...]
    deny_publish: tuple[str, ...] = ()
    # Replies to requests it received, without naming the reply subjects (NATS allow_responses).
    responses: bool = False


def user_claims(user_public: str, *, name: str, permissions: Permissions,
                expires_at: int | None = None) -> dict[str, Any]:
    pub: dict[str, Any] = {"allow": list(permissions.publish)}
    if permissions.deny_publish:
        pub["deny"] = list(permissions.deny_publish)
    nats: dict[str, Any] = {
        "type": "user", "version": 2, "pub": pub, "sub": {"allow": list(permissions.subscribe)},
        "subs": _NO_LIMIT, "data": _NO_LIMIT, "payload": _NO_LIMIT,
    }
    if permissions.responses:
        nats["resp"] = {"max": 1, "ttl": 10_000_000_000}  # one reply within 10 s
    claims: dict[str, Any] = {"sub": user_public, "name": name, "nats": nats}
    if expires_at is not None:
        claims["exp"] = expires_at
    return claims


def creds_user(text: str) -> tuple[str, str, int]:
    """(user public key, name, issued at) of a ``.creds`` file's JWT. Raises ValueError."""
    _, sep, rest = text.partition("-----BEGIN NATS USER JWT-----")
    token = rest.partition("------END NATS USER JWT------")[0].strip() if sep else ""
    claims = decode_unverified(token)
    sub, iat = claims.get("sub"), claims.get("iat")
    if not isinstance(sub, str) or not sub.startswith("U") or not isinstance(iat, int):
        raise ValueError("not a NATS user JWT")
    return sub, str(claims.get("name", "")), iat


def creds_file_text(token: str, seed: bytes) -> str:
    """The ``.creds`` format nats clients read (nats-py ``user_credentials=path``)."""
    return (
        "-----BEGIN NATS USER JWT-----\n"
        f"{token}\n"
        "------END NATS USER JWT------\n\n"
        "************************* IMPORTANT *************************\n"
        "NKEY Seed printed below can be used to sign and prove identity.\n"
        "NKEYs are sensitive and should be treated as secrets.\n\n"
        "-----BEGIN USER NKEY SEED-----\n"
        f"{seed.decode()}\n"
        "------END USER NKEY SEED------\n\n"
        "*************************************************************\n"
    )


def jwt_from_creds(text: str) -> str:
    """The user JWT inside a ``.creds`` file's text."""
    lines = text.splitlines()
    for i, line in enumerate(lines):
        if "BEGIN NATS USER JWT" in line and i + 1 < len(lines):
            return lines[i + 1].strip()
    raise ValueError("no NATS user JWT in the credentials file")
