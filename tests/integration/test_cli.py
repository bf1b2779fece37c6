"""The ``rudder`` CLI against a real control plane on real NATS JetStream and PostgreSQL.

The control plane runs in a thread with its own event loop (uvicorn on a free port); the CLI runs
through typer's ``CliRunner`` in the test's thread, exactly as a user's shell would call it,
including ``rudder db upgrade`` and ``rudder token create`` against the database.
"""

from __future__ import annotations

import asyncio
import json
import threading
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml
from pydantic import SecretStr
from typer.testing import CliRunner, Result

from cli.errors import ExitCode
from cli.main import app
from controlplane.settings import ControlPlaneSettings
from tests import buskit
from tests.cli_runner import invoke
from tests.integration.cp_support import AUDIT_KEY
from tests.policy_keys import session_keys

pytestmark = pytest.mark.timeout(120)


class ThreadedControlPlane:
    """``controlplane.server.serving`` in a background thread, for synchronous CLI tests."""

    def __init__(self, settings: ControlPlaneSettings) -> None:
        self.settings = settings
        self.url = ""
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._thread = threading.Thread(target=self._main, name="controlplane", daemon=True)

    def _main(self) -> None:
        try:
            asyncio.run(self._serve())
        except BaseException as exc:  # reported to the starting thread
            self._error = exc
            self._ready.set()

    async def _serve(self) -> None:
        from controlplane.server import serving

        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        async with serving(self.settings) as running:
            self.url = running.url
            self._ready.set()
            await self._stop.wait()

    def start(self) -> None:
        self._thread.start()
        if not self._ready.wait(60) or self._error is not None:
            raise RuntimeError(f"control plane did not start: {self._error!r}")

    def stop(self) -> None:
        if self._loop is not None and self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(30)


@dataclass
class Env:
    server: str
    database_url: str
    tokens: dict[str, str]

    def run(self, *args: str, role: str | None = "admin", json_out: bool = True) -> Result:
        argv = ["--server", self.server]
        if role is not None:
            argv += ["--token", self.tokens[role]]
        if json_out:
            argv.append("--json")
        return invoke(app, [*argv, *args])

    def ok(self, *args: str, role: str = "admin") -> Any:
        result = self.run(*args, role=role)
        assert result.exit_code == 0, (result.stdout, result.stderr)
        return json.loads(result.stdout)


@pytest.fixture(scope="module")
def env(nats_url: str, database_url: str, database_owner_url: str) -> Iterator[Env]:
    runner = CliRunner()
    upgraded = runner.invoke(app, ["db", "upgrade", "--database-url", database_owner_url])
    assert upgraded.exit_code == 0, upgraded.output
    tokens: dict[str, str] = {}
    for role in ("admin", "operator", "viewer", "auditor"):
        made = runner.invoke(app, ["--json", "token", "create", "--role", role, "--name",
                                   f"cli-{role}", "--database-url", database_url])
        assert made.exit_code == 0, made.output
        body = json.loads(made.stdout)
        assert body["role"] == role and body["name"] == f"cli-{role}"
        tokens[role] = body["token"]
    settings = ControlPlaneSettings(
        nats_url=nats_url, database_url=SecretStr(database_url), admin_port=0,
        reconcile_interval_s=3600.0, nats_creds=buskit.controlplane_creds(),
        policy_signing_key=session_keys().seed_path, policy_verify_keys=session_keys().verify_path,
        audit_signing_key=AUDIT_KEY,
    )
    cp = ThreadedControlPlane(settings)
    cp.start()
    try:
        yield Env(server=cp.url, database_url=database_url, tokens=tokens)
    finally:
        cp.stop()


def model_name() -> str:
    return f"org/cli-{uuid.uuid4().hex[:8]}:v1.0"


def test_set_conflict_history_diff_rollback(env: Env) -> None:
    model = model_name()
    first = env.ok("policy", "set", model, "overlap_score_credit=0.5",
                   "router_temperature=0.1", "--revision", "0", role="operator")
    assert first["document"] == {"overlap_score_credit": 0.5, "router_temperature": 0.1}
    r1 = first["revision"]
    assert r1 > 0 and first["previous_revision"] == 0

    # A stale revision: exit 3, the server's facts on stderr, nothing on stdout.
    stale = env.run("policy", "set", model, "overlap_score_credit=0.9", "--revision", "0",
                    role="operator")
    assert stale.exit_code == ExitCode.CONFLICT
    assert stale.stdout == ""
    err = json.loads(stale.stderr)["error"]
    assert err["code"] == "revision_conflict" and err["head_revision"] == r1

    # Human output of a conflict names both revisions on stderr.
    human = env.run("policy", "set", model, "overlap_score_credit=0.9", "--revision", "0",
                    role="operator", json_out=False)
    assert human.exit_code == 3 and f"head is {r1}" in " ".join(human.stderr.split())

    second = env.ok("policy", "set", model, "overlap_score_credit=0.7", "--latest",
                    role="operator")
    r2 = second["revision"]
    assert r2 > r1 and second["diff"] == {"overlap_score_credit": {"before": 0.5, "after": 0.7}}

    dry = env.ok("policy", "set", model, "prefill_load_scale=2", "--latest", "--dry-run",
                 role="operator")
    assert dry["dry_run"] is True and dry["document"]["prefill_load_scale"] == 2
    assert env.ok("policy", "get", model, "--kind", "selection")["revision"] == r2

    third = env.ok("policy", "unset", model, "router_temperature", "--revision", str(r2),
                   role="operator")
    r3 = third["revision"]
    assert third["document"] == {"overlap_score_credit": 0.7}

    history = env.ok("policy", "history", model)
    assert [h["revision"] for h in history] == [r3, r2, r1]
    assert {h["actor"] for h in history} == {"cli-operator"}

    diff = env.ok("policy", "diff", model, "--from", str(r1), "--to", str(r3))
    assert diff["changes"] == {
        "overlap_score_credit": {"before": 0.5, "after": 0.7},
        "router_temperature": {"before": 0.1, "after": None},
    }
    head_vs_r1 = env.ok("policy", "diff", model, "--from", str(r1))
    assert head_vs_r1["to_revision"] == r3 and head_vs_r1["changes"] == diff["changes"]
    missing = env.run("policy", "diff", model, "--from", "999999")
    assert missing.exit_code == ExitCode.NOT_FOUND

    stale_rollback = env.run("policy", "rollback", model, "--to", str(r1), "--revision",
                             str(r2), role="operator")
    assert stale_rollback.exit_code == ExitCode.CONFLICT
    rolled = env.ok("policy", "rollback", model, "--to", str(r1), "--latest", role="operator")
    assert rolled["op"] == "rollback" and rolled["revision"] > r3
    assert rolled["document"] == first["document"]

    reset = env.ok("policy", "reset", model, "--latest", role="operator")
    assert reset["document"] == {}

    listed = env.ok("policy", "list", "--model", model)
    assert ("selection", reset["revision"]) in [(d["kind"], d["revision"]) for d in listed]

    human_history = env.run("policy", "history", model, json_out=False)
    assert human_history.exit_code == 0 and "cli-operator" in human_history.stdout


def test_audit_log_shows_the_actor_and_rejections(env: Env) -> None:
    model = model_name()
    env.ok("policy", "set", model, "prefill_load_scale=1.5", "--revision", "0", role="operator")
    assert env.run("policy", "set", model, "prefill_load_scale=3", "--revision", "0",
                   role="operator").exit_code == ExitCode.CONFLICT

    rows = env.ok("audit", "log", "--model", model, "--all", role="auditor")
    decisions = [(r["actor"], r["decision"], r["reason_code"]) for r in rows
                 if r["stage"] == "decision"]
    assert ("cli-operator", "accepted", None) in decisions
    assert ("cli-operator", "rejected", "revision_conflict") in decisions

    accepted = env.ok("audit", "log", "--model", model, "--actor", "cli-operator",
                      "--decision", "accepted", "--since", "1h", role="auditor")
    assert accepted and all(r["decision"] == "accepted" for r in accepted)
    assert env.ok("audit", "log", "--model", model, "--until", "2000-01-01",
                  role="auditor") == []
    assert len(env.ok("audit", "log", "--model", model, "--limit", "1", role="auditor")) == 1

    row = env.ok("audit", "show", str(rows[0]["id"]), role="auditor")
    assert row["id"] == rows[0]["id"] and row["model"] == model
    assert env.run("audit", "show", "987654321", role="auditor").exit_code == ExitCode.NOT_FOUND

    human = env.run("audit", "log", "--model", model, role="auditor", json_out=False)
    assert human.exit_code == 0 and "cli-operator" in human.stdout

    verify = env.ok("audit", "verify", role="auditor")
    assert verify["ok"] is True and verify["checked"] >= len(rows)
    assert env.ok("audit", "reconcile", role="auditor")["ok"] is True

    # A viewer may not read the audit log.
    assert env.run("audit", "log", role="viewer").exit_code == ExitCode.AUTH


def test_auth_and_validation_exit_codes(env: Env) -> None:
    model = model_name()
    assert env.run("policy", "set", model, "prefill_load_scale=2", "--revision", "0",
                   role="viewer").exit_code == ExitCode.AUTH
    no_token = env.run("policy", "list", role=None, json_out=False)
    assert no_token.exit_code == ExitCode.AUTH and "no token" in no_token.stderr
    unknown = env.run("policy", "set", model, "no_such_parameter=1", "--revision", "0",
                      role="operator")
    assert unknown.exit_code == ExitCode.USAGE
    assert "no_such_parameter" in json.loads(unknown.stderr)["error"]["field"]
    out_of_range = env.run("policy", "set", model, "host_cache_hit_weight=2", "--revision",
                           "0", role="operator")
    assert out_of_range.exit_code == ExitCode.USAGE


def test_thresholds(env: Env) -> None:
    model = model_name()
    unknown = env.run("threshold", "set", model, "active_decode_blocks_threshold=0.8",
                      role="operator")
    assert unknown.exit_code == ExitCode.NOT_FOUND
    created = env.ok("threshold", "set", model, "active_decode_blocks_threshold=0.8",
                     "--create", role="operator")
    assert created["thresholds"] == {"active_decode_blocks_threshold": 0.8}
    env.ok("threshold", "set", model, "active_prefill_tokens_threshold=8192", role="operator")
    got = env.ok("threshold", "get", model)
    assert got["thresholds"] == {"active_decode_blocks_threshold": 0.8,
                                 "active_prefill_tokens_threshold": 8192}
    stale = env.run("threshold", "set", model, "active_decode_blocks_threshold=0.5",
                    "--revision", str(created["revision"]), role="operator")
    assert stale.exit_code == ExitCode.CONFLICT
    unset = env.ok("threshold", "unset", model, "active_decode_blocks_threshold",
                   role="operator")
    assert unset["thresholds"] == {"active_prefill_tokens_threshold": 8192}
    # The same document through the policy commands.
    doc = env.ok("policy", "get", model, "--kind", "busy_threshold")
    assert doc["revision"] == unset["revision"]


def test_fleet_listings_are_empty_json_without_routers_or_workers(env: Env) -> None:
    assert env.ok("workers", "list") == []
    routers = env.ok("routers", "list")
    assert routers["routers"] == [] and isinstance(routers["summary"], list)
    human = env.run("routers", "list", json_out=False)
    assert human.exit_code == 0 and "no live routers" in human.stdout
    assert env.ok("policy", "get", model_name(), "--kind", "selection")["revision"] == 0


def test_json_is_accepted_after_the_command(env: Env) -> None:
    model = model_name()
    for args in (["workers", "list"], ["policy", "get", model, "--kind", "selection"]):
        before = env.run(*args)
        after = env.run(*args, "--json", json_out=False)
        assert before.exit_code == after.exit_code == 0, (after.stdout, after.stderr)
        assert json.loads(after.stdout) == json.loads(before.stdout)
    assert json.loads(env.run("workers", "list", "--json", json_out=False).stdout) == []


def test_token_create_with_ttl_list_and_revoke(env: Env) -> None:
    """Issue 17 item 6: tokens expire (``--ttl``), are listed and revoked (and stay revoked)."""
    made = CliRunner().invoke(app, ["--json", "token", "create", "--role", "viewer", "--name", "cli-ttl",
                                    "--ttl", "2h", "--database-url", env.database_url])
    assert made.exit_code == 0, made.output
    listed = env.ok("token", "list")
    mine = next(t for t in listed if t["name"] == "cli-ttl")
    assert mine["expires_at"] is not None and not mine["revoked"] and not mine["expired"]
    assert "token" not in mine and "token_hash" not in mine
    assert env.ok("token", "revoke", str(mine["id"])) == {"id": mine["id"], "revoked": True}
    again = env.run("token", "revoke", str(mine["id"]))
    assert again.exit_code != 0  # 404: revoked already
    assert next(t for t in env.ok("token", "list") if t["id"] == mine["id"])["revoked"] is True
    assert env.run("token", "list", role="viewer").exit_code != 0  # admin only
    bad = CliRunner().invoke(app, ["token", "create", "--role", "viewer", "--ttl", "soon",
                                   "--database-url", env.database_url])
    assert bad.exit_code == 2 and "--ttl" in bad.output


def test_policy_apply_a_folder_of_three_models(env: Env, tmp_path: Path) -> None:
    """Policy as code: the plan, the apply, a second apply that changes nothing, a refused apply
    after a concurrent CLI change (exit 3, nothing written), drift, and export round-trips."""
    a, b, c = model_name(), model_name(), model_name()
    env.ok("policy", "set", c, "router_temperature=0.3", "prefill_load_scale=2", "--revision", "0",
           role="operator")
    folder = tmp_path / "policy"
    folder.mkdir()
    (folder / "a.yaml").write_text(yaml.safe_dump({"apiVersion": "rudder/v1", "kind": "PolicySet", "models": {
        a: {"selection": {"overlap_score_credit": 0.5},
            "busy_threshold": {"active_decode_blocks_threshold": 0.8}}}}))
    (folder / "b.yaml").write_text(yaml.safe_dump({"apiVersion": "rudder/v1", "kind": "PolicySet", "models": {
        b: {"selection": {"router_temperature": 0.1}}}}))
    (folder / "c.json").write_text(json.dumps({"apiVersion": "rudder/v1", "kind": "PolicySet", "models": {
        c: {"selection": {"router_temperature": 0.3}}}}))
    (folder / "README.txt").write_text("not a policy file")

    # The plan: two creates for a, one for b, an update of c that removes prefill_load_scale.
    dry = env.ok("policy", "apply", "-f", str(folder), "--dry-run", "--revision-file",
                 str(tmp_path / "revs.yaml"), role="operator")
    actions = {(s["model"], s["kind"]): s["action"] for s in dry["plan"]}
    assert actions == {(a, "selection"): "create", (a, "busy_threshold"): "create",
                       (b, "selection"): "create", (c, "selection"): "update"}
    update = next(s for s in dry["plan"] if s["model"] == c)
    assert update["diff"] == {"prefill_load_scale": {"before": 2, "after": None}}
    assert dry["applied"] == [] and env.ok("policy", "get", a, "--kind", "selection")["revision"] == 0
    human_plan = env.run("policy", "apply", "-f", str(folder), "--dry-run", role="operator", json_out=False)
    assert human_plan.exit_code == 0 and "3 to create, 1 to update" in human_plan.stdout
    assert "prefill_load_scale" in human_plan.stdout and "nothing applied" in human_plan.stdout

    # Drift is reported for CI (exit 1), then the apply (against the dry run's revisions).
    assert env.run("policy", "diff", "-f", str(folder)).exit_code == ExitCode.ERROR
    applied = env.ok("policy", "apply", "-f", str(folder), "--revision-file", str(tmp_path / "revs.yaml"),
                     role="operator")
    assert len(applied["applied"]) == 4
    assert env.ok("policy", "get", a, "--kind", "busy_threshold")["document"] == {
        "active_decode_blocks_threshold": 0.8}
    assert env.ok("policy", "get", c, "--kind", "selection")["document"] == {"router_temperature": 0.3}
    assert env.ok("policy", "diff", "-f", str(folder))["drifted"] is False

    # A second apply changes nothing.
    again = env.run("policy", "apply", "-f", str(folder), role="operator", json_out=False)
    assert again.exit_code == 0 and "nothing to apply" in again.stdout and "4 unchanged" in again.stdout

    # A plan is shown (its revisions kept), another CLI user changes b, the apply is refused whole.
    env.ok("policy", "apply", "-f", str(folder), "--dry-run", "--revision-file", str(tmp_path / "revs.yaml"))
    moved = env.ok("policy", "set", b, "router_temperature=0.9", "--latest", role="operator")
    refused = env.run("policy", "apply", "-f", str(folder), "--revision-file", str(tmp_path / "revs.yaml"),
                      role="operator")
    assert refused.exit_code == ExitCode.CONFLICT, (refused.stdout, refused.stderr)
    err = json.loads(refused.stderr)["error"]
    assert err["code"] == "revision_conflict"
    assert [(m["model"], m["head_revision"]) for m in err["moved"]] == [(b, moved["revision"])]
    assert env.ok("policy", "get", b, "--kind", "selection")["revision"] == moved["revision"]
    # A revision file of another version of the file is refused (exit 2): the plan would differ.
    env.ok("policy", "apply", "-f", str(folder), "--dry-run", "--revision-file", str(tmp_path / "revs.yaml"))
    (folder / "a.yaml").write_text((folder / "a.yaml").read_text().replace("0.5", "0.6"))
    edited = env.run("policy", "apply", "-f", str(folder), "--revision-file", str(tmp_path / "revs.yaml"),
                     role="operator")
    assert edited.exit_code == ExitCode.USAGE and "changed since the dry run" in edited.stderr
    assert env.ok("policy", "get", a, "--kind", "selection")["document"] == {"overlap_score_credit": 0.5}

    # Export writes the same format; applying it changes nothing.
    exported = tmp_path / "export.yaml"
    env.ok("policy", "export", "-o", str(exported))
    assert yaml.safe_load(exported.read_text())["models"][b] == {"selection": {"router_temperature": 0.9}}
    assert env.ok("policy", "apply", "-f", str(exported), role="operator")["applied"] == []
    bad = env.run("policy", "apply", "-f", str(folder / "README.txt"), role="operator")
    assert bad.exit_code == ExitCode.USAGE


def test_workers_issue_and_manifests(env: Env) -> None:
    """Issue 17 item 1: ``rudder workers issue`` (admin) and ``rudder workers manifests``."""
    wid = str(uuid.uuid4().int >> 65)
    timing = '{"prefill_ms": [16.5, 0.015, 4e-7], "decode_ms": [5.7, 54, -25]}'
    issued = env.ok("workers", "issue", wid, "--model", "cli/m", "--url-allow", "127.0.0.1:9", "--dp-size", "2",
                    "--block-size", "16",
                    "--kv-blocks", "512", "--timing", timing)
    assert issued["instance_id"] == int(wid) and issued["manifest"]["spec"]["max_dp_size"] == 2
    listed = {str(m["instance_id"]): m for m in env.ok("workers", "manifests", role="viewer")}
    assert listed[wid]["verified"] is True and listed[wid]["spec"]["max_kv_blocks"] == 512
    human = env.run("workers", "manifests", json_out=False)
    assert human.exit_code == 0 and wid in human.stdout and "cli/m" in human.stdout
    assert env.run("workers", "issue", wid, "--model", "m", "--url-allow", "127.0.0.1", "--block-size", "16",
                   role="operator").exit_code == 4
    bad = env.run("workers", "issue", wid, "--model", "m", "--url-allow", "127.0.0.1", "--block-size", "16",
                  "--dp-size", "0")
    assert bad.exit_code == 2 and "max_dp_size" in bad.stderr
    assert env.run("workers", "issue", wid, "--model", "m", "--url-allow", "x", "--block-size", "16",
                   "--timing", "{").exit_code == 2
