"""Schemathesis against the admin API's own ``/openapi.json`` (issue 18, item 4), on a real control
plane over real NATS and PostgreSQL.

Every route is called with cases Schemathesis derives from its schema (valid ones and, where the
schema allows, invalid ones), each sent with every role's token, with an unknown token and with
none. For every answer:

- never a 5xx (the API's own checks: status code, content type, headers and body as documented;
  an invalid case is refused);
- a 4xx changes nothing: the policy stream (every document's head, thresholds included) and the
  token table are as before (read around every accepted write, which must have made exactly its
  own change; a caller who may not revoke tokens is pointed at real ones);
- every refused write is in the audit log (docs/api.md: "Every refused write is recorded ...
  whatever the reason: 401, 403, 413, 415, 400, 422, 404, 409"): a rejected row with the
  answer's request id and error code; a read refused for authentication is counted in its
  source's ``auth_failures`` row (reads refused for a role are not audited: DESIGN §4 audits the
  write path).

Each unauthenticated request comes from its own address (``X-Forwarded-For`` behind a trusted
proxy), so each is its source's first failure, audited one by one (docs/controlplane.md) and
never rate limited; as it is refused before anything else of its request is read, it sends one
case per route and mode. Generation is derandomized (the same cases every run) and bounded:
``RUDDER_FUZZ_EXAMPLES`` cases per route and mode (default 3; more for a longer run).
"""

from __future__ import annotations

import itertools
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis.errors import Unsatisfiable
from hypothesis.strategies import SearchStrategy
from nats.aio.client import Client as NATS
from schemathesis import Case, GenerationMode
from schemathesis.checks import (
    content_type_conformance,
    negative_data_rejection,
    not_a_server_error,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)
from schemathesis.core.failures import FailureGroup
from schemathesis.core.parameters import ParameterLocation
from sqlalchemy import select

from controlplane.audit.tables import AuditLogRow
from controlplane.auth import AUTH_FAILURES, Action, Role
from controlplane.protocol.subjects import STREAM_POLICY
from controlplane.server import Running
from tests.integration.cp_support import Tokens, controlplane

EXAMPLES = int(os.environ.get("RUDDER_FUZZ_EXAMPLES", "3"))
pytestmark = pytest.mark.timeout(max(300, 60 * EXAMPLES))
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance,
          response_headers_conformance, response_schema_conformance]
PROXY = "127.0.0.1"
#: What a write route's refusal must leave in the audit log (docs/api.md).
WRITES = {Action.WRITE_POLICY.value}
#: Routes that take a body they do not read (``Ignored`` in /openapi.json).
UNREAD_BODIES = {"/audit/reconcile", "/tokens/{token_id}/revoke"}
#: Routes whose refusals are writes' refusals although their action is not ``write_policy``.
WRITE_ROUTES = {("POST", "/tokens/{token_id}/revoke")}


def examples(strategy: SearchStrategy[Case]) -> list[Case]:
    """``EXAMPLES`` cases drawn from ``strategy``, the same on every run."""
    found: list[Case] = []

    @settings(max_examples=EXAMPLES, derandomize=True, database=None, deadline=None,
              phases=[Phase.generate], suppress_health_check=list(HealthCheck))
    @given(case=strategy)
    def collect(case: Case) -> None:
        found.append(case)

    collect()
    return found


def generate(spec: dict[str, Any]) -> list[tuple[Case, GenerationMode]]:
    """The cases of every operation, valid and invalid."""
    schema = schemathesis.openapi.from_dict(spec)
    out: list[tuple[Case, GenerationMode]] = []
    for result in schema.get_all_operations():
        operation = result.ok()
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            try:
                out += [(case, mode) for case in examples(operation.as_strategy(generation_mode=mode))]
            except Unsatisfiable:  # nothing invalid to say about this operation
                assert mode is GenerationMode.NEGATIVE, operation.label
    return out


def invalid(case: Case, mode: GenerationMode, sent: httpx.Request) -> bool:
    """Whether what was sent breaks the case's schema: some mutation of it reached the server
    and is read there. Not the bearer header (each caller sends its own), nor a body the route
    does not read (``Ignored``: documented as an object for clients, never parsed), nor extra
    query parameters dropped on the way (httpx sends no parameter whose value is None)."""
    if mode is not GenerationMode.NEGATIVE:
        return False
    data = case.meta.phase.data if case.meta is not None else None
    mutations = getattr(data, "mutations", None)
    if not mutations:
        return False  # (Schemathesis' "positive test case": nothing in it was made invalid)
    declared = {p.name for p in case.operation.iter_parameters() if p.location == ParameterLocation.QUERY}

    def reaches(m: Any) -> bool:
        if m.parameter == "Authorization" or m.parameter_location == ParameterLocation.HEADER:
            return False  # the only header the API declares is the bearer token
        if m.parameter_location == ParameterLocation.BODY and case.path in UNREAD_BODIES:
            return False
        if m.parameter_location == ParameterLocation.QUERY and "additionalProperties" in m.keywords:
            return any(name not in declared for name in sent.url.params)
        return True

    return any(reaches(m) for m in mutations)


@dataclass(frozen=True)
class Caller:
    name: str
    token: str | None


@dataclass
class Findings:
    problems: list[str] = field(default_factory=list)
    read_auth_failures: set[str] = field(default_factory=set)  # source addresses
    write_refusals: list[tuple[Case, Caller, httpx.Response]] = field(default_factory=list)
    sent: int = 0

    def add(self, case: Case, caller: Caller, what: str) -> None:
        self.problems.append(f"{case.method} {case.formatted_path} as {caller.name}: {what}\n"
                             f"    {case.as_curl_command()}")


async def state(nc: NATS, running: Running) -> tuple[Any, ...]:
    """What a refused request must not change: every policy document's head (the stream's last
    sequence and count: thresholds are documents too) and the tokens."""
    info = await nc.jetstream().stream_info(STREAM_POLICY)
    tokens = await running.controlplane.tokens.list()
    return info.state.last_seq, info.state.messages, tuple(sorted(
        (t["id"], t["revoked"]) for t in tokens))


def sources() -> Iterator[str]:
    for i in itertools.count(1):
        yield f"10.{i // 65536 % 256}.{i // 256 % 256}.{i % 256}"


async def test_every_route_every_role_and_none(nats_url: str, db: str, tokens: Tokens, nc: NATS) -> None:
    callers = [Caller("none", None), Caller("unknown", "rdr_" + "x" * 43),
               *(Caller(role, getattr(tokens, role)) for role in ("viewer", "operator", "auditor", "admin"))]
    async with controlplane(nats_url, db, trusted_proxies=[f"{PROXY}/32"], auth_failure_max_rows=100_000) as running:
        cp = running.controlplane
        protected = {t["id"] for t in await cp.tokens.list()}  # the callers' own tokens
        # Tokens a caller who may not revoke tries to revoke (a refusal must leave them as they were).
        victims = [(await cp.tokens.create(f"victim-{i}", Role.OPERATOR))[1] for i in range(3)]
        spec = running.app.openapi()
        cases = generate(spec)
        actions = {(m.upper(), p): op.get("x-rudder-action")
                   for p, item in spec["paths"].items() for m, op in item.items()}
        findings = Findings()
        addresses = sources()
        async with httpx.AsyncClient(base_url=running.url, timeout=30) as http:
            # The state changes only with an accepted write: it is read before and after each
            # one, and every refusal in between must have left it as the last one did.
            before = await state(nc, running)
            refused: list[str] = []  # the refusals since that state was read
            seen: set[tuple[tuple[str, str, GenerationMode], str]] = set()
            for (case, mode), caller in itertools.product(cases, callers):
                if (caller.name == "admin" and case.path == "/tokens/{token_id}/revoke"
                        and (case.path_parameters or {}).get("token_id") in protected):
                    continue  # revoking a caller's own token would end the run, not test it
                token_id = (case.path_parameters or {}).get("token_id")
                if caller.name != "admin" and isinstance(token_id, int) and not isinstance(token_id, bool):
                    case = case.derive()
                    case.path_parameters = {"token_id": victims[token_id % len(victims)]}
                if caller.token is None or caller.name == "unknown":
                    # Refused before anything about the request is read: once per route and mode.
                    key = (case.method, case.path, mode)
                    if (key, caller.name) in seen:
                        continue
                    seen.add((key, caller.name))
                source = next(addresses)
                headers = {"X-Forwarded-For": source}
                if caller.token is not None:
                    headers["Authorization"] = f"Bearer {caller.token}"
                # The caller's own credentials replace the bearer header generated from the
                # security scheme (and an illegal generated header value could not be sent).
                case.headers = {k: v for k, v in (case.headers or {}).items() if k.lower() != "authorization"}
                kwargs = case.as_transport_kwargs(base_url=running.url, headers=headers)
                for unused in ("base_url", "cookies"):
                    kwargs.pop(unused, None)
                if isinstance(kwargs.get("data"), bytes | str):
                    kwargs["content"] = kwargs.pop("data")
                response = await http.request(**kwargs)
                findings.sent += 1
                checks = CHECKS + ([negative_data_rejection] if invalid(case, mode, response.request) else [])
                try:
                    case.validate_response(response, checks=checks)
                except FailureGroup as exc:
                    titles = "; ".join(f"{f.title}: {f.message}" for f in exc.exceptions)
                    findings.add(case, caller, f"{response.status_code} {response.text[:300]}: {titles}")
                status = response.status_code
                if 400 <= status < 500:
                    refused.append(f"{case.method} {case.formatted_path} as {caller.name}: {status}")
                elif case.method.upper() != "GET" and status < 300:
                    # An accepted write: the state is now the last one with its own change only.
                    after = await state(nc, running)
                    expected = accepted_change(before, case, response)
                    if after != expected:
                        refused.append(f"(then {case.method} {case.formatted_path} as {caller.name}: {status}, "
                                       f"expected {expected})")
                        await check_unchanged(nc, running, before, refused, findings, now=after)
                    before, refused = after, []
                action = actions.get((case.method.upper(), case.path))
                write = action in WRITES or (case.method.upper(), case.path) in WRITE_ROUTES
                if 400 <= status < 500:
                    if write:
                        findings.write_refusals.append((case, caller, response))
                    elif status == 401:
                        findings.read_auth_failures.add(source)
            await check_unchanged(nc, running, before, refused, findings)
            await check_audited(running, findings)
            await cp.flush_auth_failures(everything=True)
            await check_summarized(running, findings)
        assert not findings.problems, f"{len(findings.problems)} of {findings.sent} answers:\n" + \
            "\n".join(findings.problems)


def accepted_change(before: tuple[Any, ...], case: Case, response: httpx.Response) -> tuple[Any, ...]:
    """The state after an accepted write, from the one before and the write's answer: a
    published policy event is the stream's new last message, a revoked token is revoked."""
    seq, messages, tokens = before
    body = response.json()
    if case.path == "/tokens/{token_id}/revoke":
        return seq, messages, tuple((i, revoked or i == body["id"]) for i, revoked in tokens)
    if isinstance(body, dict) and body.get("event_id") and not body.get("dry_run"):
        return body["revision"], messages + 1, tokens
    return before


async def check_unchanged(nc: NATS, running: Running, before: tuple[Any, ...], refused: list[str],
                          findings: Findings, *, now: tuple[Any, ...] | None = None) -> None:
    after = now if now is not None else await state(nc, running)
    if refused and after != before:
        findings.problems.append(f"one of {len(refused)} refused requests changed {before} → {after}:\n    "
                                 + "\n    ".join(refused))


async def check_audited(running: Running, findings: Findings) -> None:
    """Every refused write has a rejected row with its request id and error code."""
    wanted = {r.headers.get("x-request-id"): (case, caller, r) for case, caller, r in findings.write_refusals}
    async with running.controlplane.audit.engine.connect() as conn:
        rows = (await conn.execute(select(AuditLogRow.request_id, AuditLogRow.decision, AuditLogRow.reason_code)
                                   .where(AuditLogRow.request_id.in_(list(wanted))))).all()
    recorded = {(r.request_id, r.reason_code) for r in rows if r.decision == "rejected"}
    for request_id, (case, caller, response) in wanted.items():
        code = response.json().get("error", {}).get("code") if response.content else None
        if (request_id, code) not in recorded:
            findings.add(case, caller, f"{response.status_code} {code} not audited (request {request_id})")


async def check_summarized(running: Running, findings: Findings) -> None:
    if not findings.read_auth_failures:
        return
    async with running.controlplane.audit.engine.connect() as conn:
        rows = (await conn.execute(select(AuditLogRow.source_ip).where(
            AuditLogRow.reason_code == AUTH_FAILURES))).all()
    missing = findings.read_auth_failures - {r.source_ip for r in rows}
    if missing:
        findings.problems.append(f"{len(missing)} reads refused for authentication not audited, "
                                 f"e.g. from {sorted(missing)[:3]}")


async def audited(running: Running, response: httpx.Response) -> list[Any]:
    async with running.controlplane.audit.engine.connect() as conn:
        return list((await conn.execute(
            select(AuditLogRow.decision, AuditLogRow.reason_code, AuditLogRow.model, AuditLogRow.changes)
            .where(AuditLogRow.request_id == response.headers["x-request-id"]))).all())


async def test_what_the_fuzzer_found_stays_fixed(nats_url: str, db: str, tokens: Tokens) -> None:
    """Each bug the fuzzer found, as a plain request (docs/decisions.md, "Proof suite")."""
    async with controlplane(nats_url, db, trusted_proxies=[f"{PROXY}/32"]) as running, \
            httpx.AsyncClient(base_url=running.url, timeout=30) as http:
        addresses = sources()

        async def call(method: str, path: str, token: str | None, *, headers: dict[str, str] | None = None,
                       **kw: Any) -> httpx.Response:
            sent = {"X-Forwarded-For": next(addresses), **(headers or {})}
            if token is not None:
                sent["Authorization"] = f"Bearer {token}"
            return await http.request(method, path, headers=sent, **kw)

        # A NUL in a write's model: its refusal could not be recorded (PostgreSQL holds no NUL in
        # text or JSONB), so every caller got 503 audit_unavailable and nothing was audited.
        nul = {"model": "a\u0000b", "expected_revision": 0, "parameters": {}}
        for token, status, code in ((None, 401, "unauthenticated"), (tokens.operator, 400, "invalid_request")):
            r = await call("PATCH", "/router_policy", token, json=nul)
            assert r.status_code == status, r.text
            assert r.status_code != 400 or r.json()["error"]["field"] == "model"
            assert [(row.decision, row.reason_code, row.model) for row in await audited(running, r)] == [
                ("rejected", code, "a\ufffdb")]
        # A body nested deeper than the JSON parser goes was an internal error (500), not audited.
        deep = b'{"model": "m", "expected_revision": 0, "parameters": ' + b"[" * 10_000 + b"]" * 10_000 + b"}"
        r = await call("PATCH", "/router_policy", tokens.operator, content=deep,
                       headers={"content-type": "application/json"})
        assert r.status_code == 400 and r.json()["error"]["field"] == "body", r.text
        assert [(row.decision, row.reason_code) for row in await audited(running, r)] == [
            ("rejected", "invalid_request")]
        # A parameter's name with a lone surrogate (a "\ud800" escape): pydantic could not render
        # the check's message quoting it, and the write answered 500 internal_error.
        body = json.dumps({"model": "m", "expected_revision": 0, "parameters": {"x\ud800": 0.5}}).encode()
        r = await call("PATCH", "/router_policy", tokens.operator, content=body,
                       headers={"content-type": "application/json"})
        assert r.status_code == 422 and r.json()["error"]["field"] == "parameters.x\ud800", r.text
        assert [(row.decision, row.reason_code) for row in await audited(running, r)] == [
            ("rejected", "validation_failed")]
        # A threshold POST whose threshold's name is misspelt was taken for a read: 200, nothing
        # written, nothing refused. It is refused naming the field, and recorded.
        r = await call("POST", "/busy_threshold", tokens.operator,
                       json={"model": "m", "active_decode_blocks_threshhold": 5})
        assert r.status_code == 422 and r.json()["error"]["field"] == "active_decode_blocks_threshhold", r.text
        assert [(row.decision, row.reason_code) for row in await audited(running, r)] == [
            ("rejected", "validation_failed")]
        r = await call("POST", "/busy_threshold", tokens.viewer, json={"model": "m"})  # a read still
        assert r.status_code == 200 and r.json()["model"] == "m", r.text
        # A model name with a control character was published (a NUL-free one reached the stream).
        r = await call("POST", "/router_policy/calibration/reset", tokens.operator, json={"model": "G\u000fx"})
        assert r.status_code == 400 and r.json()["error"]["field"] == "model", r.text
        # A revision past BIGINT could not be recorded with its refusal (503, nothing audited).
        for path, body in (("/router_policy", {"model": "m", "expected_revision": 2**70, "parameters": {}}),
                           ("/router_policy/rollback", {"model": "m", "expected_revision": 0, "to_revision": 2**64})):
            r = await call("PATCH" if path == "/router_policy" else "POST", path, tokens.operator, json=body)
            assert r.status_code == 422, r.text
            assert [(row.decision, row.reason_code) for row in await audited(running, r)] == [
                ("rejected", "validation_failed")]
        # A threshold read-POST naming no model was refused 400 without a record.
        r = await call("POST", "/busy_threshold", tokens.viewer, json={"model": ""})
        assert r.status_code == 400 and r.json()["error"]["field"] == "model", r.text
        assert [(row.decision, row.reason_code) for row in await audited(running, r)] == [
            ("rejected", "invalid_request")]
        # A threshold POST that asks nothing (a read) from an unauthenticated caller: its 401 was
        # not recorded, though the edge had counted it as recorded.
        r = await call("POST", "/busy_threshold", None, json={"model": "m"})
        assert r.status_code == 401
        assert [(row.decision, row.reason_code) for row in await audited(running, r)] == [
            ("rejected", "unauthenticated")]
        # A refused token revocation was not audited (401, 403, a bad id, 404).
        for token, path, status in ((None, "/tokens/1/revoke", 401), (tokens.operator, "/tokens/1/revoke", 403),
                                    (tokens.admin, "/tokens/1.5/revoke", 400),
                                    (tokens.admin, f"/tokens/{2**62}/revoke", 404)):
            r = await call("POST", path, token)
            assert r.status_code == status, (path, r.text)
            rows = await audited(running, r)
            assert [(row.decision, row.reason_code) for row in rows] == [
                ("rejected", r.json()["error"]["code"])], (path, rows)
            assert rows[0].changes == {"token_id": path.split("/")[2] if status == 400 else int(path.split("/")[2])}
        # An unknown query parameter was ignored (`?modle=` answered every model, unfiltered).
        r = await call("GET", "/routers", tokens.viewer, params={"modle": "x"})
        assert r.status_code == 400 and r.json()["error"]["field"] == "modle", r.text
        r = await call("GET", "/router_policy/history", tokens.viewer, params={"model": "m", "kind": "selection",
                                                                               "limit": 2})
        assert r.status_code == 200, r.text
