"""One inference request's own work, on either path (router.express's callbacks, router.api's
task): its body parsed, its fields and headers checked, its prompt tokenized and hashed, the
selection's request and the worker's headers and body made, and its answer's end recorded.

Pure but for the runtime it is handed, and compiled with the rest of the request path (setup.py):
the express path calls it natively. Nothing here awaits.
"""

from __future__ import annotations

import itertools
import json
import os
import re
from collections.abc import Mapping
from typing import Any, Protocol

from starlette.types import Scope

from controlplane.protocol.errors import InvalidRequest, NotFound
from controlplane.protocol.hashing import chain_hashes
from controlplane.protocol.inference import lax_bool
from router.commands import RequestDone, RoutingRequest, Selection
from router.decisions import DecisionLog
from router.metrics import RouterMetrics
from router.proxy import Proxy
from router.scheduler import Scheduler
from router.settings import RouterSettings
from router.sse import json_bytes
from router.targets import Targets, parse_targets, parse_ttft_slo
from router.tokenize import Tokenizer, TokenizerRegistry


class Runtime(Protocol):
    """What the API needs from the process wiring (router.app.RouterRuntime)."""

    settings: RouterSettings
    scheduler: Scheduler
    proxy: Proxy
    metrics: RouterMetrics
    tokenizers: TokenizerRegistry
    decisions: DecisionLog

    def readiness(self) -> list[str]: ...

    def dumps_missed(self) -> int: ...

    def kv_backlog(self) -> int: ...


# The router's own request ids (a request without x-request-id): uuid4().hex's shape, a random
# prefix per process and a count, unique without a getrandom syscall per request (it showed in
# the router's profile). Not secrets: a client can name any id it likes (x-request-id).
_ID_PREFIX = os.urandom(8).hex()
_ID_SEQ = itertools.count()

_CACHED = re.compile(rb'"cached_tokens"\s*:\s*(\d+)')

# Where a request's scope keeps its model label once the router serves that model, for the
# error mapping (router.api; a scope key: Starlette's ``request.state`` makes an object per request).
MODEL_KEY = "rudder.model"


# Hop-by-hop and framing headers we never forward; and ``expect``: the router has read the whole
# body already, and a worker asked for 100-continue answers a 100 before its answer.
_DROP = frozenset({
    "host", "content-length", "connection", "keep-alive", "transfer-encoding", "te", "upgrade",
    "proxy-authorization", "proxy-connection", "accept-encoding", "expect",
})
# A client's credentials are for the router's edge, not for workers (a stolen worker credential
# must not harvest them): dropped unless RUDDER_FORWARD_CREDENTIAL_HEADERS names them.
CREDENTIAL_HEADERS = frozenset({"authorization", "cookie", "x-api-key", "api-key"})


def forward_headers(headers: Mapping[str, str], *, allow: frozenset[str] = frozenset()) -> dict[str, str]:
    """The request's headers a worker receives: no hop-by-hop ones, no client credentials
    (:data:`CREDENTIAL_HEADERS`) but those in ``allow`` (lower case)."""
    return {k: v for k, v in headers.items()
            if (name := k.lower()) not in _DROP and (name not in CREDENTIAL_HEADERS or name in allow)}


def parse_body(raw: bytes | bytearray) -> dict[str, Any]:
    """The body as a JSON object. Raises InvalidRequest."""
    try:
        body = json_bytes(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise InvalidRequest(f"body is not valid JSON: {exc}", field="body") from exc
    except RecursionError:  # nested deeper than the parser goes: not a body anyone sends
        raise InvalidRequest("body is not valid JSON: nested too deeply", field="body") from None
    if not isinstance(body, dict):
        raise InvalidRequest("body must be a JSON object", field="body")
    return body


def tokenize_request(tok: Tokenizer, body: dict[str, Any], chat: bool,
              block_sizes: tuple[int, ...]) -> tuple[list[int], int, dict[int, list[int]]]:
    """(token ids, prompt tokens, chain hashes per block size): pure, so it can run in a thread.
    Raises InvalidRequest naming the prompt's field for text that is not Unicode (a lone surrogate,
    which a JSON ``\\ud800`` escape makes): no tokenizer encodes it (vLLM answers it 400 too)."""
    try:
        tokens, n_prompt = tok.chat(body.get("messages")) if chat else tok.prompt(body.get("prompt"))
    except UnicodeEncodeError as exc:
        field = "messages" if chat else "prompt"
        raise InvalidRequest(f"{field} is not valid Unicode text ({exc.reason})", field=field) from None
    hashes = {bs: chain_hashes(tokens, bs) for bs in block_sizes} if tokens else {}
    return tokens, n_prompt, hashes


def request_fields(rt: Runtime, scope: Scope, hdrs: Mapping[str, str],
            body: dict[str, Any]) -> tuple[str, bool, Targets | None, float | None]:
    """(model, stream, explicit targets, TTFT objective) of an inference request's parsed body and
    headers, checked; the model's label set in ``scope`` for the metrics. Raises InvalidRequest,
    NotFound."""
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise InvalidRequest("model must be a non-empty string", field="model")
    if model not in rt.settings.models:
        raise NotFound(f"The model `{model}` does not exist on this router", field="model")
    # The metrics' model label from here on: a name the router serves, never a client's free
    # text (every unknown name would otherwise become a series of its own, kept for good).
    scope[MODEL_KEY] = model
    try:
        stream = lax_bool(body.get("stream"), "stream")
    except ValueError as exc:
        raise InvalidRequest(str(exc), field="stream") from None
    return model, stream, parse_targets(body.get("nvext"), hdrs, lowered=True), parse_ttft_slo(body.get("nvext"), hdrs)


def request_headers(scope: Scope) -> dict[str, str]:
    """The request's headers, read once (names are lower case in ASGI; the first of a repeated
    name is kept, as Starlette's ``Headers.get`` answers)."""
    hdrs: dict[str, str] = {}
    for name, value in scope["headers"]:
        hdrs.setdefault(name.decode("latin-1"), value.decode("latin-1"))
    return hdrs


def routing_request(rt: Runtime, hdrs: Mapping[str, str], model: str, n_prompt: int, hashes: dict[int, list[int]],
             targets: Targets | None, slo: float | None) -> tuple[str, dict[str, str], RoutingRequest]:
    """(request id, the headers the worker gets, the selection's request) of a checked request."""
    settings = rt.settings
    request_id = hdrs.get("x-request-id") or f"{_ID_PREFIX}{next(_ID_SEQ):016x}"
    headers = forward_headers(hdrs, allow=settings.credential_headers_allowed)
    headers["x-request-id"] = request_id
    return request_id, headers, RoutingRequest(
        request_id=request_id, model=model, prompt_tokens=n_prompt, hashes=hashes, targets=targets,
        ttft_slo_ms=slo,
    )


def answer_ended(rt: Runtime, sel: Selection, status: str, tail: bytes, ttft_ms: float | None, *,
                  itl_ms: float | None = None, decode_tokens: int | None = None,
                  first_token: bool = False, first_ttft_ms: float | None = None) -> None:
    """A worker's answer ended: count it by worker and status, compare the cached tokens the
    worker reported (``usage``, in ``tail``: the whole answer, or a stream's last chunks) with
    the prediction (a byte scan, no JSON parse), end the booking (one ``RequestDone``, with the
    stream's timing and the cached tokens for the worker's checks; with ``first_token``, the
    request's first token too, ``first_ttft_ms`` feeding its calibration), and complete the decision's
    record if it was sampled (router.decisions) with the measured TTFT (sent to the worker →
    first token)."""
    rt.metrics.worker_answered(sel.model, sel.instance_id, status)
    found = _CACHED.search(tail) if b'"cached_tokens"' in tail else None
    cached = int(found.group(1)) if found is not None else None
    if cached is not None:
        series = rt.metrics.model(sel.model)
        series.predicted_cached.value += sel.cached_tokens  # (Count.inc: both are counts, never negative)
        series.reported_cached.value += cached
    rt.scheduler.send(RequestDone(sel.booking_id, itl_ms=itl_ms, decode_tokens=decode_tokens,
                                  instance_id=sel.instance_id, predicted_cached=sel.cached_tokens,
                                  reported_cached=cached, first_token=first_token, ttft_ms=first_ttft_ms))
    if rt.decisions.sample > 0.0:
        record = rt.decisions.finish(sel.request_id, sel.instance_id, ttft_ms=ttft_ms,
                                     cached_tokens=cached, status=status)
        if record is not None:
            rt.metrics.observe_decision(record)


def target_body(
    body: dict[str, Any], sel: Selection, *, kv_transfer_params: Any = None,
    raw: bytes | bytearray | None = None
) -> bytes:
    """The body the worker gets: the client's, with ``nvext`` naming the target. Without an
    ``nvext`` of the client's, its bytes (``raw``, the parsed ``body``'s source) are kept and the
    member appended: no re-encoding of the whole body on every request."""
    if raw is not None and kv_transfer_params is None and "nvext" not in body:
        # Only an object in an ASCII-compatible encoding ends with a "}" byte after its first
        # "{" (json.loads also takes UTF-16/32, whose bytes must not be spliced).
        inner = raw.strip()
        if inner[:1] == b"{" and inner[-1:] == b"}":
            sep = b"," if body else b""
            return b"%s%s\"nvext\":{\"backend_instance_id\":%d,\"dp_rank\":%d}}" % (
                bytes(inner[:-1]), sep, sel.instance_id, sel.dp_rank)
    out = dict(body)
    nvext = dict(out.get("nvext") or {})
    nvext["backend_instance_id"] = sel.instance_id
    nvext["dp_rank"] = sel.dp_rank
    out["nvext"] = nvext
    if kv_transfer_params is not None:
        out["kv_transfer_params"] = kv_transfer_params
    return json.dumps(out).encode()


# What vLLM's disaggregated proxy sends a prefill worker: compute the prompt, keep its KV for a
