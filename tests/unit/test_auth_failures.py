"""Failed authentications per source address (controlplane.auth.AuthFailureLimiter), no network."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from controlplane.audit.records import Decision
from controlplane.auth import AUTH_FAILURES, AuthFailureLimiter, failure_entry


class Clocks:
    def __init__(self) -> None:
        self.t = 100.0
        self.start = datetime(2026, 1, 1, tzinfo=UTC)

    def mono(self) -> float:
        return self.t

    def wall(self) -> datetime:
        return self.start + timedelta(seconds=self.t)


def _limiter(c: Clocks, **kw: int) -> AuthFailureLimiter:
    return AuthFailureLimiter(limit=kw.get("limit", 3), window_s=10, max_sources=kw.get("max_sources", 100),
                              clock=c.mono, wall=c.wall)


def test_first_failure_audited_alone_then_counted_then_refused_until_the_window_ends() -> None:
    c = Clocks()
    lim = _limiter(c)
    assert lim.retry_after("10.0.0.1") is None
    assert lim.failed("10.0.0.1", audited_if_first=True) is True  # the caller audits this one
    assert lim.failed("10.0.0.1", audited_if_first=True) is False
    assert lim.retry_after("10.0.0.1") is None
    assert lim.failed("10.0.0.1", audited_if_first=True) is False
    c.t += 4
    assert lim.retry_after("10.0.0.1") == 6  # limit reached: refused for the rest of the window
    for _ in range(100):
        lim.refused("10.0.0.1")
    assert lim.retry_after("10.0.0.2") is None  # another source is not affected
    assert lim.ended() == []  # the window is still open
    c.t += 6
    assert lim.retry_after("10.0.0.1") is None
    (window,) = lim.ended()
    assert lim.ended() == []  # handed out once
    assert (window.source, window.failures, window.refused, window.unrecorded) == ("10.0.0.1", 3, 100, 102)
    entry = failure_entry(window, window_s=10)
    assert entry.reason_code == AUTH_FAILURES and entry.decision is Decision.REJECTED
    assert entry.source_ip == "10.0.0.1" and entry.changes is not None and entry.changes["count"] == 102
    assert entry.event_id is None and entry.at == c.start + timedelta(seconds=104)


def test_a_window_whose_only_failure_was_audited_writes_no_summary() -> None:
    c = Clocks()
    lim = _limiter(c)
    lim.failed("a", audited_if_first=True)
    c.t += 11
    assert lim.ended() == []
    # A read route does not audit failures one by one: its first one is counted as well.
    lim.failed("a", audited_if_first=False)
    (window,) = lim.ended(everything=True)
    assert window.unrecorded == 1


def test_requeued_windows_are_handed_out_again() -> None:
    c = Clocks()
    lim = _limiter(c)
    lim.failed("a", audited_if_first=False)
    windows = lim.ended(everything=True)
    lim.requeue(windows)
    assert lim.ended() == windows


def test_sources_past_the_tracking_cap_share_one_window() -> None:
    c = Clocks()
    lim = _limiter(c, max_sources=2, limit=2)
    lim.failed("a", audited_if_first=False)
    lim.failed("b", audited_if_first=False)
    lim.failed("c", audited_if_first=False)
    lim.failed("d", audited_if_first=False)
    # c and d are counted together, so a flood of new addresses is still limited.
    assert lim.retry_after("e") is not None
    assert lim.retry_after("a") is None
    sources = sorted(w.source for w in lim.ended(everything=True))
    assert sources == ["*", "a", "b"]


def test_10000_sources_write_bounded_rows_in_total_and_lose_no_count() -> None:
    """Issue 17: 10,030 addresses failing once each wrote 10,001 audit rows; the rows are now
    bounded in total per window, and every failure is still counted."""
    c = Clocks()
    lim = AuthFailureLimiter(limit=10, window_s=60, max_sources=10_000, max_rows=100,
                             clock=c.mono, wall=c.wall)
    singles = sum(lim.failed(f"10.0.{i // 256}.{i % 256}", audited_if_first=True) for i in range(10_030))
    assert singles == 100
    windows = lim.ended(everything=True)  # within the window: its budget is spent
    assert len(windows) == 1 and windows[0].source == "*"  # so everything left is one row
    assert singles + sum(w.unrecorded for w in windows) == 10_030
    c.t += 61
    # The next window has its budget again.
    assert lim.failed("192.0.2.1", audited_if_first=True) is True


def test_the_row_budget_merges_only_what_it_cannot_write() -> None:
    c = Clocks()
    lim = AuthFailureLimiter(limit=10, window_s=10, max_sources=100, max_rows=3, clock=c.mono, wall=c.wall)
    for source in "abcde":
        lim.failed(source, audited_if_first=False)
    c.t += 11
    windows = lim.ended()
    assert [w.source for w in windows] == ["a", "b", "*"]  # three rows: the budget
    assert windows[-1].unrecorded == 3
