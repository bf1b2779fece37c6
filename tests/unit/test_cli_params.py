"""``name=value`` parsing and time arguments of the CLI (pure)."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from cli.params import PairError, parse_names, parse_pair, parse_parameters, parse_time


@pytest.mark.parametrize(
    ("pair", "expected"),
    [
        ("overlap_score_credit=0.5", ("overlap_score_credit", 0.5)),
        ("x=3", ("x", 3)),
        ("x=-1", ("x", -1)),
        ("x=1e-3", ("x", 0.001)),
        ("x= 2 ", ("x", 2)),
        ("x=null", ("x", None)),
    ],
)
def test_parse_pair_accepts_json_numbers_and_null(pair: str, expected: tuple[str, object]) -> None:
    assert parse_pair(pair) == expected


def test_integers_stay_integers() -> None:
    _, value = parse_pair("active_prefill_tokens_threshold=8192")
    assert isinstance(value, int)


@pytest.mark.parametrize(
    "pair",
    ["x", "=1", "x=", "x=abc", "x=NaN", "x=Infinity", "x=-Infinity", "x=true", "x=\"1\"",
     "x=[1]", "x={}", "1x=2", "x y=1", "x=1 2"],
)
def test_bad_pairs_name_the_pair(pair: str) -> None:
    with pytest.raises(PairError) as info:
        parse_pair(pair)
    assert repr(pair) in str(info.value)


def test_parse_parameters_refuses_a_name_given_twice() -> None:
    with pytest.raises(PairError, match="more than once"):
        parse_parameters(["x=1", "x=2"])
    assert parse_parameters(["a=1", "b=null"]) == {"a": 1, "b": None}


def test_parse_names() -> None:
    assert parse_names(["a", "b", "a"]) == ["a", "b"]
    with pytest.raises(PairError, match="'a=1'"):
        parse_names(["a=1"])


NOW = datetime(2025, 6, 1, 12, 0, tzinfo=UTC)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("15m", "2025-06-01T11:45:00Z"),
        ("2h", "2025-06-01T10:00:00Z"),
        ("1d", "2025-05-31T12:00:00Z"),
        ("2025-05-01T00:00:00Z", "2025-05-01T00:00:00Z"),
        ("2025-05-01T02:00:00+02:00", "2025-05-01T00:00:00Z"),
        ("2025-05-01", "2025-05-01T00:00:00Z"),
    ],
)
def test_parse_time(text: str, expected: str) -> None:
    assert parse_time(text, now=NOW) == expected


def test_parse_time_refuses_garbage() -> None:
    with pytest.raises(PairError, match="ISO-8601"):
        parse_time("yesterday", now=NOW)
