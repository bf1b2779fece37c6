"""B5: ``rudder up``'s restart backoff doubles for a child that keeps dying before it is healthy,
and starts over once a run was healthy for a while (a control plane killed five times at full
speed must not wait 8-10 s on the fifth restart)."""

from __future__ import annotations

import time
from pathlib import Path

from cli.stack import Child, Stack


def _dead_child(tmp_path: Path) -> Child:
    """A child whose process has already exited (``rudder --help``)."""
    child = Child(name="controlplane", kind="controlplane", url="http://127.0.0.1:9",
                  health_url="http://127.0.0.1:9/readyz", args=["--help"], env={},
                  log_path=tmp_path / "cp.log")
    child.start()
    assert child.proc is not None
    child.proc.wait(30)
    return child


def _delay_after_exit(stack: Stack, child: Child) -> float:
    before = time.monotonic()
    stack.supervise()
    assert child.state == "restarting" and child.restart_at is not None
    return child.restart_at - before


def test_backoff_resets_after_a_healthy_run(tmp_path: Path) -> None:
    stack = Stack(data_dir=tmp_path, progress=lambda line: None)
    child = _dead_child(tmp_path)
    stack.children.append(child)
    # Killed four times at full speed, each time soon after it became healthy.
    child.state, child.restarts, child.streak = "running", 4, 4
    child.healthy_at = time.monotonic() - 6.0  # but this last run was healthy for 6 s
    child.started_at = time.monotonic() - 7.0
    assert _delay_after_exit(stack, child) <= 0.6


def test_backoff_doubles_while_it_never_becomes_healthy(tmp_path: Path) -> None:
    stack = Stack(data_dir=tmp_path, progress=lambda line: None)
    child = _dead_child(tmp_path)
    stack.children.append(child)
    child.state, child.restarts, child.streak, child.healthy_at = "starting", 3, 3, None
    assert 3.9 <= _delay_after_exit(stack, child) <= 4.1
