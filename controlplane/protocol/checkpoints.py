"""Audit checkpoints: signed anchors of the audit and ACK hash chains (issue 8, DESIGN §9).

A checkpoint states, for each chain, its head when it was taken (``last_id``, ``last_hash``)
and the ``(id, row_hash)`` of every row since the previous checkpoint (``rows``; its last entry is
the head). Checkpoints go to ``RUDDER_AUDIT_CHECKPOINTS`` (deny delete, deny purge), signed by a
control-plane key (headers ``Rudder-Key-Id``, ``Rudder-Signature``). So whoever can rewrite the
database but not the stream cannot remove the newest rows (the newest checkpoint names a row that
is gone) nor rewrite a row and recompute the chain after it (the checkpoint holding that row's
hash disagrees): ``rudder audit verify`` names the first row that differs.

Pure: pydantic only.
"""

from __future__ import annotations

import itertools
import re
from datetime import datetime
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, model_validator

from controlplane.protocol.events import _decode

#: Rows listed in one chain segment of one checkpoint at most (bounds the message size:
#: about 80 bytes a row, so ~160 kB for both chains).
MAX_SEGMENT_ROWS = 1000

_HEX64 = re.compile(r"^[0-9a-f]{64}$")


def _hash(value: str) -> str:
    if not _HEX64.fullmatch(value):
        raise ValueError("must be 64 lower-case hex digits")
    return value


Hash = Annotated[str, AfterValidator(_hash)]


class ChainSegment(BaseModel):
    """One chain in a checkpoint: its head, and the rows added since the previous checkpoint."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    last_id: int = Field(ge=0)  # 0: the chain is empty
    last_hash: Hash
    rows: list[tuple[Annotated[int, Field(ge=1)], Hash]] = Field(
        default_factory=list, max_length=MAX_SEGMENT_ROWS)

    @model_validator(mode="after")
    def _consistent(self) -> ChainSegment:
        ids = [i for i, _ in self.rows]
        if any(b <= a for a, b in itertools.pairwise(ids)):
            raise ValueError("rows must be in ascending id order")
        if self.rows and self.rows[-1] != (self.last_id, self.last_hash):
            raise ValueError("the last row must be the head (last_id, last_hash)")
        return self

    @property
    def first_id(self) -> int | None:
        return self.rows[0][0] if self.rows else None


class AuditCheckpoint(BaseModel):
    """``(last id, last hash, at)`` of both chains, plus the row hashes that lead there."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    schema_version: Literal[1] = 1
    at: datetime
    writer: str = Field(min_length=1, max_length=128)  # the control plane that took it
    audit: ChainSegment
    acks: ChainSegment

    def to_bytes(self) -> bytes:
        return self.model_dump_json().encode()

    def head(self) -> dict[str, Any]:
        """What an auditor keeps elsewhere: both heads and the time."""
        return {
            "at": self.at.isoformat(),
            "audit": {"last_id": self.audit.last_id, "last_hash": self.audit.last_hash},
            "acks": {"last_id": self.acks.last_id, "last_hash": self.acks.last_hash},
        }


def decode_checkpoint(data: bytes | str | dict[str, Any]) -> AuditCheckpoint:
    """Raises ``InvalidRequest`` naming the first bad field."""
    checkpoint: AuditCheckpoint = _decode(AuditCheckpoint, data)
    return checkpoint
