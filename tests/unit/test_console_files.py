"""The web console's static files (controlplane/ui/): shipped as package data, and written so that
the page's Content-Security-Policy holds and no API value can become markup."""

from __future__ import annotations

import re
import tomllib
from fnmatch import fnmatch
from pathlib import Path

from controlplane.api.ui import FILES, HEADERS, content

ROOT = Path(__file__).resolve().parents[2]


def test_every_console_file_is_package_data() -> None:
    patterns = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    shipped = patterns["controlplane"]
    for name in FILES:
        assert content(name), name
        assert any(fnmatch(f"ui/{name}", p) for p in shipped), f"controlplane/ui/{name} is not package data"
    on_disk = {p.name for p in (ROOT / "controlplane" / "ui").iterdir() if p.is_file()}
    assert on_disk == set(FILES), "every file of controlplane/ui/ is served, and only those"


def test_the_page_needs_no_inline_script_or_style() -> None:
    html = content("index.html").decode()
    assert "script-src 'self'" in HEADERS["Content-Security-Policy"]
    assert re.findall(r"<script\b[^>]*>", html) == ['<script src="/ui/app.js" defer>']
    assert not re.search(r"<style\b|\sstyle=|\son[a-z]+=", html), "inline style or handler: the CSP blocks it"


def test_the_script_never_writes_markup_nor_puts_the_token_in_a_url() -> None:
    js = content("app.js").decode()
    for sink in ("innerHTML", "outerHTML", "insertAdjacentHTML", "document.write", "eval(", "new Function"):
        assert sink not in js, f"app.js uses {sink}: API values must reach the page as text"
    assert js.count("sessionStorage.getItem(KEY)") >= 1
    assert re.findall(r"authorization: \"Bearer \" \+ sessionStorage\.getItem\(KEY\)", js)
    assert "localStorage" not in js and "document.cookie" not in js
