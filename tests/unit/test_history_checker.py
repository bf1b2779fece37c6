"""The history checker finds what it exists to find (issue 18, item 3): a non-linearizable CAS
history, an out-of-order apply, a lost acknowledged write, a false ``not_published`` decision and
a router stuck one revision behind are each reported; valid histories (with concurrency, lost
answers and retired revisions) are not."""

from __future__ import annotations

import random

from tests.reliability.history import (
    Answer,
    Apply,
    Attempt,
    Chat,
    Decision,
    History,
    check,
    check_applies,
    check_chats,
    check_convergence,
    check_linearizable,
    linearize,
)

DOC = "m/selection"


def ok(client: str, expected: int, new: int, t0: float, t1: float, eid: str | None = None) -> Attempt:
    return Attempt(client, DOC, expected, Answer.ACCEPTED, t0, t1, new_revision=new, event_id=eid or f"e{new}")


def conflict(client: str, expected: int, t0: float, t1: float, head: int | None = None) -> Attempt:
    return Attempt(client, DOC, expected, Answer.CONFLICT, t0, t1, head_revision=head)


def unknown(client: str, expected: int, t0: float, eid: str) -> Attempt:
    return Attempt(client, DOC, expected, Answer.UNKNOWN, t0, None, event_id=eid)


# -- linearizability ----------------------------------------------------------------------------


def test_concurrent_writers_one_winner_per_revision_is_linearizable() -> None:
    history = [ok("a", 0, 1, 0.0, 1.0), conflict("b", 0, 0.1, 1.1, 1),
               ok("b", 1, 2, 1.2, 2.0), conflict("a", 1, 1.3, 2.1, 2), conflict("c", 0, 0.5, 3.0, 2)]
    assert linearize(history) is True


def test_a_conflict_before_any_write_to_its_revision_is_not_linearizable() -> None:
    """``b`` was told 409 at expected 0 and completed before ``a`` (the only write) began: the
    head was 0 throughout b's attempt. One winner per revision holds; linearizability does not."""
    history = [conflict("b", 0, 0.0, 0.5, 1), ok("a", 0, 1, 1.0, 2.0)]
    assert linearize(history) is False
    [problem] = check_linearizable(history)
    assert problem.kind == "not_linearizable"


def test_two_writes_accepted_at_one_expected_revision_are_not_linearizable() -> None:
    history = [ok("a", 3, 4, 0.0, 1.0), ok("b", 3, 5, 0.0, 1.0)]
    assert linearize(history, initial=3) is False


def test_a_write_that_went_back_in_time_is_not_linearizable() -> None:
    """``b`` expected revision 1 and succeeded after ``a`` had already moved the head on to 2."""
    history = [ok("x", 0, 1, 0.0, 0.1), ok("a", 1, 2, 0.2, 0.3), ok("b", 1, 3, 0.4, 0.5)]
    assert linearize(history) is False


def test_a_lost_answer_may_have_taken_effect_or_not() -> None:
    took = [unknown("a", 0, 0.0, "ea"), ok("b", 1, 2, 1.0, 1.1)]  # a's event is revision 1
    assert linearize(took, stream_events={"ea": 1}) is True
    never = [unknown("a", 0, 0.0, "ea"), ok("b", 0, 2, 1.0, 1.1)]
    assert linearize(never) is True
    # Known to have taken effect at revision 1: whichever came first, the other found the head
    # away from 0.
    assert linearize(never, stream_events={"ea": 1}) is False


def test_a_lost_answer_not_on_a_fully_retained_stream_never_took_effect() -> None:
    """``a``'s event is not on the stream, which holds every revision after a's expected one:
    it never took effect, so ``c``'s 409 naming head 1 (the head only ``a`` could have set) is
    a lie the checker reports; with revisions retired it could have, and is not reported."""
    history = [unknown("a", 0, 0.0, "ea"), conflict("c", 0, 1.0, 1.1, 1), ok("b", 0, 1, 2.0, 2.1)]
    assert linearize(history) is True
    assert linearize(history, stream_events={"eb": 1}, retained_from=0) is False
    assert linearize(history, stream_events={"eb": 1}, retained_from=5) is True


def test_many_lost_answers_ruled_out_by_the_stream_check_quickly() -> None:
    """A leader election answers dozens of writes ``log_ambiguous`` at once: each one open in the
    search doubles it, unless the stream (holding every revision) rules it out."""
    history = [unknown(f"c{i % 3}", 1, 0.01 * i, f"lost{i}") for i in range(200)]
    history += [ok("a", 0, 1, 0.0, 0.05), ok("a", 1, 2, 3.0, 3.1)]
    assert linearize(history, stream_events={"e1": 1, "e2": 2}, retained_from=0) is True


def test_a_long_sequential_history_checks_quickly() -> None:
    rng = random.Random(7)
    history, head, t = [], 0, 0.0
    for i in range(3000):
        if rng.random() < 0.3:
            history.append(conflict(f"c{i % 3}", max(0, head - 1), t, t + 0.01, head))
        else:
            history.append(ok(f"c{i % 3}", head, head + 1 + rng.randrange(3), t, t + 0.01))
            head = history[-1].new_revision or 0
        t += 0.02
    assert linearize(history) is True


# -- applies and convergence ---------------------------------------------------------------------


def test_an_out_of_order_apply_and_a_duplicate_are_reported() -> None:
    applies = [Apply("r1", DOC, 1, 0.0), Apply("r1", DOC, 3, 1.0), Apply("r1", DOC, 2, 2.0),
               Apply("r2", DOC, 1, 0.0), Apply("r2", DOC, 1, 1.0)]
    assert sorted(p.kind for p in check_applies(applies)) == ["duplicate_apply", "out_of_order_apply"]


def test_a_router_stuck_one_revision_behind_is_reported() -> None:
    applies = [Apply("r1", DOC, 1, 0.0), Apply("r1", DOC, 2, 5.5), Apply("r2", DOC, 1, 0.0)]
    [problem] = check_convergence(applies, heads={DOC: 2}, routers={"r1", "r2"}, last_fault_at=5.0)
    assert problem.kind == "not_converged" and "r2" in problem.detail and "@1" in problem.detail
    late = [Apply("r1", DOC, 2, 9.0)]
    [slow] = check_convergence(late, heads={DOC: 2}, routers={"r1"}, last_fault_at=5.0, within_s=2.0)
    assert slow.kind == "slow_convergence"


# -- the whole verdict --------------------------------------------------------------------------


def _clean() -> History:
    return History(
        attempts=[ok("a", 0, 1, 0.0, 0.1, "e1"), conflict("b", 0, 0.05, 0.2, 1), ok("b", 1, 2, 0.3, 0.4, "e2")],
        applies=[Apply(r, DOC, rev, 0.1 * rev) for r in ("r1", "r2") for rev in (1, 2)],
        stream={DOC: {1: "e1", 2: "e2"}},
        audit=[Decision("e1", "accepted", None, 1), Decision("e2", "accepted", None, 2)],
        acked_events={"e1", "e2"}, live_routers={"r1", "r2"}, last_fault_at=0.0,
    )


def test_a_clean_history_passes() -> None:
    verdict = check(_clean())
    assert verdict.ok, str(verdict)


def test_a_lost_acknowledged_write_is_reported() -> None:
    h = _clean()
    h.stream = {DOC: {1: "e1"}}  # revision 2 was answered 200 but is not on the stream
    h.applies = [ap for ap in h.applies if ap.revision == 1]
    assert "lost_write" in check(h).kinds()


def test_a_false_not_published_decision_is_reported() -> None:
    h = _clean()
    h.attempts.append(unknown("c", 2, 0.5, "e3"))
    h.stream[DOC][3] = "e3"
    h.applies += [Apply(r, DOC, 3, 0.6) for r in ("r1", "r2")]
    h.audit.append(Decision("e3", "rejected", "not_published"))
    verdict = check(h)
    assert verdict.kinds() == {"false_rejection"}, str(verdict)
    # Retired from the stream, but a router ACKed it: still a false rejection.
    h2 = _clean()
    h2.audit.append(Decision("e0", "rejected", "not_published"))
    h2.acked_events.add("e0")
    assert check(h2).kinds() == {"false_rejection"}


def test_a_non_linearizable_history_fails_the_verdict() -> None:
    h = _clean()
    h.attempts.insert(0, conflict("z", 0, -1.0, -0.5, 1))
    assert check(h).kinds() == {"not_linearizable"}


def test_an_out_of_order_apply_fails_the_verdict() -> None:
    h = _clean()
    h.applies.append(Apply("r1", DOC, 1, 1.0))
    assert "duplicate_apply" in check(h).kinds()
    h = _clean()
    h.applies = [Apply("r1", DOC, 2, 0.1), Apply("r1", DOC, 1, 0.2), Apply("r2", DOC, 1, 0.1),
                 Apply("r2", DOC, 2, 0.2)]
    assert check(h).kinds() == {"out_of_order_apply"}


def test_a_router_one_revision_behind_fails_the_verdict() -> None:
    h = _clean()
    h.applies = [ap for ap in h.applies if not (ap.router == "r2" and ap.revision == 2)]
    assert check(h).kinds() == {"not_converged"}


# -- chats -------------------------------------------------------------------------------------


def test_a_chat_refused_for_another_reason_than_overload_is_reported() -> None:
    chats = [Chat(0.0, 0.1, True, tried=("r1",)), Chat(0.0, 0.1, False, "529 overloaded", tried=("r1",)),
             Chat(0.0, 0.1, False, "429 rate_limited", tried=("r1",)),
             Chat(0.0, 0.2, False, "ReadError", streamed=True, tried=("r2",)),
             Chat(1.0, 1.2, False, "503 no_workers", tried=("r1", "r2", "r3"))]
    [problem] = check_chats(chats)
    assert problem.kind == "chat_failed" and "503 no_workers" in problem.detail
    assert check_chats(chats, unserved=[(0.9, 1.5)]) == []  # no worker or no router was healthy then
    h = History(chats=chats)
    assert check(h).kinds() == {"chat_failed"}
