"""A mock worker's advertised timing model (issue 16): its own by default, or the generic prior a
vLLM worker advertises (``RUDDER_MOCK__ADVERTISE_TIMING=generic``), so a heterogeneous pool of
mocks exercises the router's fit as a pool of real GPUs would. No network but the mock's own
HTTP server on a free local port."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from controlplane.protocol.events import (
    DEFAULT_DECODE_MIN_MS,
    DEFAULT_DECODE_MS,
    DEFAULT_PREFILL_MS,
    EngineTiming,
)
from controlplane.protocol.policy import CacheInput
from router.cost.time import DEFAULT_TIMING, Timing
from worker.engines.mock.blocks import KvData
from worker.engines.mock.service import MockEngine
from worker.engines.mock.timing import GENERIC_TIMING, TimingModel, advertised_timing
from worker.settings import AdvertisedTiming, MockEngineSettings, WorkerSettings

pytestmark = pytest.mark.timeout(30)

# What worker/engines/vllm.py advertises, whatever the GPU.
VLLM_PRIOR = EngineTiming(source="vllm-default", prefill_ms=DEFAULT_PREFILL_MS, decode_ms=DEFAULT_DECODE_MS,
                          decode_min_ms=DEFAULT_DECODE_MIN_MS)


def test_by_default_a_mock_advertises_its_own_timing_with_its_speedup() -> None:
    s = MockEngineSettings(speedup_ratio=4.0)
    assert s.advertise_timing is AdvertisedTiming.TRUE
    timing = advertised_timing(s)
    assert timing == TimingModel.from_settings(s).advertised()
    assert timing.source == "mock" and timing.prefill_ms[1] == pytest.approx(s.prefill_b / 4)


def test_generic_advertises_what_a_vllm_worker_does_whatever_its_speed() -> None:
    for speedup in (0.05, 1.0, 1000.0):
        s = MockEngineSettings(speedup_ratio=speedup, advertise_timing=AdvertisedTiming.GENERIC)
        assert advertised_timing(s) == GENERIC_TIMING == VLLM_PRIOR
    # The router's prior for such a worker is the default model, whatever its speed.
    prior = Timing.from_engine(GENERIC_TIMING)
    names = ("p0", "p1", "p2", "d0", "d1", "d2")
    assert [getattr(prior, n) for n in names] == [getattr(DEFAULT_TIMING, n) for n in names]


def test_the_setting_comes_from_the_environment_and_is_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RUDDER_MOCK__ADVERTISE_TIMING", "generic")
    monkeypatch.setenv("RUDDER_MOCK__SPEEDUP_RATIO", "100")
    s = WorkerSettings(model="m")
    assert s.mock.advertise_timing is AdvertisedTiming.GENERIC and s.mock.speedup_ratio == 100
    monkeypatch.setenv("RUDDER_MOCK__ADVERTISE_TIMING", "exact")
    with pytest.raises(ValidationError, match="advertise_timing"):
        WorkerSettings(model="m")


def _sink(dp_rank: int, data: KvData, tier: CacheInput = CacheInput.DEVICE) -> None:
    pass


@pytest.mark.parametrize("mode", list(AdvertisedTiming))
async def test_the_engine_advertises_it_in_its_record(mode: AdvertisedTiming) -> None:
    engine = MockEngine(WorkerSettings(model="m", mock=MockEngineSettings(speedup_ratio=50.0, advertise_timing=mode)))
    info = await engine.start(_sink)
    try:
        assert info.timing == advertised_timing(engine.settings.mock)
        assert (info.timing.source == "vllm-default") is (mode is AdvertisedTiming.GENERIC)
    finally:
        await engine.stop()


def test_a_mock_can_advertise_a_faster_prior_than_it_is() -> None:
    s = MockEngineSettings(speedup_ratio=1.0, advertise_speedup_ratio=100.0)
    assert advertised_timing(s).prefill_ms[1] == pytest.approx(s.prefill_b / 100)
    assert TimingModel.from_settings(s).prefill_ms(512) == pytest.approx(
        TimingModel.from_settings(MockEngineSettings()).prefill_ms(512))
