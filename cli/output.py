"""Output: rich tables on stdout, errors on stderr, ``--json`` prints only JSON.

JSON output is the API's data with snake_case keys as the API sends them; times stay ISO-8601 UTC
strings; an empty listing is ``[]``. Human output formats times as ``YYYY-MM-DD HH:MM:SS``
(still UTC, marked ``Z``).
"""

from __future__ import annotations

import json
import os
import sys
import unicodedata
from collections.abc import Iterable, Mapping, Sequence
from datetime import UTC, datetime
from typing import Any

from rich.console import Console
from rich.table import Table

from cli.errors import CliError

# Piped output (scripts, CI logs) gets wide tables instead of rich's 80-column default.
_WIDTH = None if sys.stdout.isatty() or os.environ.get("COLUMNS") else 200
console = Console(highlight=False, soft_wrap=False, width=_WIDTH)
err_console = Console(stderr=True, highlight=False)


def _default(value: Any) -> Any:
    if isinstance(value, datetime):
        if value.tzinfo is None:
            value = value.replace(tzinfo=UTC)
        return value.astimezone(UTC).isoformat().replace("+00:00", "Z")
    raise TypeError(f"not JSON serializable: {type(value).__name__}")


def to_json(data: Any) -> str:
    return json.dumps(data, indent=2, sort_keys=False, default=_default, ensure_ascii=False)


def print_json(data: Any) -> None:
    sys.stdout.write(to_json(data) + "\n")
    sys.stdout.flush()


def report_error(error: CliError, *, json_mode: bool) -> None:
    """Print a CLI error on stderr: one line, or a JSON object in ``--json`` mode."""
    if json_mode:
        body = {"exit_code": int(error.exit_code), "message": error.message, **error.body}
        sys.stderr.write(to_json({"error": body}) + "\n")
        sys.stderr.flush()
        return
    err_console.print(f"[bold red]error:[/] {escape(error.message)}", soft_wrap=True)


def strip_controls(text: str) -> str:
    """``text`` without control and format characters (C0/C1 controls such as ESC, which start
    terminal escape sequences - OSC 52 writes the clipboard - and bidi overrides). Every string
    the CLI prints comes through here: much of it is what some worker or router said on the bus."""
    if text.isprintable():
        return text
    return "".join(ch for ch in text if ch in "\n\t" or unicodedata.category(ch) not in ("Cc", "Cf"))


def escape(text: str) -> str:
    """Safe to print: controls stripped, rich markup escaped."""
    from rich.markup import escape as rich_escape

    return rich_escape(strip_controls(text))


def fmt_time(value: Any) -> str:
    if value in (None, ""):
        return "-"
    text = str(value)
    try:
        parsed = datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        return text
    if parsed.tzinfo is not None:
        parsed = parsed.astimezone(UTC)
    return parsed.strftime("%Y-%m-%d %H:%M:%SZ")


def fmt_value(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return f"{value:g}"
    if isinstance(value, Mapping):
        if not value:
            return "{}"
        return ", ".join(f"{k}={fmt_value(v)}" for k, v in value.items())
    if isinstance(value, list | tuple):
        return ", ".join(fmt_value(v) for v in value) if value else "-"
    return str(value)


def table(
    columns: Sequence[str], rows: Iterable[Sequence[Any]], *, title: str | None = None
) -> Table:
    t = Table(title=title, title_justify="left", header_style="bold", show_lines=False)
    for col in columns:
        t.add_column(col, overflow="fold")
    for row in rows:
        t.add_row(*(escape(c if isinstance(c, str) else fmt_value(c)) for c in row))
    return t


def show(renderable: Any) -> None:
    console.print(renderable)


def say(text: str) -> None:
    console.print(strip_controls(text), soft_wrap=True)


def note(text: str) -> None:
    """A remark for humans on stderr (progress, hints): never mixes into JSON on stdout."""
    err_console.print(strip_controls(text), soft_wrap=True)
