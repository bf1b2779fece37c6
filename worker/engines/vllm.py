"""The vLLM engine (DESIGN §6): a real vLLM OpenAI server, started by the worker or attached to.

- Start: ``<vllm_python> -m vllm.entrypoints.openai.api_server`` for the local model folder, with
  prefix caching (vLLM's default), ``--enable-prompt-tokens-details`` (``cached_tokens`` in
  ``usage``), the block size and budgets we advertise, and KV events published over ZMQ on
  loopback. The worker advertises vLLM's own URL: routers call vLLM directly.
- KV events: a SUB socket reads vLLM's batches; :mod:`worker.engines.vllm_events` re-hashes them
  into canonical hashes. Gaps are replayed from vLLM's replay socket (DEALER); a sequence that goes
  backwards means vLLM restarted (``cleared``). An attached worker's view is partial.
- Load: ``/metrics`` polled every ``metrics_interval_s``.
- Tokenizer: the model folder path, so routers tokenize exactly as vLLM does.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import json
import logging
import os
import signal
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import httpx
import zmq
import zmq.asyncio

from bus.tasks import Tasks
from controlplane.protocol.events import (
    DEFAULT_DECODE_MIN_MS,
    DEFAULT_DECODE_MS,
    DEFAULT_PREFILL_MS,
    EngineTiming,
    KvDumpRank,
    RankLoad,
)
from controlplane.protocol.policy import CacheInput
from worker.engines.base import EngineInfo, KvSink
from worker.engines.vllm_events import (
    BadFrame,
    SeqStatus,
    VllmBatch,
    VllmKvTranslator,
    decode_frames,
    decode_payload,
)
from worker.engines.vllm_metrics import VllmMetrics, parse_metrics
from worker.httpserver import advertised_url, bind_socket
from worker.settings import WorkerSettings

log = logging.getLogger(__name__)
# /health polls (one every metrics_interval_s) failed in a row after which vLLM counts as down.
HEALTH_FAILURES = 2

END_OF_REPLAY = -1
_PR_SET_PDEATHSIG = 1


def _free_port(host: str = "127.0.0.1") -> int:
    with bind_socket(host, 0) as sock:
        port: int = sock.getsockname()[1]
        return port


def _die_with_parent() -> None:  # runs in the child between fork and exec
    with contextlib.suppress(Exception):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


def vllm_binds(endpoint: str) -> bool:
    """vLLM's rule: it binds wildcard and ipc/inproc endpoints and connects to the rest."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


def rank_endpoint(endpoint: str, rank: int) -> str:
    """vLLM's per-dp-rank endpoint: tcp port + rank, ``_dp<rank>`` suffix for inproc."""
    if rank == 0 or not endpoint:
        return endpoint
    if "inproc" in endpoint:
        return f"{endpoint}_dp{rank}"
    head, _, port = endpoint.rpartition(":")
    if not port.isdigit() or int(port) == 0:
        return endpoint
    return f"{head}:{int(port) + rank}"


def parse_replay_reply(frames: list[bytes]) -> tuple[int, bytes]:
    """``(seq, payload)`` of one reply from vLLM's replay ROUTER, as a DEALER receives it:
    ``["", topic, seq, payload]``; the end marker is ``["", "", -1, ""]``. Raises BadFrame."""
    if frames and frames[0] == b"":
        frames = frames[1:]  # the REQ-style empty delimiter
    if len(frames) == 3:
        frames = frames[1:]  # the topic
    if len(frames) != 2 or len(frames[0]) != 8:
        raise BadFrame(f"unexpected replay reply of {len(frames)} frames")
    return int.from_bytes(frames[0], "big", signed=True), frames[1]


def vllm_command(settings: WorkerSettings, *, port: int, events: str, replay: str) -> list[str]:
    """The vLLM server command line (pure; tests check it). Raises ValueError without a model."""
    v = settings.vllm
    if v.model_path is None:
        raise ValueError("RUDDER_VLLM__MODEL_PATH is required to start vLLM")
    kv_events = {
        "enable_kv_cache_events": True, "publisher": "zmq", "endpoint": events,
        "replay_endpoint": replay, "topic": v.kv_topic,
    }
    cmd = [
        v.vllm_python, "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(v.model_path), "--served-model-name", v.served_model_name or settings.model,
        "--host", settings.host, "--port", str(port),
        "--block-size", str(v.block_size),
        "--max-num-batched-tokens", str(v.max_num_batched_tokens),
        "--max-num-seqs", str(v.max_num_seqs), "--max-model-len", str(v.max_model_len),
        "--enable-prompt-tokens-details", "--enable-prefix-caching",
        "--kv-events-config", json.dumps(kv_events),
    ]
    if v.enforce_eager:
        cmd.append("--enforce-eager")
    if settings.dp_size > 1:
        cmd += ["--data-parallel-size", str(settings.dp_size)]
    return cmd + list(v.extra_args)


class VllmEngine:
    def __init__(self, settings: WorkerSettings) -> None:
        self.settings = settings
        v = settings.vllm
        self.translator = VllmKvTranslator(block_size=v.block_size)
        self.metrics = VllmMetrics()
        self.url = ""
        self.proc: subprocess.Popen[bytes] | None = None
        self.log_path: Path | None = None
        self._attached = v.attach_url is not None
        self._events_endpoint = v.kv_events_endpoint
        self._replay_endpoint = v.kv_replay_endpoint
        self._ctx: zmq.asyncio.Context | None = None
        self._sub: Any = None
        self._http: httpx.AsyncClient | None = None
        self._tasks = Tasks("vllm engine")
        self._sink: KvSink | None = None
        self._kv_total_blocks = 1
        self._health_failures = 0  # /health polls failed in a row (HEALTH_FAILURES: unhealthy)

    @property
    def partial_view(self) -> bool:
        return self._attached or self.translator.partial

    def healthy(self) -> bool:
        """vLLM's own process is running (when the worker started it) and its ``/health`` (which
        asks the engine core) answered 200 at one of the last ``HEALTH_FAILURES`` polls."""
        if self.proc is not None and self.proc.poll() is not None:
            return False
        return self._health_failures < HEALTH_FAILURES

    # -- lifecycle -------------------------------------------------------------------------

    async def start(self, kv_sink: KvSink) -> EngineInfo:
        s, v = self.settings, self.settings.vllm
        self._sink = kv_sink
        self._http = httpx.AsyncClient(timeout=10.0)
        self._ctx = zmq.asyncio.Context()
        try:
            if v.attach_url is not None:
                self.url = v.attach_url.rstrip("/")
                await self._find_event_endpoints()
                self._subscribe()
            else:
                port = s.port or _free_port(s.host)
                self._events_endpoint = self._events_endpoint or f"tcp://127.0.0.1:{_free_port()}"
                self._replay_endpoint = self._replay_endpoint or f"tcp://127.0.0.1:{_free_port()}"
                # Subscribe before vLLM binds: ZMQ connects lazily, so early batches are not lost.
                self._subscribe()
                self._spawn(vllm_command(s, port=port, events=self._events_endpoint,
                                         replay=self._replay_endpoint))
                self.url = advertised_url(host=s.host, port=port, advertise_host=s.advertise_host)
            await self._wait_healthy(v.startup_timeout_s)
            await self._poll_metrics_once()
        except BaseException:
            await self.stop()
            raise
        self._kv_total_blocks = self.metrics.num_blocks or 1
        if self.metrics.num_blocks is None:
            log.warning("vLLM did not report vllm:cache_config_info num_gpu_blocks")
        if self.metrics.block_size not in (None, v.block_size):
            log.warning("vLLM block size %s differs from the configured %d",
                        self.metrics.block_size, v.block_size)
        block_size = self.metrics.block_size or v.block_size
        self.translator.block_size = block_size
        self._tasks.spawn(self._read_events(), name="vllm-kv-events")
        self._tasks.spawn(self._poll_metrics(), name="vllm-metrics")
        tokenizer = str(v.model_path) if v.model_path is not None else s.model
        return EngineInfo(
            url=self.url, block_size=block_size, kv_total_blocks=self._kv_total_blocks,
            max_num_batched_tokens=v.max_num_batched_tokens, dp_size=s.dp_size,
            tokenizer=tokenizer, engine="vllm",
            # A generic prior (DESIGN §6's formula); each router fits this worker's own model.
            timing=EngineTiming(source="vllm-default", prefill_ms=DEFAULT_PREFILL_MS,
                                decode_ms=DEFAULT_DECODE_MS, decode_min_ms=DEFAULT_DECODE_MIN_MS),
        )

    async def stop(self) -> None:
        await self._tasks.close()
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)  # the API server stops its engine processes
            try:
                await asyncio.to_thread(self.proc.wait, 15)
            except subprocess.TimeoutExpired:
                log.warning("vLLM (pid %d) ignored SIGTERM; killing it", self.proc.pid)
                self.proc.kill()
                await asyncio.to_thread(self.proc.wait, 5)
        if self._sub is not None:
            self._sub.close(linger=0)
            self._sub = None
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None
        if self._http is not None:
            await self._http.aclose()
            self._http = None

    def _spawn(self, cmd: list[str]) -> None:
        v = self.settings.vllm
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
               "VLLM_CPU_KVCACHE_SPACE": str(v.cpu_kvcache_space_gib)}
        fd, name = tempfile.mkstemp(prefix="rudder-vllm-", suffix=".log")
        self.log_path = Path(name)
        log.info("starting vLLM: %s (log %s)", " ".join(cmd), name)
        try:
            self.proc = subprocess.Popen(cmd, stdout=fd, stderr=subprocess.STDOUT, env=env,
                                         preexec_fn=_die_with_parent)
        finally:
            os.close(fd)

    def log_tail(self, lines: int = 30) -> str:
        if self.log_path is None or not self.log_path.exists():
            return ""
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    async def _wait_healthy(self, timeout_s: float) -> None:
        assert self._http is not None
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while loop.time() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(
                    f"vLLM exited with {self.proc.returncode} during start-up:\n{self.log_tail()}"
                )
            if await self._answers_health(timeout_s=2):
                return
            await asyncio.sleep(0.5)
        raise RuntimeError(f"vLLM at {self.url} not healthy after {timeout_s:g} s:\n"
                           f"{self.log_tail()}")

    async def _find_event_endpoints(self) -> None:
        """Attached: use the configured endpoints, else ask vLLM (``GET /kv_event_sources``)."""
        if self._events_endpoint:
            return
        assert self._http is not None
        with contextlib.suppress(httpx.HTTPError, ValueError):
            resp = await self._http.get(f"{self.url}/kv_event_sources")
            if resp.status_code == 200:
                found = _find_keys(resp.json(), ("endpoint", "replay_endpoint"))
                self._events_endpoint = str(found.get("endpoint") or "").replace("*", "127.0.0.1")
                self._replay_endpoint = str(found.get("replay_endpoint") or "").replace(
                    "*", "127.0.0.1")
        if not self._events_endpoint:
            log.warning("no KV event endpoint for %s: routing sees no cache state", self.url)

    # -- KV events -------------------------------------------------------------------------

    def _subscribe(self) -> None:
        """One SUB socket for every dp rank's publisher.

        vLLM binds its PUB socket only for wildcard and ipc/inproc endpoints and *connects* to a
        plain ``tcp://host:port``; we do the opposite of what it does. The default endpoint is
        ``tcp://127.0.0.1:<port>``: we bind on loopback only, and nothing is lost while vLLM
        starts (a connecting PUB queues from the start). Rank r uses port + r (vLLM's rule).
        """
        if not self._events_endpoint or self._ctx is None:
            return
        sub = self._ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.RCVHWM, 100_000)
        for rank in range(self.settings.dp_size):
            endpoint = rank_endpoint(self._events_endpoint, rank)
            if vllm_binds(endpoint):
                sub.connect(endpoint.replace("*", "127.0.0.1"))
            else:
                sub.bind(endpoint)
        sub.setsockopt(zmq.SUBSCRIBE, self.settings.vllm.kv_topic.encode())
        self._sub = sub

    async def _read_events(self) -> None:
        if self._sub is None:
            return
        tr = self.translator
        while True:
            frames = await self._sub.recv_multipart()
            try:
                batch = decode_frames(frames)
            except BadFrame as exc:
                log.warning("bad vLLM KV event message: %s", exc)
                continue
            self.handle_batch(batch, first_expected=None if self._attached else 0)
            if tr.last_seqs.get(batch.dp_rank) != batch.seq:  # a gap: replay it, then the batch
                await self._replay(batch)

    def handle_batch(self, batch: VllmBatch, *, first_expected: int | None) -> None:
        """Apply a live batch in order; leaves the rank's sequence short of it on a gap."""
        tr, rank = self.translator, batch.dp_rank
        if rank not in tr.last_seqs and first_expected is not None and batch.seq > first_expected:
            tr.expect_from(first_expected, rank)  # we missed the first batches: replay them
        status = tr.classify(batch.seq, rank)
        if status is SeqStatus.RESTART:
            log.warning("vLLM dp rank %d KV event sequence went back to %d: vLLM restarted",
                        rank, batch.seq)
            self._emit(tr.restart(rank))
            status = SeqStatus.NEXT
        if status is SeqStatus.NEXT:
            self._emit(tr.apply(batch))

    async def _replay(self, batch: VllmBatch) -> None:
        """Fetch the missing batches of ``batch``'s rank from vLLM's replay socket, apply them,
        then ``batch``. What cannot be replayed (timeout, buffer overrun) is given up: partial."""
        tr, rank = self.translator, batch.dp_rank
        start = tr.last_seqs.get(rank, -1) + 1
        if self._replay_endpoint and self._ctx is not None:
            sock = self._ctx.socket(zmq.DEALER)
            sock.connect(rank_endpoint(self._replay_endpoint, rank).replace("*", "127.0.0.1"))
            try:
                await sock.send_multipart([b"", start.to_bytes(8, "big")])
                while True:
                    if not await sock.poll(2000):
                        log.warning("vLLM replay from %d timed out", start)
                        break
                    seq, payload = parse_replay_reply(await sock.recv_multipart())
                    if seq == END_OF_REPLAY or not payload:
                        break
                    if seq >= batch.seq:
                        continue  # this batch and later ones come from the live socket
                    replayed = decode_payload(seq, payload)
                    if tr.classify(seq, replayed.dp_rank, replaying=True) is SeqStatus.NEXT:
                        self._emit(tr.apply(replayed))
            except BadFrame as exc:
                log.warning("bad vLLM replay message: %s", exc)
            finally:
                sock.close(linger=0)
        if tr.last_seqs.get(rank, -1) < batch.seq - 1:
            tr.give_up_gap(batch.seq, rank)
        self._emit(tr.apply(batch))

    def _emit(self, changes: list[tuple[int, Any, CacheInput]]) -> None:
        assert self._sink is not None
        for rank, data, tier in changes:
            self._sink(rank, data, tier)

    # -- load ------------------------------------------------------------------------------

    async def _poll_metrics_once(self) -> None:
        assert self._http is not None
        try:
            resp = await self._http.get(f"{self.url}/metrics", timeout=5)
            if resp.status_code == 200:
                self.metrics = parse_metrics(resp.text)
        except httpx.HTTPError as exc:
            log.warning("vLLM metrics unavailable: %r", exc)

    async def _answers_health(self, *, timeout_s: float) -> bool:
        """vLLM's ``/health`` answered 200 (it asks the engine core)."""
        assert self._http is not None
        try:
            return (await self._http.get(f"{self.url}/health", timeout=timeout_s)).status_code == 200
        except httpx.HTTPError:
            return False

    async def _poll_health_once(self) -> None:
        was = self.healthy()
        self._health_failures = 0 if await self._answers_health(timeout_s=5) else self._health_failures + 1
        if was != self.healthy():
            if was:
                exited = self.proc.returncode if self.proc is not None else None
                log.error("vLLM at %s is not healthy (%s): the worker leaves until it is",
                          self.url, f"exited with {exited}" if exited is not None else "/health failed")
            else:
                log.warning("vLLM at %s is healthy again: the worker joins again", self.url)

    async def _poll_metrics(self) -> None:
        while True:
            await asyncio.sleep(self.settings.vllm.metrics_interval_s)
            await self._poll_health_once()
            await self._poll_metrics_once()

    def load(self) -> list[RankLoad]:
        out = []
        for rank in range(self.settings.dp_size):
            m = self.metrics.ranks.get(rank)
            if m is None:
                out.append(RankLoad(dp_rank=rank))
                continue
            used = round(m.kv_usage * self._kv_total_blocks)
            # vLLM does not export pending prefill tokens; routers rely on their own bookings.
            out.append(RankLoad(dp_rank=rank, active_decode_blocks=used, kv_used_blocks=used,
                                running=m.running, waiting=m.waiting))
        return out

    def dump(self) -> list[KvDumpRank]:
        out: list[KvDumpRank] = []
        for tier in CacheInput:
            for rank, blocks in self.translator.dump(tier).items():
                if blocks or tier is CacheInput.DEVICE:
                    out.append(KvDumpRank(dp_rank=rank, tier=tier, blocks=blocks))
        if not out:
            out = [KvDumpRank(dp_rank=r) for r in range(self.settings.dp_size)]
        return out


def _find_keys(obj: Any, keys: tuple[str, ...]) -> dict[str, Any]:
    found: dict[str, Any] = {}
    if isinstance(obj, dict):
        for k, val in obj.items():
            if k in keys and isinstance(val, str):
                found.setdefault(k, val)
            else:
                for k2, v2 in _find_keys(val, keys).items():
                    found.setdefault(k2, v2)
    elif isinstance(obj, list):
        for item in obj:
            for k2, v2 in _find_keys(item, keys).items():
                found.setdefault(k2, v2)
    return found
