"""Who is asking, decided once per request, and a write's body as read (FastAPI dependencies).

A read route depends on :func:`allowed` (its action): the caller is authenticated and authorized
here, and refused at once (401, 403, 429). A write route depends on :data:`Write` (its caller and
body; :data:`Writer` for a write without a body): the caller is authenticated here and the outcome
handed to the write path in a :class:`RequestContext` (the principal, or the authentication
error); the write path authorizes and records every refusal. Failed authentications are counted
per source address (AuthFailureLimiter): a valid token is always accepted; a failure from a source
past its limit is answered 429, and a write's failed authentication is recorded by the write path
only when it is its source's first in the window (later ones are answered at once and written
later as one row with their count).
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import re
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Annotated, Any

from fastapi import Depends, Request
from fastapi.routing import APIRoute

from controlplane.api.observe import Metrics
from controlplane.auth import Action, Principal
from controlplane.protocol.errors import (
    Forbidden,
    InvalidRequest,
    PayloadTooLarge,
    RateLimited,
    RudderError,
    Unauthenticated,
    UnsupportedMediaType,
)
from controlplane.telemetry import traces
from controlplane.writepath import Body, RequestContext

if TYPE_CHECKING:
    from controlplane.server import ControlPlane


class Gate:
    """Authentication: the caller's source address and bearer token (one look-up per request)."""

    def __init__(self, cp: ControlPlane) -> None:
        self.cp = cp
        settings = cp.settings
        self.header_cap = settings.audit_header_max_chars
        self.proxies = [ipaddress.ip_network(p, strict=False) for p in settings.trusted_proxies]

    def source_of(self, request: Request) -> str:
        """The caller's address: the peer's, or the last X-Forwarded-For hop if the peer is a
        trusted proxy (``trusted_proxies``; none by default, so the header is not believed)."""
        peer = request.client.host if request.client else "unknown"
        if self.proxies:
            try:
                trusted = any(ipaddress.ip_address(peer) in net for net in self.proxies)
            except ValueError:
                trusted = False
            forwarded = request.headers.get("x-forwarded-for", "").split(",")[-1].strip()
            if trusted and forwarded:
                with contextlib.suppress(ValueError):
                    return str(ipaddress.ip_address(forwarded))
        return peer

    async def authenticate(self, request: Request, *, audited: bool) -> Principal | Unauthenticated:
        """As :meth:`_authenticate`, in an ``authenticate`` span when tracing is on."""
        with traces.step("authenticate") as span:
            result = await self._authenticate(request, audited=audited)
            if span is not None and isinstance(result, Principal):
                span.set_attribute("rudder.role", result.role.value)
            return result

    async def _authenticate(self, request: Request, *, audited: bool) -> Principal | Unauthenticated:
        """The caller's principal, or, when the caller audits failures (``audited``) and this is
        its source's first failure in the window, the error for the write path to audit.

        The token is checked first: a valid one is never refused for its source's failures. A
        failure from a source past its limit raises RateLimited (429); every other failure
        Unauthenticated (counted, and written later as one row per window: AuthFailureLimiter)."""
        failures = self.cp.auth_failures
        source = self.source_of(request)
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        error: Unauthenticated | None = None
        principal: Principal | None = None
        if scheme.lower() != "bearer" or not token.strip():
            error = Unauthenticated("missing bearer token")
        else:
            # A valid token is checked before the source's failure budget: failures from its
            # address (every client is 127.0.0.1 under `rudder up`) never lock it out.
            principal = await self.cp.tokens.authenticate(token.strip())
            if principal is None:
                error = Unauthenticated("unknown or revoked token")
        if principal is not None:
            return principal
        assert error is not None
        retry = failures.retry_after(source)
        if retry is not None:
            failures.refused(source)
            raise RateLimited(f"too many failed authentications from {source}; retry in {retry} s",
                              retry_after=retry)
        if failures.failed(source, audited_if_first=audited):
            return error
        raise error

    async def allow(self, request: Request, action: Action) -> Principal:
        """A read's caller, if its role may ``action``. Raises RateLimited, Unauthenticated,
        Forbidden."""
        principal = await self.authenticate(request, audited=False)
        assert isinstance(principal, Principal)  # an error is only returned to an auditing caller
        if not principal.can(action):
            raise Forbidden(f"role {principal.role.value} may not {action.value}", required=action.value)
        return principal

    async def context(self, request: Request) -> RequestContext:
        """A write's caller, for the write path to authorize and record. Raises RateLimited and
        (after the window's first) Unauthenticated at once."""
        result = await self.authenticate(request, audited=True)
        user_agent = request.headers.get("user-agent")
        return RequestContext(
            request_id=request.state.request_id,
            principal=result if isinstance(result, Principal) else None,
            auth_error=result if isinstance(result, Unauthenticated) else None,
            auth_method="bearer" if request.headers.get("authorization") else None,
            source_ip=self.source_of(request),
            user_agent=user_agent[:self.header_cap] if user_agent is not None else None,
        )


#: The largest id, revision or cursor position the database holds (BIGINT).
INT64_MAX = 2**63 - 1
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


def _query_names(route: APIRoute) -> frozenset[str]:
    """The query parameters a route takes (its own and its dependencies'; a few objects to walk,
    not worth a cache: routes are not hashable)."""
    names: set[str] = set()
    stack = [route.dependant]
    while stack:
        dependant = stack.pop()
        names.update(p.alias for p in dependant.query_params)
        stack.extend(dependant.dependencies)
    return frozenset(names)


async def clean_query(request: Request) -> None:
    """Every route's query string (a dependency of each router): a parameter whose name or value
    holds a control character (a NUL reaches PostgreSQL as an error, not a filter), or that the
    route does not take (``?modle=x`` would otherwise answer every model, unfiltered), is
    refused with 400 naming it, before anything is looked up."""
    route = request.scope.get("route")
    known = _query_names(route) if isinstance(route, APIRoute) else None
    for name, value in request.query_params.multi_items():
        shown = _CONTROL.sub("?", name)[:64]
        if _CONTROL.search(name) or _CONTROL.search(value):
            raise InvalidRequest(f"query parameter {shown!r} holds a control character", field=shown)
        if known is not None and name not in known:
            takes = ", ".join(sorted(known)) or "none"
            raise InvalidRequest(f"unknown query parameter {shown!r} (this route takes: {takes})", field=shown)


@dataclass(frozen=True)
class Services:
    """What the routes use (``app.state.services``, one per app)."""

    cp: ControlPlane
    metrics: Metrics
    gate: Gate


async def services(request: Request) -> Services:
    # async: FastAPI runs a plain-def dependency in its thread pool, a thread hop per request
    # (it halved the write throughput at concurrency 8).
    found: Services = request.app.state.services
    return found


Svc = Annotated[Services, Depends(services)]


def allowed(action: Action) -> Callable[[Request, Services], Awaitable[Principal]]:
    """The dependency of a read that needs ``action``."""

    async def caller(request: Request, svc: Svc) -> Principal:
        return await svc.gate.allow(request, action)

    caller.__name__ = f"allowed_{action.value}"
    return caller


ReadPolicy = Annotated[Principal, Depends(allowed(Action.READ_POLICY))]
ReadAudit = Annotated[Principal, Depends(allowed(Action.READ_AUDIT))]


async def write_context(request: Request, svc: Svc) -> RequestContext:
    return await svc.gate.context(request)


Writer = Annotated[RequestContext, Depends(write_context)]


@dataclass(frozen=True)
class WriteCall:
    """Everything a write route hands the write path: the caller, the body as read, the services."""

    ctx: RequestContext
    body: Body
    svc: Services


async def write_call(request: Request) -> WriteCall:
    """A write's caller, then its body read within the size limit and decoded as JSON, or why it
    could not be (415, 413, 400), in one dependency (the admin API's hot path: one to solve per
    write). Nothing about the body is raised here: the write path answers whether the caller may
    write first, and records the refusal. A caller refused at once (429, a repeated 401) is
    answered before its body is read."""
    svc: Services = request.app.state.services
    ctx = await svc.gate.context(request)
    try:
        body = Body(json=await _json(request, svc.cp.settings.max_body_bytes))
    except RudderError as exc:
        body = Body(error=exc)
    return WriteCall(ctx=ctx, body=body, svc=svc)


Write = Annotated[WriteCall, Depends(write_call)]


async def json_body(request: Request, limit: int) -> Any:
    """A JSON body within ``limit`` bytes. Raises UnsupportedMediaType, PayloadTooLarge,
    InvalidRequest."""
    return await _json(request, limit)


async def _json(request: Request, limit: int) -> Any:
    ctype = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if ctype != "application/json":
        raise UnsupportedMediaType(f"content-type must be application/json, got {ctype or 'none'!r}",
                                   field="content-type")
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise PayloadTooLarge(f"body is {declared} bytes; the limit is {limit}", field="body", limit=limit)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise PayloadTooLarge(f"body exceeds the limit of {limit} bytes", field="body", limit=limit)
        chunks.append(chunk)
    try:
        return json.loads(b"".join(chunks))  # NaN/Infinity parse, then fail validation by name
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise InvalidRequest(f"body is not valid JSON: {exc}", field="body") from exc
    except RecursionError:  # nested deeper than the parser goes
        raise InvalidRequest("body is not valid JSON: nested too deeply", field="body") from None
