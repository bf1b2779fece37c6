"""Named failpoints for fault-injection tests and game days (like etcd's gofail).

A failpoint is armed by name (``RUDDER_FAILPOINTS=after_publish`` or ``Failpoints.arm``) and raises
``InjectedFault`` when the code passes it. Disarmed failpoints cost one set lookup.
"""

from __future__ import annotations

from collections.abc import Iterable

KNOWN = frozenset({"after_received", "after_publish", "before_decision"})


class InjectedFault(RuntimeError):
    """Raised at an armed failpoint. Deliberately not a RudderError: it simulates a crash."""


class Failpoints:
    def __init__(self, armed: Iterable[str] = ()) -> None:
        self._armed: dict[str, int | None] = {}
        for name in armed:
            self.arm(name)

    def arm(self, name: str, *, times: int | None = None) -> None:
        if name not in KNOWN:
            raise ValueError(f"unknown failpoint {name!r}; known: {sorted(KNOWN)}")
        self._armed[name] = times

    def disarm(self, name: str) -> None:
        self._armed.pop(name, None)

    def hit(self, name: str) -> None:
        if name not in self._armed:
            return
        remaining = self._armed[name]
        if remaining is not None:
            if remaining <= 1:
                del self._armed[name]
            else:
                self._armed[name] = remaining - 1
        raise InjectedFault(f"failpoint {name} triggered")
