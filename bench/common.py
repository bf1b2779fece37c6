"""Helpers shared by the fleet benchmarks (``routing_quality.py``, ``proxy_overhead.py``).

Processes are real (``rudder serve worker|router``, or ``python -m worker|router``, on one
embedded ``nats-server``),
all on 127.0.0.1, each in its own session so a stop reaches its children. CPU is sampled with
psutil so a run can show it was not CPU-bound (the dev box has 2 cores).
"""

from __future__ import annotations

import asyncio
import json
import os
import platform
import pstats
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import psutil

ROOT = Path(__file__).resolve().parents[1]
RESULTS = Path(__file__).resolve().parent / "results"
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bus.identities import Identity, IdentityKind  # noqa: E402
from cli.embedded import LocalBus, free_port  # noqa: E402
from cli.keys import ensure_keys  # noqa: E402


def pct(values: Iterable[float], q: float) -> float:
    """The q-quantile (nearest rank, 0 ≤ q ≤ 1) of ``values``; NaN when empty."""
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def code_version() -> str:
    """The commit under test: ``git rev-parse HEAD`` (``+dirty`` if router/ or worker/ differ),
    or ``$BENCH_COMMIT`` when the code is an exported snapshot without .git."""
    try:
        head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True,
                              text=True, timeout=10, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain", "--", "router",
                                "worker", "controlplane"], capture_output=True, text=True,
                               timeout=10).stdout.strip()
        return head + ("+dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return os.environ.get("BENCH_COMMIT", "unknown")


def machine() -> dict[str, Any]:
    return {
        "python": platform.python_version(), "machine": platform.machine(),
        "cpus": os.cpu_count(), "at": datetime.now(UTC).isoformat(), "commit": code_version(),
    }


def write_result(name: str, payload: dict[str, Any]) -> Path:
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / f"{name}.json"
    path.write_text(json.dumps(payload, indent=2) + "\n")
    return path


def spawn(args: list[str], env: dict[str, str], *, log: Path | None = None,
          src: Path | None = None) -> subprocess.Popen[bytes]:
    """Start a child in its own session (stopped with :func:`stop_all`); ``src``: run the code of
    another checkout (a baseline), else this one."""
    root = src or ROOT
    full = dict(os.environ, PYTHONPATH=str(root), **env)
    out = open(log, "ab") if log is not None else subprocess.DEVNULL
    try:
        return subprocess.Popen(args, env=full, cwd=str(root), stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
    finally:
        if log is not None:
            out.close()  # type: ignore[union-attr]


def stop_all(procs: Iterable[subprocess.Popen[bytes]], timeout: float = 15.0) -> None:
    """SIGTERM each child's process group (a worker leaves gracefully), SIGKILL stragglers."""
    procs = list(procs)
    for p in procs:
        if p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
    deadline = time.monotonic() + timeout
    for p in procs:
        try:
            p.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            p.wait(5)


async def wait_until(url: str, ok: Any = None, *, within: float = 60.0) -> Any:
    """Poll GET ``url`` until it answers 200 (and ``ok(json)`` is true); return the JSON body."""
    deadline = time.monotonic() + within
    last: Any = None
    async with httpx.AsyncClient() as client:
        while time.monotonic() < deadline:
            try:
                r = await client.get(url, timeout=1)
                if r.status_code == 200:
                    last = r.json()
                    if ok is None or ok(last):
                        return last
            except (httpx.HTTPError, ValueError):
                pass
            await asyncio.sleep(0.1)
    raise RuntimeError(f"{url} not ready within {within:.0f}s (last answer {last!r})")


def serve_command(kind: str, launcher: str, *, count_calls: Path | None = None) -> list[str]:
    """``python -m <kind>`` (asyncio loop) or ``rudder serve <kind>`` (uvloop when installed,
    as ``rudder up`` runs it); both read their settings from the RUDDER_* environment.
    ``count_calls``: see :func:`python_command`."""
    python = python_command(count_calls)
    if launcher == "module":
        return [*python, "-m", kind]
    if launcher == "cli":
        return [*python, "-m", "cli.main", "serve", kind]
    raise ValueError(f"launcher must be 'module' or 'cli', not {launcher!r}")


def python_command(count_calls: Path | None = None) -> list[str]:
    """This Python, or with ``count_calls`` this Python under ``bench/count_calls.py``, which
    counts the process's calls from SIGUSR1 on and writes them there when it exits
    (:func:`python_calls`); the module or script and its arguments follow."""
    if count_calls is None:
        return [sys.executable]
    return [sys.executable, str(ROOT / "bench" / "count_calls.py"), str(count_calls)]


def python_calls(path: Path, requests: int, *, top: int = 12) -> dict[str, Any]:
    """Python function calls per request of a process run under ``bench/count_calls.py``
    (``serve_command``'s ``count_calls``), which served ``requests`` after its SIGUSR1: a count,
    not a time, so the same on a busy machine as on a quiet one (within what the load changes of
    the code's path: how many commands the scheduler finds queued in a turn, how many chunks
    arrive in one read); read against another process's count in the same run, never its
    timings (cProfile slows it)."""
    stats = pstats.Stats(str(path)).stats  # type: ignore[attr-defined]
    calls = sum(v[1] for v in stats.values())
    rows = sorted(stats.items(), key=lambda kv: -kv[1][1])[:top]
    return {"requests": requests, "calls_per_request": calls / max(requests, 1),
            "top": [{"function": f"{name} ({Path(file).name}:{line})", "calls_per_request": v[1] / max(requests, 1)}
                    for (file, line, name), v in rows]}


def worker_env(bus: LocalBus, model: str, port: int, *, instance_id: int | None = None,
               **mock: Any) -> dict[str, str]:
    """A mock worker's settings, with its own identity (credentials bound to its instance id)."""
    instance_id = instance_id or secrets.randbelow(2**63) + 1
    env = {
        **bus.env(Identity(IdentityKind.WORKER, model=model, instance_id=instance_id)),
        "RUDDER_INSTANCE_ID": str(instance_id), "RUDDER_MODEL": model, "RUDDER_PORT": str(port),
        "RUDDER_LOG_LEVEL": "WARNING",
    }
    for name, value in mock.items():
        env[f"RUDDER_MOCK__{name.upper()}"] = str(value)
    return env


_KEYS: tuple[Path, Path] | None = None


def policy_key_files() -> tuple[Path, Path]:
    """(seed, verify-keys) of this run's policy signing key, made once per process under a temporary
    folder: routers always verify policy signatures, benchmarks included."""
    global _KEYS
    if _KEYS is None:
        import atexit
        import shutil
        import tempfile

        folder = Path(tempfile.mkdtemp(prefix="rudder-bench-keys-"))
        atexit.register(shutil.rmtree, folder, True)
        seed, pub, _ = ensure_keys(folder)
        _KEYS = (seed, pub)
    return _KEYS


def router_env(bus: LocalBus, model: str, port: int, *, mode: str = "kv",
               selection: dict[str, float] | None = None, kv_events: bool = True,
               router_id: str | None = None) -> dict[str, str]:
    router_id = router_id or f"bench-{secrets.token_hex(4)}"
    env = {
        **bus.env(Identity(IdentityKind.ROUTER, router_id=router_id)), "RUDDER_ROUTER_ID": router_id,
        "RUDDER_MODELS": json.dumps([model]),
        "RUDDER_PORT": str(port), "RUDDER_MODE": mode, "RUDDER_LOG_LEVEL": "WARNING",
        "RUDDER_KV_EVENTS": "true" if kv_events else "false",
        # routing_quality reads which worker answered (x-worker-instance-id).
        "RUDDER_DEBUG_HEADERS": "true",
        "RUDDER_POLICY_VERIFY_KEYS": str(policy_key_files()[1]),
    }
    if selection:
        env["RUDDER_SELECTION"] = json.dumps(selection)
    return env


@dataclass
class Fleet:
    """N mock worker processes (fixed ports) for one model."""

    bus: LocalBus
    model: str
    n: int
    mock: dict[str, Any] = field(default_factory=dict)
    log_dir: Path | None = None
    launcher: str = "cli"
    # Per-worker overrides of ``mock`` (a heterogeneous pool), by worker index; shorter = no override.
    per_worker: list[dict[str, Any]] = field(default_factory=list)
    ports: list[int] = field(default_factory=list)
    instance_ids: list[int] = field(default_factory=list)
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)

    @property
    def urls(self) -> list[str]:
        return [f"http://127.0.0.1:{p}" for p in self.ports]

    async def start(self) -> None:
        self.ports = [free_port() for _ in range(self.n)]
        self.instance_ids = [secrets.randbelow(2**63) + 1 for _ in range(self.n)]
        for i, port in enumerate(self.ports):
            log = self.log_dir / f"worker{i}.log" if self.log_dir else None
            mock = {**self.mock, **(self.per_worker[i] if i < len(self.per_worker) else {})}
            env = worker_env(self.bus, self.model, port, instance_id=self.instance_ids[i], **mock)
            self.procs.append(spawn(serve_command("worker", self.launcher), env, log=log))
        for url in self.urls:
            await wait_until(url + "/health")

    async def reset_caches(self, within: float = 30.0) -> None:
        """POST /reset_prefix_cache on every worker (retried while blocks are still in use)."""
        deadline = time.monotonic() + within
        async with httpx.AsyncClient() as client:
            for url in self.urls:
                while True:
                    r = await client.post(url + "/reset_prefix_cache", timeout=5)
                    if r.status_code == 200:
                        break
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"{url}: reset_prefix_cache answered {r.status_code}")
                    await asyncio.sleep(0.2)

    def stop(self) -> None:
        stop_all(self.procs)
        self.procs = []


class Router:
    """One ``python -m router`` process; ready when it sees ``workers`` workers of the model.
    ``env``: further RUDDER_* settings (they win over the defaults here)."""

    def __init__(self, bus: LocalBus, model: str, *, mode: str = "kv",
                 selection: dict[str, float] | None = None, kv_events: bool = True,
                 log: Path | None = None, launcher: str = "cli", src: Path | None = None,
                 env: dict[str, str] | None = None, count_calls: Path | None = None) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.model = model
        env = {**router_env(bus, model, self.port, mode=mode, selection=selection, kv_events=kv_events),
               **(env or {})}
        self.proc = spawn(serve_command("router", launcher, count_calls=count_calls), env, log=log, src=src)

    async def ready(self, workers: int) -> None:
        await wait_until(self.url + "/health")
        await wait_until(self.url + "/v1/models",
                         lambda body: body["data"][0].get("workers", 0) >= workers)

    def stop(self) -> None:
        stop_all([self.proc])


def kv_routers(bus: LocalBus, model: str, logs: Path, baseline: str, *, names: tuple[str, str]) -> dict[str, Router]:
    """This checkout's ``kv`` router and, given ``baseline`` (another checkout), that one's, under
    ``names``; each logs to ``logs``/<name>.log. Not ready yet (:meth:`Router.ready`)."""
    mine, theirs = names
    routers = {mine: Router(bus, model, mode="kv", log=logs / f"{mine.replace(' ', '_')}.log")}
    if baseline:
        routers[theirs] = Router(bus, model, mode="kv", src=Path(baseline),
                                 log=logs / f"{theirs.replace(' ', '_')}.log")
    return routers


async def metric_sums(client: httpx.AsyncClient, url: str, names: Iterable[str]) -> dict[str, float]:
    """Each named series of ``url``'s /metrics summed over its labels (a worker's ranks); 0 for one
    it does not export."""
    totals = dict.fromkeys(names, 0.0)
    for line in (await client.get(url + "/metrics")).text.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in totals:
            totals[name] += float(line.rsplit(" ", 1)[1])
    return totals


class CpuSampler:
    """Machine CPU and per-process CPU seconds between :meth:`start` and :meth:`stop`."""

    def __init__(self, pids: dict[str, list[int]]) -> None:
        self.pids = pids
        self._procs: dict[str, list[psutil.Process]] = {}
        self._t0: dict[str, float] = {}
        self._wall = 0.0

    @staticmethod
    def _cpu(p: psutil.Process) -> float:
        try:
            t = p.cpu_times()
            return t.user + t.system
        except psutil.Error:
            return 0.0

    def start(self) -> None:
        psutil.cpu_percent(None)
        self._procs = {k: [psutil.Process(pid) for pid in v] for k, v in self.pids.items()}
        self._t0 = {k: sum(self._cpu(p) for p in v) for k, v in self._procs.items()}
        self._wall = time.monotonic()

    def stop(self) -> dict[str, Any]:
        machine_pct = psutil.cpu_percent(None)  # since start(), all cores, 0..100
        wall = time.monotonic() - self._wall
        per = {k: (sum(self._cpu(p) for p in v) - self._t0[k]) / wall for k, v in self._procs.items()}
        cores = psutil.cpu_count() or 1
        # Other sessions share this machine: what they used is what ours did not.
        others = max(0.0, machine_pct / 100 * cores - sum(per.values()))
        return {"machine_busy_pct": machine_pct, "cores": cores,
                "process_cores": {k: round(v, 3) for k, v in per.items()},
                "other_processes_cores": round(others, 3), "wall_s": wall}
