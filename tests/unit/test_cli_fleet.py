"""The "N/M routers on the head revision" summary of ``rudder routers list`` (pure)."""

from __future__ import annotations

from cli.fleet import summarize


def test_summary_counts_routers_serving_the_model() -> None:
    body = {
        "heads": {"m|selection": 7, "m|busy_threshold": 0, "other|selection": 3},
        "routers": [
            {"router_id": "a", "models": ["m"], "applied": {"m|selection": {"revision": 7}}},
            {"router_id": "b", "models": ["m"], "applied": {"m|selection": {"revision": 5,
                                                                            "last_nack": "x"}}},
            {"router_id": "c", "models": ["m", "other"], "applied": {}},
        ],
    }
    by_doc = {(s["model"], s["kind"]): (s["on_head"], s["routers"], s["head_revision"])
              for s in summarize(body)}
    assert by_doc[("m", "selection")] == (1, 3, 7)
    assert by_doc[("m", "busy_threshold")] == (3, 3, 0)  # no document: everyone is on it
    assert by_doc[("other", "selection")] == (0, 1, 3)


def test_summary_of_an_empty_fleet() -> None:
    assert summarize({"routers": [], "heads": {}}) == []
    assert summarize({}) == []


def test_model_names_with_separators() -> None:
    body = {"heads": {"org/m:v1|selection": 2},
            "routers": [{"models": ["org/m:v1"],
                         "applied": {"org/m:v1|selection": {"revision": 2}}}]}
    assert summarize(body) == [{"model": "org/m:v1", "kind": "selection", "head_revision": 2,
                                "on_head": 1, "routers": 1}]


def test_calibration_rows_show_each_workers_fit_and_error() -> None:
    from cli.fleet import calibration_rows

    routers = [{"router_id": "a", "calibration": [
        {"model": "m", "instance_id": 7, "source": "fitted", "prefill_ms": [16.5, 0.0152, 4.2e-7],
         "prefill_samples": 40, "decode_samples": 30, "ttft_mae_ms": 12.34, "ttft_p90_error_ms": 30.0},
        {"model": "m", "instance_id": 8, "source": "mock", "prefill_ms": [33.0, 0.03, 8.4e-7]},
    ]}, {"router_id": "b"}]
    rows = calibration_rows(routers)
    assert rows[0] == ("a", "m", 7, "fitted", "16.5 + 0.0152·N + 4.2e-07·N²", "40/30", "12.3", "30.0")
    assert rows[1][3] == "mock" and rows[1][6:] == ("", "")
    assert len(rows) == 2


def test_workers_list_names_which_routers_quarantine_which_claims() -> None:
    from cli.fleet import _quarantined

    assert _quarantined([]) == _quarantined(None) == "-"
    assert _quarantined([{"router_id": "r1", "claims": ["cache", "timing"]},
                         {"router_id": "r2", "claims": ["timing"]}]) == "cache, timing by r1; timing by r2"
