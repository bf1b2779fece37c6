"""B3: every "wrong last sequence" answer of JetStream is a stale compare-and-set (409), including
10164, which a clustered nats-server 2.15 answers without a sequence in its text; checked on
nats-py's own error objects, as the server's answers are decoded."""

from __future__ import annotations

from nats.js.errors import APIError, BadRequestError

from bus.client import _translate, _wrong_last_sequence


def answer(err_code: int, description: str) -> APIError:
    """The error nats-py raises for a JetStream API answer (``APIError.from_error`` raises it)."""
    try:
        APIError.from_error({"code": 400, "err_code": err_code, "description": description})
    except APIError as exc:
        return exc
    raise AssertionError("from_error did not raise")


def test_a_10164_answer_is_a_wrong_last_sequence() -> None:
    exc = answer(10164, "wrong last sequence")
    assert isinstance(exc, BadRequestError)
    assert _wrong_last_sequence(exc)


def test_a_10071_answer_is_a_wrong_last_sequence() -> None:
    assert _wrong_last_sequence(answer(10071, "wrong last sequence: 3"))


def test_other_refusals_are_not_conflicts() -> None:
    exc = answer(10077, "maximum messages exceeded")
    assert not _wrong_last_sequence(exc)
    assert _translate(exc, "publish").code == "log_unavailable"
