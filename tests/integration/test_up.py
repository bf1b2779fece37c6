"""``rudder up`` as a user runs it: a subprocess in an empty directory, real servers underneath.

Checks that it prints its URLs and writes ``.rudder/credentials``, that the CLI in the same
directory works through that file, that SIGTERM stops every process it started and exits 0, and
that a second ``rudder up`` finds the same policy revision and reuses the token.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from bus.keyfiles import load_signing_key
from cli.config import read_credentials
from cli.embedded import free_port

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]

MODEL = "mock-model"


def _children_of(pid: int) -> set[int]:
    """Every descendant of ``pid`` (from /proc; the test runs on Linux)."""
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        parents[int(entry.name)] = int(fields[1])
    out: set[int] = set()
    frontier = {pid}
    while frontier:
        found = {child for child, parent in parents.items() if parent in frontier}
        frontier = found - out
        out |= found
    return out


def _alive(pid: int) -> bool:
    """Running and not a zombie (an orphan reaped late by a container's init is still gone)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


class Up:
    def __init__(self, cwd: Path, ports: dict[str, int], *, extra: list[str] | None = None,
                 env: dict[str, str] | None = None) -> None:
        self.cwd = cwd
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "COLUMNS": "200", **(env or {})}
        for name in ("RUDDER_SERVER", "RUDDER_TOKEN", "RUDDER_DATABASE_URL", "RUDDER_NATS_URL"):
            env.pop(name, None)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "cli.main", "up",
             "--admin-port", str(ports["admin"]), "--router-port", str(ports["router"]),
             "--nats-port", str(ports["nats"]), "--postgres-port", str(ports["postgres"]),
             *(extra or ["--workers", "1"])],
            cwd=cwd, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, text=True,
        )
        self.lines: queue.Queue[str] = queue.Queue()
        self.output: list[str] = []
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(line)

    def wait_for(self, text: str, timeout: float = 180) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                line = self.lines.get(timeout=0.5)
            except queue.Empty:
                if self.proc.poll() is not None:
                    break
                continue
            self.output.append(line)
            if text in line:
                return
        raise AssertionError(f"{text!r} not printed; output:\n{''.join(self.output)}")

    def stop(self, *, twice: bool = False) -> int:
        """SIGTERM, and with ``twice`` a SIGINT right after it (an impatient second Ctrl-C, both
        pending at once: the second is handled while the first unwinds)."""
        self.proc.send_signal(signal.SIGTERM)
        if twice:
            self.proc.send_signal(signal.SIGINT)
        code = self.proc.wait(90)
        while not self.lines.empty():
            self.output.append(self.lines.get())
        return code


def rudder(cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RUDDER_")}
    return subprocess.run([sys.executable, "-m", "cli.main", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=60)


def _postmaster_pid(cwd: Path) -> int:
    return int((cwd / ".rudder" / "pgdata" / "postmaster.pid").read_text().split()[0])


def _assert_database_roles(cwd: Path, creds: dict[str, str], printed: str) -> None:
    """The CLI's credentials are the app role's, never the owner's; no trust authentication."""
    from urllib.parse import urlsplit

    url = urlsplit(creds["RUDDER_DATABASE_URL"])
    assert url.username == "rudder_app"
    roles = read_credentials(cwd / ".rudder" / "db-roles")
    assert (cwd / ".rudder" / "db-roles").stat().st_mode & 0o777 == 0o600
    assert roles["OWNER_PASSWORD"] not in (cwd / ".rudder" / "credentials").read_text()
    for secret in (roles["OWNER_PASSWORD"], roles["APP_PASSWORD"]):
        assert secret not in printed
    hba = (cwd / ".rudder" / "pgdata" / "pg_hba.conf").read_text().splitlines()
    methods = {ln.split()[-1] for ln in hba if ln.strip() and not ln.lstrip().startswith("#")}
    assert methods == {"scram-sha-256"}, methods


def test_up_serves_stops_everything_and_keeps_data(tmp_path: Path) -> None:
    ports = {"admin": free_port(), "router": free_port(), "nats": free_port(),
             "postgres": free_port()}
    up = Up(tmp_path, ports)
    try:
        up.wait_for("rudder up: ready")
    except BaseException:
        up.stop()
        raise
    text = "".join(up.output)
    assert f"http://127.0.0.1:{ports['admin']}" in text
    assert f"nats://127.0.0.1:{ports['nats']}" in text
    creds_path = tmp_path / ".rudder" / "credentials"
    assert creds_path.stat().st_mode & 0o777 == 0o600
    creds = read_credentials(creds_path)
    assert creds["RUDDER_SERVER"] == f"http://127.0.0.1:{ports['admin']}"
    assert creds["RUDDER_TOKEN"] in text
    seed = tmp_path / ".rudder" / "keys" / "policy.seed"
    assert seed.stat().st_mode & 0o777 == 0o600
    key_id = load_signing_key(seed).key_id
    assert seed.read_text().splitlines()[-1] not in text  # the seed is never printed
    _assert_database_roles(tmp_path, creds, text)

    started = _children_of(up.proc.pid) | {_postmaster_pid(tmp_path)}
    # Issue 17: routers and workers never receive database settings (its password).
    fleet = 0
    for pid in started:
        with contextlib.suppress(OSError):
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            if b"serve" in argv and (b"router" in argv or b"worker" in argv):
                environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
                assert not [e for e in environ if e.startswith(b"RUDDER_DATABASE")], argv
                fleet += 1
    assert fleet >= 2, "no router or worker found among the children"
    try:
        # The CLI in the same directory finds server and token in .rudder/credentials.
        result = rudder(tmp_path, "--json", "policy", "set", MODEL, "overlap_score_credit=0.5",
                        "--revision", "0")
        assert result.returncode == 0, result.stderr
        revision = json.loads(result.stdout)["revision"]
        assert revision > 0
        conflict = rudder(tmp_path, "policy", "set", MODEL, "overlap_score_credit=0.6",
                          "--revision", "0")
        assert conflict.returncode == 3, conflict.stderr
        # Signed by the key `rudder up` made, verified and applied by its router.
        deadline = time.monotonic() + 20
        routers: list[dict[str, object]] = []
        while time.monotonic() < deadline:
            got = rudder(tmp_path, "--json", "policy", "get", MODEL, "--kind", "selection")
            routers = json.loads(got.stdout)["routers"]
            if routers and all(r["applied_revision"] == revision for r in routers):
                break
            time.sleep(0.2)
        assert routers and all(r["applied_revision"] == revision and not r["last_nack"] for r in routers), routers
        # Issue 17: what each mock worker may claim was issued (signed, audited) before it started.
        manifests = json.loads(rudder(tmp_path, "--json", "workers", "manifests").stdout)
        workers = json.loads(rudder(tmp_path, "--json", "workers", "list").stdout)
        assert len(manifests) == len(workers) >= 1 and all(m["verified"] for m in manifests), manifests
        assert {m["instance_id"] for m in manifests} == {w["instance_id"] for w in workers}
        assert all(m["spec"]["url_allow"] == w["url"].removeprefix("http://")
                   for m in manifests for w in workers if w["instance_id"] == m["instance_id"])
    finally:
        code = up.stop()
    assert code == 0, "".join(up.output)
    assert started, "rudder up started no child processes"
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(_alive(p) for p in started):
        time.sleep(0.1)
    assert not [p for p in started if _alive(p)], "".join(up.output)
    assert not (tmp_path / ".rudder" / "up.pid").exists()

    # A second start reuses the data: same revision, same token.
    again = Up(tmp_path, ports)
    try:
        again.wait_for("rudder up: ready")
        got = rudder(tmp_path, "--json", "policy", "get", MODEL, "--kind", "selection")
        assert got.returncode == 0, got.stderr
        body = json.loads(got.stdout)
        assert body["revision"] == revision
        assert body["document"] == {"overlap_score_credit": 0.5}
        assert read_credentials(creds_path)["RUDDER_TOKEN"] == creds["RUDDER_TOKEN"]
        assert load_signing_key(seed).key_id == key_id  # the same key, reused
        listed = rudder(tmp_path, "--json", "keys", "list")
        assert listed.returncode == 0, listed.stderr
        assert [(k["key_id"], k["signing"]) for k in json.loads(listed.stdout)] == [(key_id, True)]
        audit = rudder(tmp_path, "--json", "audit", "log", "--model", MODEL)
        assert audit.returncode == 0, audit.stderr
        assert {row["actor"] for row in json.loads(audit.stdout)} == {"rudder-up-admin"}
    finally:
        # A second signal while it stops neither interrupts the cleanup nor ends in a traceback.
        assert again.stop(twice=True) == 0, "".join(again.output)
    assert "Traceback" not in "".join(again.output), "".join(again.output)


def _chat(router_url: str, text: str) -> int:
    import httpx

    r = httpx.post(f"{router_url}/v1/chat/completions", timeout=20, json={
        "model": MODEL, "messages": [{"role": "user", "content": text}], "max_tokens": 2})
    return r.status_code


def test_up_supervises_a_killed_worker_and_writes_credentials_only_when_the_fleet_serves(tmp_path: Path) -> None:
    import httpx

    ports = {"admin": free_port(), "router": free_port(), "nats": free_port(), "postgres": free_port()}
    up = Up(tmp_path, ports, extra=["--workers", "2"])
    creds_path = tmp_path / ".rudder" / "credentials"
    try:
        # A script that waits for the credentials file finds every worker joined on the router.
        deadline = time.monotonic() + 180
        while not creds_path.exists():
            assert up.proc.poll() is None and time.monotonic() < deadline, "".join(up.output)
            time.sleep(0.05)
        router_url = f"http://127.0.0.1:{ports['router']}"
        models = httpx.get(f"{router_url}/v1/models", timeout=5).json()["data"]
        assert [m["workers"] for m in models if m["id"] == MODEL] == [2]
        up.wait_for("rudder up: ready")

        status = rudder(tmp_path, "--json", "status")
        assert status.returncode == 0, status.stderr
        workers = [p for p in json.loads(status.stdout)["processes"] if p["kind"] == "worker"]
        assert [w["restarts"] for w in workers] == [0, 0]
        victim = workers[0]
        os.kill(victim["pid"], signal.SIGKILL)
        # Chats keep succeeding on the other worker while the victim is restarted.
        for i in range(10):
            assert _chat(router_url, f"during {i}") == 200
        up.wait_for(f"{victim['name']:<13} restarted", timeout=60)
        deadline = time.monotonic() + 60
        while True:
            now = json.loads(rudder(tmp_path, "--json", "status").stdout)
            mine = next(p for p in now["processes"] if p["name"] == victim["name"])
            models = httpx.get(f"{router_url}/v1/models", timeout=5).json()["data"]
            if mine["state"] == "running" and [m["workers"] for m in models if m["id"] == MODEL] == [2]:
                break
            assert time.monotonic() < deadline, (now, models)
            time.sleep(0.2)
        assert mine["restarts"] == 1 and mine["pid"] != victim["pid"] and mine["last_exit"] == -9
        human = rudder(tmp_path, "status")
        assert human.returncode == 0 and victim["name"] in human.stdout
        assert _chat(router_url, "after the restart") == 200
    finally:
        assert up.stop() == 0, "".join(up.output)
    assert rudder(tmp_path, "status").returncode == 6
