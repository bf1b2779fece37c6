"""``/ui``: the read-only web console, served on the admin listener (docs/operator-guide.md, "Web
console"; why no front-end build: docs/decisions.md).

The routes serve three static files, package data under ``controlplane/ui/``, to anyone: they hold
no data. The page asks for a token, keeps it in the tab's sessionStorage and calls the JSON API
with it as a bearer header, so every figure it shows passes the same authentication and roles as
the CLI's (a viewer's token gets 403 from ``/audit``, and the page says so). The answers carry a
strict Content-Security-Policy (scripts and styles from this origin only, requests to this origin
only, no framing), so a value that slipped into the page as markup could still not run.

The console's routes are not API routes: they are left out of /openapi.json.
"""

from __future__ import annotations

from functools import cache
from importlib.resources import files

from fastapi import APIRouter
from fastapi.responses import Response

from controlplane.protocol.errors import NotFound

router = APIRouter(include_in_schema=False)

#: The files of the console and their media types.
FILES = {"index.html": "text/html; charset=utf-8", "app.js": "text/javascript; charset=utf-8",
         "app.css": "text/css; charset=utf-8"}

HEADERS = {
    "Content-Security-Policy": ("default-src 'none'; script-src 'self'; style-src 'self'; "
                                "connect-src 'self'; img-src 'self'; base-uri 'none'; form-action 'none'; "
                                "frame-ancestors 'none'"),
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "X-Frame-Options": "DENY",
    "Cache-Control": "no-cache",
}


@cache
def content(name: str) -> bytes:
    """A console file, read once from the package."""
    return files("controlplane").joinpath("ui", name).read_bytes()


def serve(name: str) -> Response:
    return Response(content(name), media_type=FILES[name], headers=HEADERS)


@router.get("/ui")
@router.get("/ui/")
async def page() -> Response:
    """The console's one page (documents, fleet, audit: the view is the URL's fragment)."""
    return serve("index.html")


@router.get("/ui/{name}")
async def asset(name: str) -> Response:
    """The console's script and style sheet."""
    if name not in FILES or name == "index.html":
        raise NotFound(f"no console file {name!r}", field="name")
    return serve(name)
