"""Rudder's tests. (Imported before any test module and before ``cli.output``.)"""

import os

# pytest-xdist (two test processes, pyproject's addopts) gives its workers COLUMNS=80 and LINES=24,
# as if they wrote to an 80-column terminal. The CLI's tables are rendered for a pipe otherwise
# (cli.output: no TTY and no COLUMNS: 200 columns), which is what the CLI tests read: drop the
# invented size so a worker renders as a serial run does.
if os.environ.get("PYTEST_XDIST_WORKER"):
    for _name in ("COLUMNS", "LINES"):
        os.environ.pop(_name, None)
