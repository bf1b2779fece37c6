"""The bus authority: the operator and account keys that make NATS identities (files, no network).

A folder (``.rudder/bus`` under ``rudder up``; a Secret in Kubernetes) holds::

    operator.seed  operator.jwt      the operator: signs accounts; the server trusts its JWT
    account.seed   account.jwt       the RUDDER account (JetStream on): signs every user
    system.seed    system.jwt        the system account (server internals, monitoring)
    server-auth.conf                 what nats-server includes: operator, resolver, accounts
    revocations.json                 revoked users (public key → time, name): in the account JWT
    creds/<name>.creds               issued user credentials (JWT + seed), mode 0600

A user is revoked in the RUDDER account's JWT (:meth:`BusAuthority.revoke`): nats-server refuses
its credentials issued up to the revocation's time, and credentials issued later for the same
identity are valid. The account JWT is in ``server-auth.conf``'s MEMORY resolver preload, which
nats-server reads when it starts (a configuration reload did not apply it here: decision 126).

Seeds are written with mode 0600 and never logged. Whoever holds ``account.seed`` can issue any
identity: it belongs to the bus admin (``rudder bus``, ``rudder up``), never to a long-running
service.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from bus import jwt
from bus.identities import Identity, permissions


def write_secret(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` readable by its owner only (created 0600, never wider)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write(text)
    os.replace(tmp, path)


class BusAuthority:
    """Operator and account keys in ``home``; issues user credentials."""

    def __init__(self, home: Path, *, operator: jwt.KeyPair, account: jwt.KeyPair,
                 system: jwt.KeyPair) -> None:
        self.home = Path(home)
        self._operator = operator
        self._account = account
        self._system = system

    def __repr__(self) -> str:
        return f"BusAuthority(home={str(self.home)!r}, account={self._account.public!r})"

    @property
    def account_public_key(self) -> str:
        return self._account.public

    @classmethod
    def open(cls, home: Path, *, create: bool = True) -> BusAuthority:
        """Load the keys in ``home``, generating them (and the server include) on first use.

        Raises FileNotFoundError when ``create`` is false and the folder has no keys."""
        home = Path(home)
        names = {"operator": jwt.operator_key, "account": jwt.account_key, "system": jwt.account_key}
        keys: dict[str, jwt.KeyPair] = {}
        for name, make in names.items():
            seed_file = home / f"{name}.seed"
            if seed_file.exists():
                keys[name] = jwt.KeyPair.from_seed(seed_file.read_bytes().strip())
            elif create:
                keys[name] = make()
                write_secret(seed_file, keys[name].seed.decode() + "\n")
            else:
                raise FileNotFoundError(f"no bus authority in {home} ({seed_file.name} is missing)")
        authority = cls(home, operator=keys["operator"], account=keys["account"], system=keys["system"])
        authority._write_server_config()
        return authority

    def _write_server_config(self) -> None:
        op, acc, sys_ = self._operator, self._account, self._system
        op_jwt = jwt.encode(jwt.operator_claims(op, name="rudder", system_account=sys_.public), op)
        revoked = {key: at for key, (at, _) in self.revocations().items()}
        acc_jwt = jwt.encode(jwt.account_claims(acc, name="RUDDER", jetstream=True, revocations=revoked), op)
        sys_jwt = jwt.encode(jwt.account_claims(sys_, name="SYS", jetstream=False), op)
        for name, token in (("operator", op_jwt), ("account", acc_jwt), ("system", sys_jwt)):
            (self.home / f"{name}.jwt").write_text(token + "\n")
        # JWTs are public (signed, no secrets): the include may be world-readable.
        (self.home / "server-auth.conf").write_text(
            "# NATS decentralised auth for Rudder (written by the bus authority; do not edit)\n"
            f'operator: "{op_jwt}"\n'
            f"system_account: {sys_.public}\n"
            "resolver: MEMORY\n"
            "resolver_preload: {\n"
            f'  {sys_.public}: "{sys_jwt}"\n'
            f'  {acc.public}: "{acc_jwt}"\n'
            "}\n"
        )

    def revocations(self) -> dict[str, tuple[int, str]]:
        """Revoked users: public key → (epoch seconds, identity name)."""
        path = self.home / "revocations.json"
        if not path.exists():
            return {}
        data = json.loads(path.read_text())
        return {str(key): (int(entry["at"]), str(entry.get("name", ""))) for key, entry in data.items()}

    def revoke(self, user_public: str, *, name: str = "", at: int | None = None) -> int:
        """Revoke a user (its public key, ``U...``): nats-server refuses its credentials issued at
        or before ``at`` (now) once it restarts with the include rewritten here. Returns ``at``."""
        if not (user_public.startswith("U") and len(user_public) == 56):
            raise ValueError(f"not a NATS user public key: {user_public!r}")
        when = int(time.time()) if at is None else at
        revoked = {key: {"at": t, "name": n} for key, (t, n) in self.revocations().items()}
        revoked[user_public] = {"at": when, "name": name}
        write_secret(self.home / "revocations.json", json.dumps(revoked, indent=2, sort_keys=True) + "\n")
        self._write_server_config()
        return when

    @property
    def server_config(self) -> Path:
        """The file a nats-server config includes (``include "<path>"``)."""
        return self.home / "server-auth.conf"

    def issue_text(self, identity: Identity, *, expires_at: int | None = None) -> str:
        """A fresh user key for ``identity`` and its JWT, as ``.creds`` text."""
        user = jwt.user_key()
        claims = jwt.user_claims(user.public, name=identity.name, permissions=permissions(identity),
                                 expires_at=expires_at)
        return jwt.creds_file_text(jwt.encode(claims, self._account), user.seed)

    def issue(self, identity: Identity, path: Path | None = None, *, expires_at: int | None = None) -> Path:
        """Write credentials for ``identity`` (0600) and return their path."""
        target = path or self.home / "creds" / f"{identity.name}.creds"
        write_secret(target, self.issue_text(identity, expires_at=expires_at))
        return target
