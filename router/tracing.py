"""The spans of one routed request (controlplane.telemetry.traces), built from the times the
request path already takes, so that its hooks are one call each and nothing at all when tracing
is off (the caller holds None).

    router request (server span; child of the client's traceparent)
    ├── tokenize                 body read → prompt tokenized and hashed
    ├── select                   asked the scheduler → worker chosen (worker id, revisions, cost)
    ├── first token              sent to the worker → its first token
    └── done                     first token → last byte relayed (status)

The worker gets the request span's ``traceparent``, so its own spans are children of it.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, MutableMapping
from typing import Any

from opentelemetry.trace import Span, Status, StatusCode

from controlplane.telemetry import traces
from router.commands import Selection


class RequestTrace:
    def __init__(self, headers: Mapping[str, str], *, request_id: str, model: str, router_id: str,
                 path: str, started: float, prompt_tokens: int) -> None:
        # perf_counter seconds → epoch nanoseconds, for spans of steps already timed
        self._offset = time.time_ns() - int(time.perf_counter() * 1e9)
        self.root, _ = traces.server_span("router request", headers, start_time=self._ns(started), **{
            "rudder.request_id": request_id, "rudder.model": model, "rudder.router_id": router_id,
            "url.path": path})  # current for the rest of the request's task (log lines get its ids)
        self.tokenized = time.perf_counter()  # created once the prompt is tokenized
        self.step("tokenize", started, self.tokenized, **{"rudder.prompt_tokens": prompt_tokens})
        self._first: float | None = None
        self._sent = started
        self._ended = False

    def _ns(self, t: float) -> int:
        return self._offset + int(t * 1e9)

    def step(self, name: str, start: float, end: float, **attributes: Any) -> Span:
        span = traces.child(name, self.root, start_time=self._ns(start), **attributes)
        span.end(end_time=self._ns(end))
        return span

    def selected(self, sel: Selection, start: float, end: float, sent_at: float,
                 figures: Mapping[str, Any] | None = None) -> None:
        """The select step, with the policy revisions and the chosen worker as attributes (and the
        decision's figures when it was sampled: router.decisions)."""
        attributes: dict[str, Any] = {
            "rudder.worker_id": sel.instance_id, "rudder.dp_rank": sel.dp_rank,
            "rudder.pool": sel.pool.value, "rudder.candidates": sel.candidates,
            "rudder.cost": sel.cost, "rudder.predicted_cached_tokens": sel.cached_tokens,
            "rudder.prompt_tokens": sel.prompt_tokens, "rudder.predicted_ttft_ms": sel.predicted_ttft_ms,
            "rudder.policy_revisions": sel.revisions.text,
            **{f"rudder.policy_revision.{k}": v for k, v in sel.revisions.items()},
        }
        if figures:
            attributes.update({f"rudder.decision.{k}": v for k, v in figures.items() if v is not None})
        self.step("select", start, end, **attributes)
        for name, value in attributes.items():
            if name.startswith(("rudder.worker_id", "rudder.policy_revision")) and value is not None:
                self.root.set_attribute(name, value)
        self._sent = sent_at

    def inject(self, headers: MutableMapping[str, str]) -> None:
        traces.inject(headers, self.root)

    def first_token(self, now: float) -> None:
        if self._first is None:
            self._first = now
            self.step("first token", self._sent, now)

    def done(self, status: str, now: float | None = None) -> None:
        """The request ended with ``status`` (an HTTP status, 499 for a client gone): the done
        step and the request span end. Once."""
        if self._ended:
            return
        self._ended = True
        end = time.perf_counter() if now is None else now
        if self._first is not None:
            self.step("done", self._first, end, **{"http.response.status_code": int(status)})
        self.root.set_attribute("http.response.status_code", int(status))
        if int(status) >= 500:
            self.root.set_status(Status(StatusCode.ERROR))
        self.root.end(end_time=self._ns(end))
