"""A small tmpfs to fill (B2: a NATS store or a PostgreSQL data folder out of disk).

Mounting needs root (CAP_SYS_ADMIN); where it is refused the test is skipped with the reason."""

from __future__ import annotations

import contextlib
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from nats.aio.client import Client as NATS

from controlplane.protocol.subjects import PROBE_PREFIX


@contextlib.contextmanager
def small_disk(path: Path, size_mb: int) -> Iterator[Path]:
    path.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs to fill needs root")
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_mb}m", "tmpfs", str(path)],
                          capture_output=True, text=True, check=False)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({done.stderr.strip() or done.returncode}): "
                    "the full-disk test needs mount rights")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], capture_output=True, check=False)


def occupy(path: Path, leave_mb: float) -> Path:
    """A filler file leaving about ``leave_mb`` free on ``path``'s filesystem (removed to free it)."""
    st = os.statvfs(path)
    free = st.f_bavail * st.f_frsize
    filler = path / "filler"
    filler.write_bytes(b"\0" * max(0, free - int(leave_mb * 1024 * 1024)))
    return filler


async def fill_stream(nc: NATS, *, prefix: str = f"{PROBE_PREFIX}.fill", chunk: int = 60_000,
                      limit: int = 2000) -> int:
    """Publish ``chunk``-byte messages until JetStream refuses or stops answering; how many
    were stored."""
    js = nc.jetstream(timeout=1.0)
    for i in range(limit):
        try:
            await js.publish(f"{prefix}.{i}", b"x" * chunk)
        except Exception:  # refused (insufficient resources) or no answer (write error)
            return i
    raise AssertionError(f"JetStream stored {limit} x {chunk} bytes: the disk is not small")
