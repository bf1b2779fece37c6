"""Parsing of ``name=value`` pairs on the command line (pure): a write's ``parameters``, the
patch that goes by that one name from here to the write path (``{name: value | None}``).

Values are JSON numbers (``0.8``, ``3``, ``1e-3``) or ``null``. Anything else (strings, ``NaN``,
``Infinity``, booleans) is a usage error naming the pair: the server would refuse it anyway, and
refusing it here gives a clearer message and no audit noise.
"""

from __future__ import annotations

import json
import math
import re
from datetime import UTC, datetime, timedelta

Value = int | float | None
Parameters = dict[str, Value]

_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


class PairError(ValueError):
    """A ``name=value`` argument that cannot be parsed; the message names the pair."""


def parse_value(pair: str, raw: str) -> Value:
    text = raw.strip()
    if text == "null":
        return None
    try:
        value = json.loads(text, parse_constant=_reject_constant)
    except (ValueError, PairError):
        raise PairError(f"{pair!r}: value must be a JSON number or null") from None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise PairError(f"{pair!r}: value must be a JSON number or null")
    if isinstance(value, float) and not math.isfinite(value):
        raise PairError(f"{pair!r}: value must be finite")
    return value


def _reject_constant(name: str) -> float:
    raise PairError(name)


def parse_pair(pair: str) -> tuple[str, Value]:
    """``"name=0.5"`` → ``("name", 0.5)``; raises ``PairError`` naming the pair."""
    name, sep, raw = pair.partition("=")
    name = name.strip()
    if not sep:
        raise PairError(f"{pair!r}: expected name=value")
    if not _NAME.match(name):
        raise PairError(f"{pair!r}: {name!r} is not a parameter name")
    if not raw.strip():
        raise PairError(f"{pair!r}: missing value (use null to remove an override)")
    return name, parse_value(pair, raw)


def parse_parameters(pairs: list[str]) -> Parameters:
    """Parse every pair into the parameters of a write; a name given twice is an error (which one
    wins would be a guess)."""
    out: Parameters = {}
    for pair in pairs:
        name, value = parse_pair(pair)
        if name in out:
            raise PairError(f"{pair!r}: {name} given more than once")
        out[name] = value
    return out


def parse_names(names: list[str]) -> list[str]:
    """Parameter names for ``unset``; ``name=value`` here is a mistake worth naming."""
    out: list[str] = []
    for name in names:
        if not _NAME.match(name):
            raise PairError(f"{name!r}: expected a parameter name")
        if name not in out:
            out.append(name)
    return out


_DURATION = re.compile(r"^(\d+(?:\.\d+)?)\s*(s|m|h|d|w)$")
_UNIT_SECONDS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}


def parse_time(text: str, *, now: datetime) -> str:
    """An ISO-8601 time or a duration ago (``15m``, ``2h``, ``7d``) → ISO-8601 UTC string.

    A time without a zone is taken as UTC (the audit log is in UTC).
    """
    raw = text.strip()
    match = _DURATION.match(raw)
    if match:
        seconds = float(match.group(1)) * _UNIT_SECONDS[match.group(2)]
        moment = now - timedelta(seconds=seconds)
    else:
        try:
            moment = datetime.fromisoformat(raw.replace("Z", "+00:00"))
        except ValueError:
            raise PairError(
                f"{text!r}: expected an ISO-8601 time or a duration like 15m, 2h, 7d"
            ) from None
        if moment.tzinfo is None:
            moment = moment.replace(tzinfo=UTC)
    return moment.astimezone(UTC).isoformat().replace("+00:00", "Z")
