"""The admin API without servers: its app (built, never started) and its ``/openapi.json``, and the
route table of docs/api.md generated from it."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI

from controlplane.auth import ROLE_ACTIONS, Action
from controlplane.server import create_app
from controlplane.settings import ControlPlaneSettings
from tests.policy_keys import session_keys

METHODS = ("get", "put", "post", "patch", "delete")


def admin_app() -> FastAPI:
    return create_app(ControlPlaneSettings(policy_signing_key=session_keys().seed_path))


def admin_spec() -> dict[str, Any]:
    return admin_app().openapi()


def operations(spec: dict[str, Any]) -> list[tuple[str, str, dict[str, Any]]]:
    """``(METHOD, path, operation)`` of every route, in the spec's order."""
    return [(method.upper(), path, op) for path, item in spec["paths"].items()
            for method, op in item.items() if method in METHODS]


def _name(schema: dict[str, Any]) -> str:
    if "$ref" in schema:
        return f"`{schema['$ref'].rsplit('/', 1)[-1]}`"
    return ", ".join(_name(s) for s in schema.get("anyOf", [])) or "—"


def route_table(spec: dict[str, Any]) -> str:
    """docs/api.md's route table: method, path, the action and the roles that have it, the body,
    the answer and the error statuses of every route."""
    lines = ["| method | path | action (roles) | body | answer | errors |", "|---|---|---|---|---|---|"]
    for method, path, op in operations(spec):
        action = op.get("x-rudder-action")
        if action is None:
            who = "none"
        else:
            roles = [role.value for role, actions in ROLE_ACTIONS.items() if Action(action) in actions]
            who = f"`{action}` ({', '.join(roles)})"
        body = "—"
        if "requestBody" in op:
            body = _name(op["requestBody"]["content"]["application/json"]["schema"])
            if not op["requestBody"].get("required"):
                body += " (optional)"
        ok = op["responses"]["200"].get("content", {})
        answer = _name(ok["application/json"]["schema"]) if "application/json" in ok else " ".join(ok)
        errors = " ".join(s for s in sorted(op["responses"]) if s >= "400")
        lines.append(f"| {method} | `{path}` | {who} | {body} | {answer} | {errors} |")
    return "\n".join(lines)
