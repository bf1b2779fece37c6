"""Traffic on the fleet harness (tests/reliability/fleet.py), a run of a fault schedule, the
read-back into a :class:`tests.reliability.history.History`, and the report's measures.

The traffic (:class:`Traffic`): compare-and-set writers on the selection document (patches and
rollbacks) and on the busy-threshold document (partial writes: one threshold at a time), failing
over between the control planes; chat clients through the routers, failing over between routers
that do not answer. Every attempt and every chat is recorded; after the run the stream, the audit
log and the routers' ACKs are read back.
"""

from __future__ import annotations

import asyncio
import math
import secrets
import statistics
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import httpx
from sqlalchemy import select

from bus.identities import Identity, IdentityKind
from controlplane.audit.store import AuditStore
from controlplane.audit.tables import router_acks
from controlplane.protocol.policy import PolicyKind
from tests import buskit
from tests.policy_keys import session_keys
from tests.reliability.fleet import FAULTS, KINDS, MODEL, FaultRecord, Fleet, doc
from tests.reliability.fleet_history import audit_decisions, mono, to_mono
from tests.reliability.history import Answer, Apply, Attempt, Chat, History
from tests.support_router.workers import predicted_and_cached

# -- traffic ---------------------------------------------------------------------------------------


class Traffic:
    """Writers and chat clients, recording every attempt and every chat."""

    def __init__(self, fleet: Fleet, *, pace_s: float = 0.02) -> None:
        self.fleet = fleet
        self.pace_s = pace_s
        self.attempts: list[Attempt] = []
        self.chats: list[Chat] = []
        self.unexpected: list[str] = []  # write answers that are neither an outcome nor a clean refusal
        self.passed_over: list[tuple[str, str]] = []  # (router, why) a chat went on to the next router
        self.unknown_why: Counter[str] = Counter()  # why attempts had no definite answer
        self.known: dict[PolicyKind, list[int]] = {kind: [] for kind in KINDS}  # accepted revisions
        self.stop = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []

    def start(self, *, writers: int = 2, chat_clients: int = 2) -> None:
        self._tasks += [asyncio.create_task(self._selection_writer(f"w{i}", i)) for i in range(writers)]
        self._tasks.append(asyncio.create_task(self._threshold_writer("t0")))
        self._tasks += [asyncio.create_task(self._chatter(i)) for i in range(chat_clients)]

    async def finish(self) -> None:
        self.stop.set()
        await asyncio.gather(*self._tasks)

    def _record(self, client: str, kind: PolicyKind, expected: int, t0: float,
                r: httpx.Response | Exception) -> int:
        """Record one attempt; returns the revision the next attempt should expect."""
        d = doc(kind)
        if isinstance(r, httpx.ConnectError):  # never reached a control plane: nothing happened
            self.attempts.append(Attempt(client, d, expected, Answer.REFUSED, t0, mono()))
            return expected
        if isinstance(r, Exception):  # sent, no answer: it may have taken effect
            self.unknown_why[type(r).__name__] += 1
            self.attempts.append(Attempt(client, d, expected, Answer.UNKNOWN, t0, None))
            return expected
        t1 = mono()
        try:
            body = r.json()
        except ValueError:
            body = {}
        error = body.get("error", {}) if isinstance(body, dict) else {}
        code = error.get("code")
        if r.status_code == 200 and body.get("changed") is False:
            # A threshold write that changed nothing published nothing (the head stays).
            self.attempts.append(Attempt(client, d, expected, Answer.REFUSED, t0, t1))
            return int(body["revision"])
        if r.status_code == 200:
            self.attempts.append(Attempt(client, d, expected, Answer.ACCEPTED, t0, t1,
                                         new_revision=body["revision"], event_id=body["event_id"]))
            self.known[kind].append(int(body["revision"]))
            return int(body["revision"])
        if r.status_code == 409:
            head = error.get("head_revision")
            self.attempts.append(Attempt(client, d, expected, Answer.CONFLICT, t0, t1, head_revision=head))
            return int(head) if head is not None else expected
        if code == "decision_unrecorded":
            self.attempts.append(Attempt(client, d, expected, Answer.ACCEPTED, t0, t1,
                                         new_revision=error["new_revision"], event_id=error["event_id"]))
            self.known[kind].append(int(error["new_revision"]))
            return int(error["new_revision"])
        if r.status_code in (429, 503) and code in _DEFINITE:
            self.attempts.append(Attempt(client, d, expected, Answer.REFUSED, t0, t1))
            return expected
        self.unknown_why[f"{r.status_code} {code}"] += 1
        if code != "log_ambiguous":  # no answer a client can act on: a finding of its own
            self.unexpected.append(f"{client} ({d} expecting @{expected}): {r.status_code} {r.text[:300]}")
        self.attempts.append(Attempt(client, d, expected, Answer.UNKNOWN, t0, None, event_id=error.get("event_id")))
        return expected

    async def _write_loop(self, name: str, plane: int, kind: PolicyKind,
                          request: Callable[[httpx.AsyncClient, str, int, int], Awaitable[httpx.Response]]) -> None:
        planes = self.fleet.urls("controlplane")
        headers = {"authorization": f"Bearer {self.fleet.tokens['operator']}"}
        expected, i = 0, 0
        async with httpx.AsyncClient(timeout=httpx.Timeout(10, connect=1), headers=headers) as http:
            while not self.stop.is_set():
                i += 1
                t0 = mono()
                try:
                    r: httpx.Response | Exception = await request(http, planes[plane % len(planes)], expected, i)
                except httpx.HTTPError as exc:
                    r = exc
                before = len(self.attempts)
                expected = self._record(name, kind, expected, t0, r)
                if self.attempts[before].answer in (Answer.REFUSED, Answer.UNKNOWN):
                    plane += 1  # that control plane is away or in trouble: use the other
                    await asyncio.sleep(0.05)
                await asyncio.sleep(self.pace_s)

    async def _selection_writer(self, name: str, plane: int) -> None:
        async def request(http: httpx.AsyncClient, url: str, expected: int, i: int) -> httpx.Response:
            known = self.known[PolicyKind.SELECTION]
            if i % 7 == 0 and len(known) >= 3:  # now and then a rollback to an earlier revision
                return await http.post(f"{url}/router_policy/rollback", json={
                    "model": MODEL, "kind": "selection", "to_revision": known[-3],
                    "expected_revision": expected})
            return await http.patch(f"{url}/router_policy", json={
                "model": MODEL, "kind": "selection", "expected_revision": expected,
                "parameters": {"router_temperature": round((hash(name) % 50 + i % 50) / 100, 2)}})
        await self._write_loop(name, plane, PolicyKind.SELECTION, request)

    async def _threshold_writer(self, name: str) -> None:
        async def request(http: httpx.AsyncClient, url: str, expected: int, i: int) -> httpx.Response:
            # Partial: one threshold per write, the other keeps its value.
            value: dict[str, float] = ({"active_decode_blocks_threshold": 0.5 + i % 100_000 / 1e6} if i % 2
                                       else {"active_prefill_tokens_threshold": 1000 + i})
            return await http.post(f"{url}/router_policy/busy_threshold", json={
                "model": MODEL, "expected_revision": expected, **value})
        await self._write_loop(name, 1, PolicyKind.BUSY_THRESHOLD, request)

    async def _chatter(self, n: int) -> None:
        routers = self.fleet.urls("router")
        names = self.fleet.names("router")
        i = n
        async with httpx.AsyncClient(timeout=httpx.Timeout(3, connect=1)) as http:
            while not self.stop.is_set():
                i += 1
                body = {"model": MODEL, "max_tokens": 4, "stream": i % 2 == 0,
                        "messages": [{"role": "user", "content": f"chat {n}-{i} " + "x" * (i % 300)}]}
                t0 = mono()
                tried: list[str] = []
                outcome: Chat | None = None
                for k in range(len(routers)):
                    # A router that does not answer, or answers 503, is passed over (as a load
                    # balancer retries the next upstream); the chat fails only if every one does.
                    j = (i + k) % len(routers)
                    tried.append(names[j])
                    outcome = await self._one_chat(http, routers[j], body, t0, tuple(tried))
                    if outcome is not None and not outcome.reason.startswith("503"):
                        break
                    self.passed_over.append((names[j], outcome.reason if outcome else "no answer"))
                if outcome is None:
                    outcome = Chat(t0, mono(), False, "no router answered", tried=tuple(tried))
                self.chats.append(outcome)
                await asyncio.sleep(self.pace_s)

    async def _one_chat(self, http: httpx.AsyncClient, url: str, body: dict[str, Any], t0: float,
                        tried: tuple[str, ...]) -> Chat | None:
        """The chat through one router; None when that router did not answer (try the next)."""
        started = False
        try:
            async with http.stream("POST", f"{url}/v1/chat/completions", json=body) as r:
                if r.status_code != 200:
                    raw = await r.aread()
                    try:
                        code = r.json().get("error", {}).get("code")
                    except ValueError:
                        code = raw[:80].decode(errors="replace")
                    return Chat(t0, mono(), False, f"{r.status_code} {code}", tried=tried)
                started = True
                async for _ in r.aiter_bytes():
                    pass
            return Chat(t0, mono(), True, tried=tried)
        except httpx.HTTPError as exc:
            if started:
                return Chat(t0, mono(), False, type(exc).__name__, streamed=True, tried=tried)
            return None


#: Refusals that say for certain nothing was published.
_DEFINITE = frozenset({"audit_unavailable", "log_unavailable", "service_unavailable", "rate_limited"})


# -- a run, and what it measured ----------------------------------------------------------------------


@dataclass
class RunResult:
    history: History
    faults: list[FaultRecord]
    reconcile: dict[str, Any]
    verify: dict[str, Any]
    started_at: float
    ended_at: float
    unexpected: list[str] = field(default_factory=list)
    passed_over: list[tuple[str, str]] = field(default_factory=list)
    unknown_why: dict[str, int] = field(default_factory=dict)
    kv_dropped: int = 0  # KV events the routers dropped for the rate limit (their metrics)
    # Per router: the KV check's last answer (kv_truth); ``ok`` when its index proved true.
    kv_truth: dict[str, KvTruth] = field(default_factory=dict)


async def run(fleet: Fleet, schedule: list[tuple[str, float]], *, gap_s: float = 2.0, tail_s: float = 2.0,
              pace_s: float = 0.02, writers: int = 2, chat_clients: int = 2,
              tail_until_written: bool = False) -> RunResult:
    """Traffic on a started fleet; the faults of ``schedule`` ((name, duration) pairs) one after
    another, ``gap_s`` apart; traffic goes on ``tail_s`` after the last (with
    ``tail_until_written``, only until every document took a write after it, at most ``tail_s``);
    then the read-back."""
    traffic = Traffic(fleet, pace_s=pace_s)
    started_at = mono()
    traffic.start(writers=writers, chat_clients=chat_clients)
    faults: list[FaultRecord] = []
    try:
        for name, duration in schedule:
            await asyncio.sleep(gap_s)
            faults.append(await FAULTS[name](fleet, duration))
        tail_end = mono() + tail_s
        while mono() < tail_end:
            if tail_until_written and faults and _written_after(traffic, faults[-1].back):
                break
            await asyncio.sleep(0.05)
    finally:
        await traffic.finish()
    ended_at = mono()
    history = await read_back(fleet)
    history.attempts = traffic.attempts
    history.chats = traffic.chats
    history.last_fault_at = max((f.back for f in faults), default=started_at)
    # The routers reach the head; give them (and the ACK path into PostgreSQL) a bounded while.
    deadline = mono() + 15
    heads = {d: max(held) for d, held in history.stream.items() if held}
    while mono() < deadline and not _on_heads(history, heads):
        await asyncio.sleep(0.25)
        history.applies = (await read_back(fleet)).applies
    history.applies = _incarnations(history.applies, faults)
    history.live_routers = {_incarnation(name, faults, math.inf) for name in fleet.names("router")}
    await asyncio.sleep(max(0.0, ended_at + 1.5 - mono()))  # the last write past the reconciler's grace
    reconcile, verify = await _audit_checks(fleet)
    kv_dropped = await fleet.dropped_kv()
    truth = await kv_truth(fleet)
    return RunResult(history, faults, reconcile, verify, started_at, ended_at,
                     unexpected=traffic.unexpected, passed_over=traffic.passed_over,
                     unknown_why=dict(traffic.unknown_why), kv_dropped=kv_dropped, kv_truth=truth)


@dataclass
class KvTruth:
    """A router's prefix index after the faults, tried with a prompt of its own: ``ok`` once an
    answer's predicted cached tokens equalled the worker's reported ones (> 0); the last answer
    and how many were asked."""

    ok: bool = False
    predicted: int | None = None
    cached: int | None = None
    worker: str | None = None
    status: int | None = None
    asked: int = 0


async def kv_truth(fleet: Fleet, *, within_s: float = 20.0) -> dict[str, KvTruth]:
    """After the faults, every router's prefix index is live and true: a prompt new to the fleet,
    sent through a router again and again, is predicted as cached on the worker that computed it,
    exactly as that worker reports (``usage.prompt_tokens_details.cached_tokens``), within
    ``within_s``. A router whose index froze (a dump left pending, events dropped as duplicates
    of a dead process's ids) or kept blocks the worker no longer has does not get there."""
    out: dict[str, KvTruth] = {}
    async with httpx.AsyncClient(timeout=5) as http:
        for name, url in zip(fleet.names("router"), fleet.urls("router"), strict=True):
            truth = out[name] = KvTruth()
            prompt = f"{name} after the faults {secrets.token_hex(8)}: " + "a long shared document. " * 60
            deadline = mono() + within_s
            while mono() < deadline and not truth.ok:
                truth.asked += 1
                try:
                    r = await http.post(f"{url}/v1/completions",
                                        json={"model": MODEL, "prompt": prompt, "max_tokens": 1})
                except httpx.HTTPError:
                    r = None
                if r is not None:
                    truth.status = r.status_code
                    if r.status_code == 200:
                        truth.predicted, truth.cached = predicted_and_cached(r)
                        truth.worker = r.headers.get("x-worker-instance-id")
                        truth.ok = truth.predicted == truth.cached > 0
                if not truth.ok:
                    await asyncio.sleep(0.1)
    return out


def _written_after(traffic: Traffic, at: float) -> bool:
    """Whether every document took a write invoked after ``at``."""
    return {a.document for a in traffic.attempts if a.answer is Answer.ACCEPTED and a.invoked > at} == {
        doc(kind) for kind in KINDS}


def _on_heads(history: History, heads: dict[str, int]) -> bool:
    newest: dict[tuple[str, str], int] = {}
    for ap in history.applies:
        newest[(ap.router, ap.document)] = max(newest.get((ap.router, ap.document), 0), ap.revision)
    routers = {ap.router for ap in history.applies}
    return bool(routers) and all(newest.get((r, d), 0) >= h for r in routers for d, h in heads.items())


def _incarnation(router: str, faults: list[FaultRecord], at: float) -> str:
    """``router#k``: its k-th run (a restarted router applies the head again: not a duplicate)."""
    k = sum(1 for f in faults if f.name == "kill" and f.target == router and f.began <= at)
    return f"{router}#{k}"


def _incarnations(applies: list[Apply], faults: list[FaultRecord]) -> list[Apply]:
    return [Apply(_incarnation(ap.router, faults, ap.at), ap.document, ap.revision, ap.at) for ap in applies]


async def read_back(fleet: Fleet) -> History:
    """The stream (both documents), the audit decisions and every router ACK."""
    h = History()
    nc = await buskit.connect_as(fleet.bus.url, Identity(IdentityKind.CONTROLPLANE))
    try:
        log = session_keys().policy_log(nc)
        for kind in KINDS:
            held = {s.revision: s.msg_id or "" async for s in log.history(MODEL, kind)}
            h.stream[doc(kind)] = held
            if held:  # (fewer than the history depth held: nothing was retired)
                h.retired_below[doc(kind)] = 0 if len(held) < fleet.history_depth else min(held)
    finally:
        await nc.close()
    store = AuditStore.from_url(fleet.database_url)
    try:
        h.audit.extend(await audit_decisions(store, MODEL))
        async with store.engine.connect() as conn:
            c = router_acks.c
            result = await conn.execute(select(c.router_id, c.kind, c.revision, c.status, c.event_id, c.at)
                                        .where(c.model == MODEL))
            for router_id, kind, revision, status, event_id, at in result:
                if event_id is not None:
                    h.acked_events.add(str(event_id))
                if status == "ACK":
                    h.applies.append(Apply(router_id, f"{MODEL}/{kind}", int(revision), to_mono(at)))
    finally:
        await store.close()
    return h


async def _audit_checks(fleet: Fleet) -> tuple[dict[str, Any], dict[str, Any]]:
    """``rudder audit reconcile`` and ``rudder audit verify`` as the API answers them (a 503 is
    asked again, as an operator would, for up to 10 s; the last answer counts), each with the
    seconds it took (``took_s``: reconcile settles every ambiguous write of the run)."""
    headers = {"authorization": f"Bearer {fleet.tokens['admin']}"}
    answers: list[dict[str, Any]] = []
    async with httpx.AsyncClient(base_url=fleet.urls("controlplane")[0], headers=headers, timeout=600) as http:
        for method, path in (("POST", "/audit/reconcile"), ("GET", "/audit/verify")):
            began = mono()
            deadline = began + 10
            while True:
                r = await http.request(method, path)
                if r.status_code != 503 or mono() > deadline:
                    break
                await asyncio.sleep(0.5)
            body = r.json() if r.headers.get("content-type", "").startswith("application/json") else {}
            answers.append({"status": r.status_code, "took_s": round(mono() - began, 2), **body})
    return answers[0], answers[1]


# -- measures for the report ---------------------------------------------------------------------------


def writes_refused_s(attempts: list[Attempt], began: float) -> float:
    """From the first attempt after a fault began (``began``) that was not answered (200 or 409)
    to the first answered after it (0 when none was refused)."""
    after = sorted((a for a in attempts if a.invoked >= began), key=lambda a: a.invoked)
    first_bad = next((a for a in after if a.answer in (Answer.REFUSED, Answer.UNKNOWN)), None)
    if first_bad is None:
        return 0.0
    first_good = next((a for a in after if a.invoked > first_bad.invoked
                       and a.answer in (Answer.ACCEPTED, Answer.CONFLICT)), None)
    end = first_good.completed if first_good is not None and first_good.completed else after[-1].invoked
    return max(0.0, end - first_bad.invoked)


def convergence_s(history: History, fault: FaultRecord, routers: list[str]) -> float | None:
    """From the fault's end until every router applied the first write accepted after it (or a
    later revision of that document); None when no write was accepted after it."""
    first = min((a for a in history.attempts if a.answer is Answer.ACCEPTED and a.invoked >= fault.back
                 and a.new_revision is not None), key=lambda a: a.invoked, default=None)
    if first is None or first.new_revision is None:
        return None
    worst = 0.0
    for router in routers:
        times = [ap.at for ap in history.applies if ap.router.split("#")[0] == router
                 and ap.document == first.document and ap.revision >= first.new_revision]
        if not times:
            return math.inf
        worst = max(worst, min(times) - fault.back)
    return worst


def percentiles(values: list[float]) -> dict[str, float | None]:
    vals = sorted(v for v in values if v is not None)
    if not vals:
        return {"p50": None, "p99": None, "max": None}
    p99 = vals[min(len(vals) - 1, math.ceil(0.99 * len(vals)) - 1)]
    return {"p50": round(statistics.median(vals), 3), "p99": round(p99, 3), "max": round(vals[-1], 3)}
