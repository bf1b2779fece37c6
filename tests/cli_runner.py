"""The rudder CLI run in-process by a test, hermetic: what the test passes, nothing else."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
from click.testing import Result
from typer.testing import CliRunner

from cli import config


def invoke(app: Any, args: list[str]) -> Result:
    """Run ``app`` with ``args``, without ``RUDDER_TOKEN`` / ``RUDDER_SERVER`` from the environment
    and without the ``.rudder/credentials`` of the directory the tests run from: a developer who
    ran the README's quick start (``rudder up``) in this checkout has one, holding a token of that
    stack, which a test of "no token" or of a flag must not pick up."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(config, "CREDENTIALS_FILE", Path(os.devnull) / "credentials")  # never a file
        return CliRunner().invoke(app, args, env={"RUDDER_TOKEN": None, "RUDDER_SERVER": None})
