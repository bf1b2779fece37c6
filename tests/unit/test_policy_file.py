"""Policy as code, the pure part: the file format, its JSON Schema, the plan, drift, export and the
revision file (controlplane/protocol/policyfile.py)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml
from typer.testing import CliRunner

from cli.errors import CliError, ExitCode
from cli.main import app
from cli.policyset import read_policy_set
from controlplane.protocol.errors import ValidationFailed
from controlplane.protocol.policy import PARAMETERS, PolicyKind
from controlplane.protocol.policyfile import (
    API_VERSION,
    FILE_KIND,
    DocumentKey,
    Live,
    StepAction,
    desired_digest,
    drifted,
    export,
    json_schema,
    merge_sets,
    moved,
    parse_policy_set,
    parse_revision_file,
    plan,
    revision_file,
)

SEL, THR = PolicyKind.SELECTION, PolicyKind.BUSY_THRESHOLD

EXAMPLE = """
apiVersion: rudder/v1
kind: PolicySet
models:
  org/a:
    selection: {overlap_score_credit: 0.5, calibration_window: 64}
    busy_threshold: {active_decode_blocks_threshold: 0.8}
  org/b:
    selection: {}
"""


def policy(models: dict[str, Any]) -> dict[str, Any]:
    return {"apiVersion": API_VERSION, "kind": FILE_KIND, "models": models}


def test_a_file_parses_into_managed_documents() -> None:
    got = parse_policy_set(yaml.safe_load(EXAMPLE), source="p.yaml")
    assert sorted(got) == [DocumentKey("org/a", THR), DocumentKey("org/a", SEL), DocumentKey("org/b", SEL)]
    a = got[DocumentKey("org/a", SEL)]
    assert a.document == {"calibration_window": 64, "overlap_score_credit": 0.5}
    assert isinstance(a.document["calibration_window"], int) and a.source == "p.yaml"
    assert got[DocumentKey("org/b", SEL)].document == {}


@pytest.mark.parametrize(("data", "field"), [
    ([], "$"),
    ({**policy({}), "extra": 1}, "extra"),
    ({**policy({}), "apiVersion": "rudder/v0"}, "apiVersion"),
    ({**policy({}), "kind": "Policy"}, "kind"),
    (policy([]), "models"),  # type: ignore[arg-type]
    (policy({"m": {"routing": {}}}), "models.m.routing"),
    (policy({"m": {"selection": {"nope": 1}}}), "models.m.selection.nope"),
    (policy({"m": {"selection": {"host_cache_hit_weight": 2}}}), "models.m.selection.host_cache_hit_weight"),
    (policy({"m": {"selection": {"calibration_window": 64.5}}}), "models.m.selection.calibration_window"),
    (policy({"m": {"busy_threshold": {"active_decode_blocks_threshold": None}}}),
     "models.m.busy_threshold.active_decode_blocks_threshold"),
])
def test_a_bad_file_is_refused_naming_the_field_and_the_file(data: Any, field: str) -> None:
    with pytest.raises(ValidationFailed) as info:
        parse_policy_set(data, source="bad.yaml")
    assert info.value.field == field
    assert info.value.facts["source"] == "bad.yaml" and info.value.message.startswith("bad.yaml: ")


def test_a_document_named_by_two_files_is_an_error_naming_both() -> None:
    one = parse_policy_set(policy({"m": {"selection": {}}}), source="one.yaml")
    two = parse_policy_set(policy({"m": {"selection": {"router_temperature": 1}}}), source="two.yaml")
    with pytest.raises(ValidationFailed, match=r"m selection is in both one.yaml and two.yaml"):
        merge_sets([one, two])
    other = parse_policy_set(policy({"m": {"busy_threshold": {}}}), source="two.yaml")
    assert len(merge_sets([one, other])) == 2


def test_the_plan_creates_updates_and_leaves_alone() -> None:
    desired = parse_policy_set(yaml.safe_load(EXAMPLE), source="p.yaml")
    live = {
        DocumentKey("org/a", SEL): Live(7, {"overlap_score_credit": 0.5, "router_temperature": 0.2}),
        DocumentKey("org/b", SEL): Live(3, {}),
        DocumentKey("org/c", SEL): Live(9, {"router_temperature": 1.0}),  # not managed: untouched
    }
    steps = {s.key: s for s in plan(desired, live)}
    assert set(steps) == set(desired)
    upd = steps[DocumentKey("org/a", SEL)]
    assert upd.action is StepAction.UPDATE and upd.revision == 7
    assert upd.diff == {"calibration_window": {"before": None, "after": 64},
                        "router_temperature": {"before": 0.2, "after": None}}
    assert upd.patch_body() == {"model": "org/a", "kind": "selection", "expected_revision": 7,
                                "parameters": {"calibration_window": 64, "router_temperature": None}}
    new = steps[DocumentKey("org/a", THR)]
    assert new.action is StepAction.CREATE and new.revision == 0
    assert new.patch_body() == {"model": "org/a", "kind": "busy_threshold", "expected_revision": 0,
                                "parameters": {"active_decode_blocks_threshold": 0.8}}
    same = steps[DocumentKey("org/b", SEL)]
    assert same.action is StepAction.NO_CHANGE and same.patch_body() is None
    assert {s.key for s in drifted(steps.values())} == {upd.key, new.key}


def test_a_file_that_empties_a_document_resets_it() -> None:
    desired = parse_policy_set(policy({"m": {"selection": None}}), source="p.yaml")
    (step,) = plan(desired, {DocumentKey("m", SEL): Live(4, {"router_temperature": 1.0})})
    assert step.action is StepAction.UPDATE
    assert step.patch_body() == {"model": "m", "kind": "selection", "expected_revision": 4, "reset": True}
    # An empty document that does not exist yet: nothing to write.
    (none,) = plan(desired, {})
    assert none.action is StepAction.NO_CHANGE and none.patch_body() is None


def test_moved_names_every_document_whose_head_changed() -> None:
    a, b = DocumentKey("a", SEL), DocumentKey("b", THR)
    assert moved({a: 3, b: 0}, {a: 3}) == []
    assert moved({a: 3, b: 0}, {a: 5, b: 6}) == [
        {"model": "a", "kind": "selection", "expected_revision": 3, "head_revision": 5},
        {"model": "b", "kind": "busy_threshold", "expected_revision": 0, "head_revision": 6}]


def test_export_then_plan_changes_nothing() -> None:
    live = {DocumentKey("m", SEL): Live(4, {"router_temperature": 1.0}),
            DocumentKey("m", THR): Live(0, {}),  # no document: not exported
            DocumentKey("n", THR): Live(2, {})}  # reset to nothing: exported as {}
    data = export(live)
    assert data == policy({"m": {"selection": {"router_temperature": 1.0}}, "n": {"busy_threshold": {}}})
    jsonschema.validate(data, json_schema())
    desired = parse_policy_set(yaml.safe_load(yaml.safe_dump(data)), source="export")
    assert drifted(plan(desired, live)) == []


def test_the_revision_file_round_trips_and_is_checked() -> None:
    desired = parse_policy_set(yaml.safe_load(EXAMPLE), source="p.yaml")
    steps = plan(desired, {DocumentKey("org/a", SEL): Live(7, {})})
    data = revision_file(steps)
    parsed = parse_revision_file(yaml.safe_load(yaml.safe_dump(data)), source="r.yaml")
    assert parsed.revisions == {s.key: s.revision for s in steps}
    assert parsed.digest == desired_digest(steps)
    # The digest is what the file asks for, not where the heads are.
    assert desired_digest(plan(desired, {})) == parsed.digest
    edited = parse_policy_set(yaml.safe_load(EXAMPLE.replace("0.8", "0.7")), source="p.yaml")
    assert desired_digest(plan(edited, {})) != parsed.digest
    for bad in ({}, {**data, "documents": [{"model": "m", "kind": "x", "revision": 1}]},
                {**data, "documents": [{"model": "m", "kind": "selection", "revision": -1}]}):
        with pytest.raises(ValidationFailed):
            parse_revision_file(bad, source="r.yaml")


def test_the_schema_accepts_what_the_parser_accepts_and_refuses_what_it_refuses() -> None:
    schema = json_schema()
    jsonschema.Draft202012Validator.check_schema(schema)
    jsonschema.validate(yaml.safe_load(EXAMPLE), schema)
    # Every parameter of every kind is in the schema, with the parser's ranges.
    for kind in PolicyKind:
        props = schema["properties"]["models"]["additionalProperties"]["properties"][kind.value]["properties"]
        assert set(props) == set(PARAMETERS[kind])
        for name, spec in PARAMETERS[kind].items():
            assert props[name]["minimum"] == spec.minimum
            assert props[name].get("maximum") == spec.maximum
            assert props[name]["type"] == ("integer" if spec.integer else "number")
    for bad in (policy({"m": {"selection": {"nope": 1}}}),
                policy({"m": {"selection": {"host_cache_hit_weight": 2}}}),
                policy({"m": {"selection": {"calibration_window": 64.5}}}),
                policy({"m": {"routing": {}}}),
                {**policy({}), "apiVersion": "rudder/v0"}):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
        with pytest.raises(ValidationFailed):
            parse_policy_set(bad, source="bad")


def test_rudder_policy_schema_publishes_it() -> None:
    result = CliRunner().invoke(app, ["policy", "schema"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout) == json_schema()


def test_reading_a_folder(tmp_path: Path) -> None:
    """``-f`` names a file or a folder (its *.yaml, *.yml, *.json); numbers read as YAML 1.2 does."""
    (tmp_path / "a.yaml").write_text("apiVersion: rudder/v1\nkind: PolicySet\nmodels:\n"
                                     "  m: {selection: {overlap_score_credit: 1e-3, router_temperature: .5}}\n")
    (tmp_path / "b.json").write_text(json.dumps(policy({"n": {"busy_threshold": {}}})))
    (tmp_path / "notes.txt").write_text("ignored")
    got = read_policy_set(tmp_path)
    assert got[DocumentKey("m", SEL)].document == {"overlap_score_credit": 0.001, "router_temperature": 0.5}
    assert got[DocumentKey("n", THR)].source == str(tmp_path / "b.json")
    assert read_policy_set(tmp_path / "a.yaml").keys() == {DocumentKey("m", SEL)}

    (tmp_path / "c.yml").write_text("apiVersion: rudder/v1\nkind: PolicySet\nmodels: {m: {selection: {}}}\n")
    with pytest.raises(CliError) as twice:
        read_policy_set(tmp_path)
    assert twice.value.exit_code == ExitCode.USAGE and "a.yaml and" in twice.value.message
    (tmp_path / "c.yml").write_text("models: [unclosed\n")
    with pytest.raises(CliError, match="not valid YAML") as broken:
        read_policy_set(tmp_path)
    assert broken.value.exit_code == ExitCode.USAGE
    empty = tmp_path / "empty"
    empty.mkdir()
    for missing in (empty, tmp_path / "nope.yaml"):
        with pytest.raises(CliError) as none:
            read_policy_set(missing)
        assert none.value.exit_code == ExitCode.USAGE
