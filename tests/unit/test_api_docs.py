"""docs/api.md against ``/openapi.json``: its route table is the one generated from the spec, and
every route the prose names exists. Regenerate the table with
``python -m tests.unit.test_api_docs``."""

from __future__ import annotations

import re
from pathlib import Path

from tests.unit.admin_spec import admin_app, admin_spec, operations, route_table

DOC = Path(__file__).resolve().parents[2] / "docs" / "api.md"
BEGIN = "<!-- routes: generated from /openapi.json by `python -m tests.unit.test_api_docs`; do not edit -->"
END = "<!-- end of routes -->"
NAMED = re.compile(r"`(GET|POST|PATCH|PUT|DELETE) (/[^`?\[\s]*)")


def generated_section(text: str) -> str:
    start, end = text.index(BEGIN) + len(BEGIN), text.index(END)
    return text[start:end].strip()


def test_route_table_is_generated_from_the_spec() -> None:
    assert generated_section(DOC.read_text()) == route_table(admin_spec()), (
        "docs/api.md's route table is out of date: run `python -m tests.unit.test_api_docs`")


def test_every_route_the_docs_name_exists_and_every_route_is_described() -> None:
    text = DOC.read_text()
    prose = text[:text.index(BEGIN)] + text[text.index(END):]
    named = {(method, path) for method, path in NAMED.findall(prose)}
    app = admin_app()
    routes = {(method, path) for method, path, _ in operations(app.openapi())}
    served_by_fastapi = {("GET", url) for url in (app.openapi_url, app.docs_url, app.redoc_url) if url}
    named -= served_by_fastapi
    assert named - routes == set(), "docs/api.md names routes the API does not have"
    assert routes - named == set(), "routes of the API that docs/api.md does not describe"


if __name__ == "__main__":
    text = DOC.read_text()
    DOC.write_text(text.replace(generated_section(text), route_table(admin_spec())))
    print(f"wrote the route table of {DOC}")
