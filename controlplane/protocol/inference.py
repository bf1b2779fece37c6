"""How an OpenAI inference body's fields read where the router must agree with its workers (pure).

The router relays an answer as a stream or reads it whole by the body's ``stream``, and the worker
streams or not by its own reading of the same field. Where the two differ, a streamed answer is
buffered to its end and counted as one first token (or a whole answer is taken for a stream), so
the router reads the field as vLLM does, and the mock engine likewise.
"""

from __future__ import annotations

import json

from pydantic import TypeAdapter, ValidationError

_FLAG: TypeAdapter[bool | None] = TypeAdapter(bool | None)


def lax_bool(value: object, field: str) -> bool:
    """A boolean field of the body read as vLLM's request models read theirs (``bool | None``,
    pydantic's lax mode): for ``stream``, ``"true"``, ``"yes"``, ``"on"``, ``1`` stream and
    ``"false"``, ``"no"``, ``0`` and null do not. Raises ValueError, naming ``field`` and the value,
    for one vLLM refuses (``"x"``, ``2``, a list)."""
    if value is True:
        return True
    if value is False or value is None:
        return False
    try:
        return bool(_FLAG.validate_python(value))
    except ValidationError:
        shown = json.dumps(value)[:40] if isinstance(value, (str, int, float, list, dict)) else repr(value)[:40]
        raise ValueError(f"{field} must be a boolean, got {shown}") from None
