"""``/openapi.json`` describes the whole admin API: every write's body, every answer, every error
(in the one error body), who may call each route; and routing errors use the error tree."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from controlplane.auth import Action
from tests.unit.admin_spec import admin_app, admin_spec, operations

ERROR_BODY = "#/components/schemas/ErrorBody"
UNAUTHENTICATED = {"/healthz", "/readyz", "/metrics"}
#: Error statuses whose answer is not the error body, by design.
OWN_ERROR_SHAPE = {("GET", "/readyz", "503"): "#/components/schemas/Readiness"}


@pytest.fixture(scope="module")
def spec() -> dict[str, Any]:
    return admin_spec()


def refs(node: Any) -> Iterator[str]:
    if isinstance(node, dict):
        for key, value in node.items():
            if key == "$ref":
                yield value
            else:
                yield from refs(value)
    elif isinstance(node, list):
        for item in node:
            yield from refs(item)


def schema_of(answer: dict[str, Any]) -> dict[str, Any]:
    content: dict[str, Any] = answer.get("content", {})
    assert "application/json" in content, answer
    schema: dict[str, Any] = content["application/json"]["schema"]
    return schema


def test_every_write_declares_its_body(spec: dict[str, Any]) -> None:
    writes = [(m, p, op) for m, p, op in operations(spec) if m in ("POST", "PATCH", "PUT")]
    assert len(writes) >= 6
    schemas = spec["components"]["schemas"]
    for method, path, op in writes:
        assert "requestBody" in op, f"{method} {path} declares no request body"
        ref = schema_of(op["requestBody"])["$ref"]
        body = schemas[ref.rsplit("/", 1)[-1]]
        assert body["type"] == "object", (method, path)
        if op.get("x-rudder-action") == Action.WRITE_POLICY.value:
            assert op["requestBody"]["required"] is True, (method, path)
            assert body["additionalProperties"] is False, f"{method} {path}: unknown fields must be refused"
            assert body["required"], (method, path)


def test_every_route_declares_its_answer_and_its_errors(spec: dict[str, Any]) -> None:
    for method, path, op in operations(spec):
        answers = op["responses"]
        assert "200" in answers, (method, path)
        errors = {status: answer for status, answer in answers.items() if status >= "400"}
        assert "500" in errors, f"{method} {path} declares no error answer"
        for status, answer in errors.items():
            expected = OWN_ERROR_SHAPE.get((method, path, status), ERROR_BODY)
            assert schema_of(answer) == {"$ref": expected}, (method, path, status)
        if path in UNAUTHENTICATED:
            assert "security" not in op and "x-rudder-action" not in op, (method, path)
        else:
            assert op["security"] == [{"bearer": []}], (method, path)
            assert Action(op["x-rudder-action"]), (method, path)
            assert {"401", "403", "429", "503"} <= set(errors), (method, path)
        if op.get("x-rudder-action") == Action.WRITE_POLICY.value:
            assert {"400", "409", "413", "415", "422"} <= set(errors), (method, path)


def test_no_fastapi_validation_shape_and_every_reference_resolves(spec: dict[str, Any]) -> None:
    schemas = spec["components"]["schemas"]
    assert "HTTPValidationError" not in schemas and "ValidationError" not in schemas
    for ref in set(refs(spec)):
        assert ref.startswith("#/components/schemas/") and ref.rsplit("/", 1)[-1] in schemas, ref
    assert spec["components"]["securitySchemes"]["bearer"]["scheme"] == "bearer"
    ids = [op["operationId"] for _, _, op in operations(spec)]
    assert len(ids) == len(set(ids))


def test_the_error_body_and_the_write_bodies_are_described(spec: dict[str, Any]) -> None:
    schemas = spec["components"]["schemas"]
    error = schemas["ErrorDetail"]
    assert {"code", "message"} <= set(error["required"]) and error["additionalProperties"] is True
    patch = schemas["PolicyPatch"]["properties"]
    assert patch["expected_revision"]["minimum"] == 0 and patch["kind"] == {
        "$ref": "#/components/schemas/PolicyKind", "default": "selection", "description": patch["kind"]["description"]}
    assert patch["parameters"]["additionalProperties"] == {"anyOf": [{"type": "number"}, {"type": "null"}]}
    threshold = schemas["ThresholdsUpdate"]["properties"]["active_decode_blocks_threshold"]["anyOf"][0]
    assert threshold == {"type": "number", "minimum": 0.0, "maximum": 1.0}


async def test_routing_errors_and_unexpected_exceptions_use_the_error_body() -> None:
    app = admin_app()  # never started: routing and the error mapping need no services
    transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
    async with httpx.AsyncClient(transport=transport, base_url="http://admin") as http:
        r = await http.get("/no/such/route")
        assert r.status_code == 404 and r.json() == {"error": {"code": "not_found", "message": "Not Found"}}
        assert r.headers["x-request-id"]
        r = await http.delete("/router_policy")
        assert r.status_code == 405, r.text
        assert r.json()["error"] == {"code": "method_not_allowed", "message": "Method Not Allowed",
                                     "allow": ["GET", "PATCH"]}
        assert r.headers["allow"] == "GET, PATCH"
        assert (await http.get("/healthz")).json() == {"status": "ok"}
        # /readyz of a control plane that never started fails inside the route: a bug, answered
        # in the error body as one, not as a library's error page.
        r = await http.get("/readyz", headers={"X-Request-Id": "bug-1"})
        assert r.status_code == 500 and r.json()["error"]["code"] == "internal_error"
        assert r.headers["x-request-id"] == "bug-1"


def test_every_route_documents_400_for_its_query_string(spec: dict[str, Any]) -> None:
    """Every route refuses an unknown query parameter or a control character in one (400); the
    admin API fuzzer found it undocumented on the routes without a 400 of their own."""
    for method, path, op in operations(spec):
        answer = op["responses"].get("400")
        assert answer is not None, f"{method} {path} does not document 400"
        assert schema_of(answer)["$ref"] == ERROR_BODY, (method, path)
