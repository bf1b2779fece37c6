"""bench/routing_sim.py: the router's pure core in front of mock engines' pure schedulers, on one
virtual clock. A small trace through it checks what the simulation stands for (every request
served, deterministic) and what the time cost does there: later turns go back to the worker that
holds their session, and the router learns that sessions come back (router.returns)."""

from __future__ import annotations

from bench.routing_quality import TraceConfig, build_trace
from bench.routing_sim import Simulation, summarize

TRACE = TraceConfig(sessions=12, session_rate=2.0, seed=3)


def run(mode: str, **selection: float) -> tuple[Simulation, dict[str, object]]:
    sessions = build_trace(TRACE)
    sim = Simulation(mode, selection, [0.1] * 4, kv_delay_s=0.005, hop_s=0.002, seed=1)
    outcomes = sim.run(sessions)
    turns = {(t.session, t.turn): t for s in sessions for t in s.turns}
    assert len(outcomes) == len(turns)  # every turn of every session sent and answered
    assert all(o.done is not None and o.tokens == turns[(o.session, o.turn)].max_tokens for o in outcomes)
    return sim, summarize(outcomes, turns, 0.002)


def test_the_time_cost_keeps_sessions_on_their_cache_and_learns_that_they_come_back() -> None:
    sim, res = run("kv-time")
    outcomes = {(o.session, o.turn): o for o in sim.outcomes}
    later = [o for o in sim.outcomes if o.turn]
    stayed = sum(o.worker == outcomes[(o.session, o.turn - 1)].worker for o in later)
    assert stayed >= 0.9 * len(later)
    assert res["of_oracle"] > 0.95  # type: ignore[operator]
    returns = sim.router.tables.returns
    sessions = build_trace(TRACE)
    assert returns.fraction > 0.6  # 3 to 5 turns a session: about 3 of 4 finished turns come back
    assert 1.0 < returns.delay_s < 4.0  # think time 2 s (exponential), + the hops
    assert 0 < len(returns) <= len(sessions)  # last turns stay open (or expired after 8τ)


def test_the_simulation_is_deterministic_and_tells_the_costs_apart() -> None:
    _, a = run("kv-time")
    _, b = run("kv-time")
    assert a == b
    _, rr = run("round_robin")
    assert rr["of_oracle"] < a["of_oracle"]  # type: ignore[operator]
    assert rr["ttft_mean_ms"] > a["ttft_mean_ms"]  # type: ignore[operator]
