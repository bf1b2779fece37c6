"""Explicit worker targets: the ``nvext`` object and the ``x-*`` headers (DESIGN §5). Pure.

Which field names the worker depends on the phase this router selects for:

- aggregated and decode: ``decode_worker_id``, else ``backend_instance_id``, with ``dp_rank``;
- prefill: ``prefill_worker_id``, else ``backend_instance_id``, with ``prefill_dp_rank``, else
  ``dp_rank``.

Headers override the field they stand for: ``x-worker-instance-id`` → ``decode_worker_id``,
``x-prefill-instance-id`` → ``prefill_worker_id``, ``x-dp-rank`` → ``dp_rank``,
``x-prefill-dp-rank`` → ``prefill_dp_rank``. Ids span the full u64 range and may be given as JSON
integers or decimal strings (clients in languages without 64-bit integers need the latter).

:func:`parse_targets` checks the request alone (400 for a malformed id, a rank without a worker)
and keeps both phases' targets; which one applies, and whether a prefill field is allowed at all,
depends on the deployment, which the scheduler knows (:func:`parse_pin` decides it from a router
role). :func:`resolve_pin` checks a target against the discovery snapshot and the pool of its
phase (400 unknown worker or rank, naming the pool in disaggregated mode; 503 stale/unreachable;
overload when busy).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from controlplane.protocol.errors import InvalidRequest, Overloaded, ServiceUnavailable
from controlplane.protocol.events import U64_MAX, RouterRole, WorkerRole
from router.discovery import Discovery, Health, WorkerState

HDR_WORKER = "x-worker-instance-id"
HDR_PREFILL = "x-prefill-instance-id"
HDR_DP_RANK = "x-dp-rank"
HDR_PREFILL_DP_RANK = "x-prefill-dp-rank"
# Response headers: the router's predicted prefix hit (tokens) and the policy revisions it used.
HDR_PREDICTED_CACHED = "x-rudder-predicted-cached-tokens"
HDR_POLICY_REVISIONS = "x-rudder-policy-revisions"

_HEADER_OF = {
    "decode_worker_id": HDR_WORKER,
    "prefill_worker_id": HDR_PREFILL,
    "dp_rank": HDR_DP_RANK,
    "prefill_dp_rank": HDR_PREFILL_DP_RANK,
}
_TARGET_HEADERS = frozenset(_HEADER_OF.values())


@dataclass(frozen=True, slots=True)
class Pin:
    """A validated explicit target: the worker id, its rank if named, and where each came from."""

    instance_id: int
    id_field: str  # e.g. "nvext.decode_worker_id" or "header x-worker-instance-id"
    dp_rank: int | None = None
    rank_field: str | None = None


@dataclass(frozen=True, slots=True)
class _Value:
    raw: Any
    field: str


def _lookup(nvext: Mapping[str, Any], headers: Mapping[str, str], name: str) -> _Value | None:
    header = _HEADER_OF.get(name)
    if header is not None:
        hv = headers.get(header)
        if hv is not None and hv.strip() != "":
            return _Value(hv.strip(), f"header {header}")
    value = nvext.get(name)
    if value is None:
        return None
    return _Value(value, f"nvext.{name}")


def _as_int(v: _Value, *, lo: int, hi: int, what: str) -> int:
    raw = v.raw
    value: int | None = None
    if isinstance(raw, bool):
        value = None
    elif isinstance(raw, int):
        value = raw
    elif isinstance(raw, str) and raw.isascii() and raw.isdigit():
        value = int(raw)
    if value is None or not lo <= value <= hi:
        raise InvalidRequest(
            f"{v.field}={raw!r} is not {what} (an integer in {lo}..{hi})", field=v.field
        )
    return value


@dataclass(frozen=True, slots=True)
class Targets:
    """Every explicit target of a request, before the deployment's shape is known.

    ``decode`` serves the aggregated and the decode phase, ``prefill`` the prefill phase;
    ``prefill_field`` names the first prefill-only field given (refused on an aggregated
    deployment, which has no prefill pool)."""

    decode: Pin | None = None
    prefill: Pin | None = None
    prefill_field: str | None = None


NO_TARGETS = Targets()


def prefill_not_allowed(field: str) -> InvalidRequest:
    return InvalidRequest(
        f"{field} is not allowed: this is an aggregated deployment with no prefill pool "
        "(use nvext.decode_worker_id or nvext.backend_instance_id)",
        field=field,
    )


def _pin(worker: _Value, rank: _Value | None) -> Pin:
    instance_id = _as_int(worker, lo=0, hi=U64_MAX, what="a worker instance id")
    dp_rank = None if rank is None else _as_int(rank, lo=0, hi=2**31 - 1, what="a dp rank")
    return Pin(instance_id, worker.field, dp_rank, None if rank is None else rank.field)


def _rank_without_worker(rank: _Value) -> InvalidRequest:
    return InvalidRequest(f"{rank.field} names a dp rank but no worker id is given", field=rank.field)


def parse_targets(nvext: Any, headers: Mapping[str, str], *, lowered: bool = False) -> Targets:
    """Both phases' explicit targets of a request. Raises InvalidRequest for a malformed id or
    rank, ``nvext`` not an object, or a rank that no given worker id can use. ``lowered``: the
    header names are lower case already (ASGI's)."""
    if nvext is None:
        if lowered and _TARGET_HEADERS.isdisjoint(headers):
            return NO_TARGETS  # the common request: nothing to look up
        nvext = {}
    if not isinstance(nvext, Mapping):
        raise InvalidRequest("nvext must be an object", field="nvext")
    lower = headers if lowered else {k.lower(): v for k, v in headers.items()}
    backend = _lookup(nvext, lower, "backend_instance_id")
    prefill_id = _lookup(nvext, lower, "prefill_worker_id")
    decode_worker = _lookup(nvext, lower, "decode_worker_id") or backend
    prefill_worker = prefill_id or backend
    dp_rank = _lookup(nvext, lower, "dp_rank")
    prefill_rank = _lookup(nvext, lower, "prefill_dp_rank")

    if prefill_rank is not None and prefill_worker is None:
        raise _rank_without_worker(prefill_rank)
    # dp_rank serves the decode worker, and the prefill worker when no prefill_dp_rank is given.
    if dp_rank is not None and decode_worker is None and (prefill_worker is None or prefill_rank is not None):
        raise _rank_without_worker(dp_rank)
    decode = None if decode_worker is None else _pin(decode_worker, dp_rank)
    prefill = None if prefill_worker is None else _pin(prefill_worker, prefill_rank or dp_rank)
    given = prefill_id or prefill_rank
    return Targets(decode, prefill, None if given is None else given.field)


def parse_pin(nvext: Any, headers: Mapping[str, str], *, role: RouterRole) -> Pin | None:
    """The explicit target of a request for a router of ``role``, or None. Raises InvalidRequest,
    also for a prefill field on an aggregated router (use :func:`parse_targets` where the
    deployment may be disaggregated)."""
    targets = parse_targets(nvext, headers)
    if role is RouterRole.PREFILL:
        return targets.prefill
    if role is RouterRole.AGGREGATED and targets.prefill_field is not None:
        raise prefill_not_allowed(targets.prefill_field)
    return targets.decode


def pool_of(role: RouterRole) -> WorkerRole:
    return WorkerRole(role.value)


def resolve_pin(
    pin: Pin, discovery: Discovery, *, model: str, pool: WorkerRole, now: float,
    rank_busy: Callable[[WorkerState, int], bool],
) -> tuple[WorkerState, int]:
    """The (worker, rank) in ``pool`` a pin names. Raises InvalidRequest (400, naming the pool
    unless it is the aggregated one), ServiceUnavailable (503) or Overloaded (the pinned rank is
    busy). A pin is never rerouted."""
    state = discovery.get(pin.instance_id)
    if state is None or state.record.model != model or state.record.role is not pool:
        where = "" if pool is WorkerRole.AGGREGATED else f" in the {pool.value} pool"
        raise InvalidRequest(
            f"{pin.id_field}={pin.instance_id} does not identify a known worker{where}",
            field=pin.id_field,
        )
    dp_size = state.record.dp_size
    if pin.dp_rank is None:
        if dp_size > 1:
            raise InvalidRequest(
                f"{pin.id_field}={pin.instance_id} has {dp_size} dp ranks and none is named "
                "(set nvext.dp_rank or the x-dp-rank header)",
                field=pin.id_field,
            )
        rank = 0
    else:
        rank = pin.dp_rank
        if rank >= dp_size:
            raise InvalidRequest(
                f"{pin.rank_field}={rank} is not a dp rank of worker {pin.instance_id} "
                f"(it has {dp_size}: 0..{dp_size - 1})",
                field=pin.rank_field,
            )
    health = discovery.health(state, now)
    if health is not Health.LIVE:
        raise ServiceUnavailable(
            f"worker {pin.instance_id} named by {pin.id_field} is known but {health.value}; "
            "pinned requests are never rerouted",
            retry_after=1, instance_id=str(pin.instance_id),
        )
    if rank_busy(state, rank):
        raise Overloaded(
            f"worker {pin.instance_id} rank {rank} named by {pin.id_field} is busy",
            instance_id=str(pin.instance_id), dp_rank=rank,
        )
    return state, rank


HDR_TTFT_SLO = "x-rudder-ttft-slo-ms"
HDR_PREDICTED_TTFT = "x-rudder-predicted-ttft-ms"


def parse_ttft_slo(nvext: Any, headers: Mapping[str, str]) -> float | None:
    """A request's TTFT objective in ms (header ``x-rudder-ttft-slo-ms``, else
    ``nvext.ttft_slo_ms``), or None. Raises InvalidRequest naming the field unless it is a finite
    number > 0."""
    raw = headers.get(HDR_TTFT_SLO)
    field = HDR_TTFT_SLO
    value: Any = raw
    if raw is not None:
        try:
            value = float(raw)
        except ValueError:
            raise InvalidRequest(f"{field} must be a number of milliseconds, got {raw!r}", field=field) from None
    else:
        field = "nvext.ttft_slo_ms"
        # (None first: an isinstance check against the Mapping ABC is a Python call)
        value = nvext.get("ttft_slo_ms") if nvext is not None and isinstance(nvext, Mapping) else None
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise InvalidRequest(f"{field} must be a number of milliseconds, got {value!r}", field=field)
    if not math.isfinite(value) or value <= 0:
        raise InvalidRequest(f"{field} must be a finite number > 0, got {value!r}", field=field)
    return float(value)
