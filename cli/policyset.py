"""Policy as code for ``rudder policy apply|diff|export|schema``: reading policy files (one file
or a folder), reading the live heads, and printing a plan. The decisions (validation, the plan,
what moved) are ``controlplane.protocol.policyfile``'s; this module does the I/O around them.

Errors: a file that cannot be read or does not validate is ``CliError(USAGE)`` (exit 2) naming
the file and the field; a head that moved since the plan was shown is ``CliError(CONFLICT)``
(exit 3) naming every moved document.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import yaml

from cli.client import AdminClient
from cli.errors import CliError, ExitCode
from cli.output import fmt_value, say, show, table
from controlplane.protocol.errors import RudderError
from controlplane.protocol.policy import PolicyKind
from controlplane.protocol.policyfile import (
    DocumentKey,
    Live,
    PlanStep,
    PolicySet,
    RevisionFile,
    StepAction,
    desired_digest,
    merge_sets,
    parse_policy_set,
    parse_revision_file,
)

SUFFIXES = (".yaml", ".yml", ".json")


class _Loader(yaml.SafeLoader):
    """YAML 1.1's safe loader, reading numbers as YAML 1.2 (and JSON) do: ``1e-3`` is a float
    (YAML 1.1 wants ``1.0e-3``, and reads ``1e-3`` as a string)."""


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*\.[0-9_]*(?:[eE][-+]?[0-9]+)?|\.[0-9_]+(?:[eE][-+]?[0-9]+)?"
               r"|[0-9][0-9_]*[eE][-+]?[0-9]+|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$"),
    list("-+0123456789."),
)


def _load(path: Path) -> Any:
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise CliError(ExitCode.USAGE, f"cannot read {path}: {exc.strerror or exc}") from exc
    try:
        # _Loader is a SafeLoader: plain data only, no Python objects.
        return json.loads(text) if path.suffix == ".json" else yaml.load(text, Loader=_Loader)
    except (ValueError, yaml.YAMLError) as exc:
        raise CliError(ExitCode.USAGE, f"{path} is not valid {'JSON' if path.suffix == '.json' else 'YAML'}: "
                       f"{exc}") from exc


def files_of(path: Path) -> list[Path]:
    """The policy files a ``-f`` names: the file, or the folder's ``*.yaml|*.yml|*.json`` (sorted,
    not recursive)."""
    if path.is_dir():
        found = sorted(p for p in path.iterdir() if p.is_file() and p.suffix in SUFFIXES)
        if not found:
            raise CliError(ExitCode.USAGE, f"no policy files (*.yaml, *.yml, *.json) in {path}")
        return found
    if not path.exists():
        raise CliError(ExitCode.USAGE, f"no such file or folder: {path}")
    return [path]


def read_policy_set(path: Path) -> PolicySet:
    try:
        return merge_sets(parse_policy_set(_load(p), source=str(p)) for p in files_of(path))
    except RudderError as exc:
        body = exc.to_dict()
        raise CliError(ExitCode.USAGE, exc.message, body=body) from None


def read_revision_file(path: Path) -> RevisionFile:
    try:
        return parse_revision_file(_load(path), source=str(path))
    except RudderError as exc:
        raise CliError(ExitCode.USAGE, exc.message, body=exc.to_dict()) from None


def live_heads(api: AdminClient) -> dict[DocumentKey, Live]:
    """Every document's head (one read of ``GET /router_policy``)."""
    body = api.get("/router_policy")
    docs = body.get("documents", []) if isinstance(body, dict) else []
    out: dict[DocumentKey, Live] = {}
    for d in docs:
        if isinstance(d, dict) and isinstance(d.get("model"), str) and d.get("kind") in set(PolicyKind):
            key = DocumentKey(d["model"], PolicyKind(d["kind"]))
            out[key] = Live(int(d.get("revision") or 0), dict(d.get("document") or {}))
    return out


def print_plan(steps: list[PlanStep], *, title: str = "plan") -> None:
    """Each document: what the apply does, against which head revision, and its diff."""
    if not steps:
        say(f"{title}: the file manages no documents")
        return
    counts = {a: sum(1 for s in steps if s.action is a) for a in StepAction}
    say(f"[bold]{title}[/]: {counts[StepAction.CREATE]} to create, {counts[StepAction.UPDATE]} to update, "
        f"{counts[StepAction.NO_CHANGE]} unchanged")
    for step in steps:
        if step.action is StepAction.NO_CHANGE:
            say(f"  {step.key}: no change (revision {step.revision})")
            continue
        say(f"  {step.key}: {step.action.value} at revision {step.revision}")
        rows = [(name, fmt_value(c["before"]), fmt_value(c["after"])) for name, c in step.diff.items()]
        show(table(["parameter", "live", "file"], rows))


def check_revisions(steps: list[PlanStep], expected: RevisionFile, source: str) -> None:
    """The revision file must be this file's dry run's: the same documents (here) and the same
    overrides (:func:`check_digest`); else the plan shown is not the one that would be applied."""
    missing = [str(s.key) for s in steps if s.key not in expected.revisions]
    if missing:
        raise CliError(ExitCode.USAGE, f"{source} has no revision for {', '.join(missing)}: "
                       "it was written for another file (run the dry run again)")


def check_digest(steps: list[PlanStep], expected: RevisionFile, source: str) -> None:
    if desired_digest(steps) != expected.digest:
        raise CliError(ExitCode.USAGE, f"the policy file changed since the dry run that wrote {source} "
                       "(run the dry run again)")


def conflict(moved: list[dict[str, Any]]) -> CliError:
    names = ", ".join(f"{m['model']} {m['kind']} (planned at {m['expected_revision']}, head "
                      f"{m['head_revision']})" for m in moved)
    return CliError(ExitCode.CONFLICT,
                    f"revision_conflict: nothing applied; moved since the plan was shown: {names}",
                    body={"code": "revision_conflict", "moved": moved})


def dump_yaml(data: Any) -> str:
    return str(yaml.safe_dump(data, sort_keys=False, default_flow_style=False, allow_unicode=True))


def as_json(steps: list[PlanStep]) -> list[dict[str, Any]]:
    return [s.to_dict() for s in steps]
