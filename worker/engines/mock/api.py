"""OpenAI-compatible HTTP API of the mock engine (one Starlette app per worker process).

``POST /v1/completions`` and ``/v1/chat/completions`` (stream or not; ``usage`` with
``prompt_tokens_details.cached_tokens``; ``stream_options.include_usage``), ``GET /v1/models``,
``/health``, ``/metrics`` (Prometheus text), ``POST /reset_prefix_cache`` (as vLLM's).
The router's chosen dp rank comes in ``x-dp-rank`` or ``nvext.dp_rank``.

A ``prefill`` worker asked for a remote decode (``kv_transfer_params.do_remote_decode``, as vLLM's
disaggregated proxy asks) answers, unstreamed, with ``kv_transfer_params`` shaped as vLLM's
NixlConnector's: the engine that holds the prompt's KV and its blocks (the mock's pool names a
block by its chain hash), which the router hands to the decode worker.

Kept lean on purpose: the router benchmark compares router-proxied and direct throughput, so
bodies are parsed with ``json`` and stream chunks are formatted from per-request templates.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route
from starlette.types import Receive

from controlplane.protocol.errors import error_json
from controlplane.protocol.events import WorkerRole
from controlplane.protocol.inference import lax_bool
from worker.engines.mock.engine import EngineStopped, MockCore, RequestHandle, RequestRejected
from worker.engines.mock.tokenizer import BYTES, MockTokenizer

_U32 = 2**32


class ApiError(Exception):
    """An OpenAI-shaped error answer: ``{"error": {message, type, param, code}}``."""

    def __init__(self, status: int, message: str, *, param: str | None = None,
                 type_: str = "invalid_request_error", code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.type = type_
        self.code = code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}

    def response(self) -> Response:
        return Response(error_json(self.body()), status_code=self.status, media_type="application/json")


@dataclass(slots=True)
class ApiStats:
    requests: int = 0
    errors: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    generation_tokens: int = 0


async def _disconnected(receive: Receive) -> None:
    """Until the client goes away (its body already read: the next message is the disconnect)."""
    while (await receive())["type"] != "http.disconnect":
        pass


def _int_field(value: Any, name: str, *, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ApiError(400, f"{name} must be an integer ≥ {minimum}", param=name)
    return value


def _token_list(value: Any, name: str) -> list[int]:
    if not value or not all(
        isinstance(t, int) and not isinstance(t, bool) and 0 <= t < _U32 for t in value
    ):
        raise ApiError(400, f"{name} must be a non-empty list of token ids (u32)", param=name)
    return list(value)


def completion_prompt(body: Mapping[str, Any], tok: MockTokenizer = BYTES) -> list[int]:
    """Token ids of a completions ``prompt``: a string, token ids, or a batch of one of those."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]
    if isinstance(prompt, str):
        if not prompt:
            raise ApiError(400, "prompt must not be empty", param="prompt")
        return tok.encode(prompt)
    if isinstance(prompt, list):
        if prompt and isinstance(prompt[0], str | list):
            raise ApiError(400, "batched prompts are not supported; send one prompt per request",
                           param="prompt")
        return _token_list(prompt, "prompt")
    raise ApiError(400, "prompt must be a string or a list of token ids", param="prompt")


def chat_prompt(body: Mapping[str, Any], tok: MockTokenizer = BYTES) -> list[int]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages or not all(
        isinstance(m, dict) for m in messages
    ):
        raise ApiError(400, "messages must be a non-empty list of message objects",
                       param="messages")
    try:
        return tok.encode_chat(messages)
    except ValueError as exc:
        raise ApiError(400, str(exc), param="messages") from None


def requested_dp_rank(request: Request, body: Mapping[str, Any]) -> int | None:
    """The router's pick: header ``x-dp-rank`` wins over ``nvext.dp_rank``; None = any rank."""
    header = request.headers.get("x-dp-rank")
    if header is not None:
        try:
            return _int_field(int(header), "x-dp-rank", minimum=0)
        except ValueError:
            raise ApiError(400, "x-dp-rank must be an integer ≥ 0", param="x-dp-rank") from None
    nvext = body.get("nvext")
    if isinstance(nvext, dict) and nvext.get("dp_rank") is not None:
        return _int_field(nvext["dp_rank"], "nvext.dp_rank", minimum=0)
    return None


def remote_decode_asked(body: Mapping[str, Any]) -> bool:
    """The request asks this (prefill) engine to keep the prompt's KV for a remote decode."""
    params = body.get("kv_transfer_params")
    return isinstance(params, dict) and params.get("do_remote_decode") is True


def _usage(handle: RequestHandle) -> dict[str, Any]:
    completion = len(handle.tokens)
    return {
        "prompt_tokens": handle.prompt_tokens,
        "completion_tokens": completion,
        "total_tokens": handle.prompt_tokens + completion,
        "prompt_tokens_details": {"cached_tokens": handle.cached_tokens},
    }


class MockApi:
    def __init__(self, core: MockCore, *, model: str, instance_id: int,
                 tokenizer: MockTokenizer = BYTES) -> None:
        self.core = core
        self.tokenizer = tokenizer
        self.model = model
        self.instance_id = instance_id
        self.stats = ApiStats()
        self._model_json = json.dumps(model)
        self.app = Starlette(routes=[
            Route("/v1/completions", self.completions, methods=["POST"]),
            Route("/v1/chat/completions", self.chat_completions, methods=["POST"]),
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/health", self.health, methods=["GET"]),
            Route("/metrics", self.metrics, methods=["GET"]),
            Route("/reset_prefix_cache", self.reset_prefix_cache, methods=["POST"]),
        ])

    # -- routes ----------------------------------------------------------------------------

    async def completions(self, request: Request) -> Response:
        return await self._generate(request, chat=False)

    async def chat_completions(self, request: Request) -> Response:
        return await self._generate(request, chat=True)

    async def models(self, request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [
            {"id": self.model, "object": "model", "created": 0, "owned_by": "rudder"}
        ]})

    async def health(self, request: Request) -> Response:
        if self.core.stopped:
            return JSONResponse({"status": "stopping"}, status_code=503)
        return JSONResponse({"status": "ok"})

    async def reset_prefix_cache(self, request: Request) -> Response:
        if not self.core.reset_prefix_cache():
            return ApiError(409, "blocks are in use; retry when idle", code="busy").response()
        return JSONResponse({"status": "ok"})

    async def metrics(self, request: Request) -> Response:
        lines: list[str] = []
        s = self.stats
        for name, value in (("requests", s.requests), ("request_errors", s.errors),
                            ("prompt_tokens", s.prompt_tokens),
                            ("cached_tokens", s.cached_tokens),
                            ("generation_tokens", s.generation_tokens)):
            lines.append(f"# TYPE rudder_mock_{name}_total counter")
            lines.append(f"rudder_mock_{name}_total {value}")
        total = self.core.settings.num_blocks
        gauges: dict[str, list[str]] = {}
        for rank, load in zip(self.core.ranks, self.core.load(), strict=True):
            label = f'{{dp_rank="{rank.rank}"}}'
            for name, value in (
                ("running", load.running), ("waiting", load.waiting),
                ("kv_used_blocks", load.kv_used_blocks), ("kv_total_blocks", total),
                ("kv_cached_blocks", rank.pool.cached_blocks),
                ("active_prefill_tokens", load.active_prefill_tokens),
                ("preemptions", rank.scheduler.preemptions), ("steps", rank.steps),
            ):
                gauges.setdefault(name, []).append(f"rudder_mock_{name}{label} {value}")
            # vLLM's names, so one metrics reader serves both engines.
            gauges.setdefault("vllm_running", []).append(
                f"vllm:num_requests_running{label} {load.running}")
            gauges.setdefault("vllm_waiting", []).append(
                f"vllm:num_requests_waiting{label} {load.waiting}")
            gauges.setdefault("vllm_usage", []).append(
                f"vllm:kv_cache_usage_perc{label} {load.kv_used_blocks / total}")
        for samples in gauges.values():
            lines.extend(samples)
        return PlainTextResponse("\n".join(lines) + "\n",
                                 media_type="text/plain; version=0.0.4")

    # -- generation ------------------------------------------------------------------------

    async def _generate(self, request: Request, *, chat: bool) -> Response:
        self.stats.requests += 1
        try:
            body = await self._json(request)
            model = body.get("model")
            if model is not None and model != self.model:
                raise ApiError(404, f"The model `{model}` does not exist.", param="model",
                               type_="NotFoundError", code="model_not_found")
            try:
                prompt = chat_prompt(body, self.tokenizer) if chat else completion_prompt(body, self.tokenizer)
            except UnicodeEncodeError as exc:  # a lone surrogate (a JSON "\ud800" escape): as vLLM, a 400
                field = "messages" if chat else "prompt"
                raise ApiError(400, f"{field} is not valid Unicode text ({exc.reason})", param=field) from None
            max_tokens = body.get("max_completion_tokens") if chat else None
            if max_tokens is None:
                max_tokens = body.get("max_tokens")
            max_tokens = (self.core.settings.default_max_tokens if max_tokens is None
                          else _int_field(max_tokens, "max_tokens", minimum=1))
            if body.get("n", 1) != 1:
                raise ApiError(400, "only n=1 is supported", param="n")
            dp_rank = requested_dp_rank(request, body)
            options = body.get("stream_options")
            field = "stream"
            try:  # as vLLM reads its booleans (lax); a value it refuses is a 400 naming the field
                stream = lax_bool(body.get("stream"), field)
                field = "stream_options.include_usage"
                include_usage = isinstance(options, dict) and lax_bool(options.get("include_usage"), field)
            except ValueError as exc:
                raise ApiError(400, str(exc), param=field) from None
            handoff = self.core.role is WorkerRole.PREFILL and remote_decode_asked(body)
            try:
                handle = await self.core.submit(prompt, max_tokens=max_tokens, dp_rank=dp_rank)
            except RequestRejected as exc:
                raise ApiError(400, str(exc), param=exc.param) from None
            except EngineStopped as exc:
                raise ApiError(503, str(exc), type_="ServiceUnavailable") from None
        except ApiError as err:
            self.stats.errors += 1
            return err.response()

        self.stats.prompt_tokens += len(prompt)
        headers = {"x-worker-instance-id": str(self.instance_id), "x-dp-rank": str(handle.rank)}
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        created = int(time.time())
        if stream:
            return StreamingResponse(
                self._stream(handle, rid, created, chat=chat, include_usage=include_usage),
                media_type="text/event-stream", headers=headers,
            )
        try:
            if not await self._wait_for_client(request, handle):
                self.stats.errors += 1  # nobody reads an answer now: what vLLM's server answers
                return Response(status_code=499)
        except EngineStopped as exc:
            self.stats.errors += 1
            return ApiError(503, str(exc), type_="ServiceUnavailable").response()
        finally:
            if not handle.finished:
                self.core.abort(handle)
        self._account(handle)
        text = self.tokenizer.decode(handle.tokens)
        choice: dict[str, Any]
        if chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text},
                      "logprobs": None, "finish_reason": "length"}
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": "length"}
        answer: dict[str, Any] = {
            "id": rid, "object": "chat.completion" if chat else "text_completion",
            "created": created, "model": self.model, "choices": [choice], "usage": _usage(handle),
        }
        if handoff:
            answer["kv_transfer_params"] = self.kv_transfer_params(handle)
        return JSONResponse(answer, headers=headers)

    def kv_transfer_params(self, handle: RequestHandle) -> dict[str, Any]:
        """What this prefill engine hands the decode engine for ``handle``'s prompt: its full
        blocks (chain hashes, parents first) and this engine's id (vLLM's NixlConnector keys)."""
        full = handle.prompt_tokens // self.core.settings.block_size
        return {
            "do_remote_prefill": True, "do_remote_decode": False,
            "remote_engine_id": str(self.instance_id),
            "remote_block_ids": [chain for chain, _ in handle.seq.chain[:full]],
        }

    async def _stream(self, handle: RequestHandle, rid: str, created: int, *, chat: bool,
                      include_usage: bool) -> AsyncIterator[str]:
        obj = "chat.completion.chunk" if chat else "text_completion"
        head = (f'data: {{"id":"{rid}","object":"{obj}","created":{created},'
                f'"model":{self._model_json},"choices":[{{"index":0,')
        chunk: Callable[[str, str], str]
        if chat:
            # As vLLM does, the role travels with the first token (not ahead of the prefill), so
            # the first chunk a client sees marks the end of the prefill.
            role = '"role":"assistant",'

            def chunk(text: str, finish: str) -> str:
                nonlocal role
                out = (f'{head}"delta":{{{role}"content":{json.dumps(text)}}},"logprobs":null,'
                       f'"finish_reason":{finish}}}]}}\n\n')
                role = ""
                return out
        else:
            def chunk(text: str, finish: str) -> str:
                return (f'{head}"text":{json.dumps(text)},"logprobs":null,'
                        f'"finish_reason":{finish}}}]}}\n\n')
        sent = 0
        try:
            while True:
                handle.changed.clear()
                if handle.error is not None:
                    self.stats.errors += 1
                    err = ApiError(503, str(handle.error), type_="ServiceUnavailable")
                    yield f"data: {json.dumps(err.body())}\n\n"
                    break
                n = len(handle.tokens)
                if n > sent or handle.finished:
                    text = self.tokenizer.decode(handle.tokens[sent:n])
                    sent = n
                    yield chunk(text, '"length"' if handle.finished else "null")
                    if handle.finished:
                        self._account(handle)
                        if include_usage:
                            usage = json.dumps(_usage(handle))
                            yield (f'data: {{"id":"{rid}","object":"{obj}","created":{created},'
                                   f'"model":{self._model_json},"choices":[],"usage":{usage}}}\n\n')
                        break
                    continue
                await handle.changed.wait()
            yield "data: [DONE]\n\n"
        finally:
            if not handle.finished:
                self.core.abort(handle)

    async def _wait(self, handle: RequestHandle) -> None:
        while not handle.finished:
            handle.changed.clear()
            if handle.error is not None:
                raise EngineStopped(str(handle.error))
            if handle.finished:
                break
            await handle.changed.wait()

    async def _wait_for_client(self, request: Request, handle: RequestHandle) -> bool:
        """Until ``handle`` finishes (True), or its client goes away first (False; the caller
        aborts it): as vLLM's server does for a non-streamed request (``with_cancellation``), a
        request whose client left is not computed to its end for nobody."""
        done = asyncio.ensure_future(self._wait(handle))
        gone = asyncio.ensure_future(_disconnected(request.receive))
        try:
            await asyncio.wait((done, gone), return_when=asyncio.FIRST_COMPLETED)
        finally:
            done.cancel()
            gone.cancel()
        if done.done() and not done.cancelled():
            done.result()  # raises EngineStopped
            return True
        return False

    def _account(self, handle: RequestHandle) -> None:
        self.stats.cached_tokens += handle.cached_tokens
        self.stats.generation_tokens += len(handle.tokens)

    @staticmethod
    async def _json(request: Request) -> dict[str, Any]:
        raw = await request.body()
        try:
            body = json.loads(raw)
        except (ValueError, RecursionError):  # RecursionError: nested deeper than the parser goes
            raise ApiError(400, "the request body is not valid JSON") from None
        if not isinstance(body, dict):
            raise ApiError(400, "the request body must be a JSON object")
        return body
