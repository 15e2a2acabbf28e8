"""The router's pure core: the threshold controller, pools, placement, request parsing and
classification, the circuit breaker and settings. No I/O; time is passed in."""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator
from typing import Any

import pytest

from specgate.engine_client import EngineClient, EngineLoad
from specgate_router import control, placement, proxy, requests
from specgate_router.control import pools
from specgate_router.errors import BadRequest, ModelNotFound
from specgate_router.pods import CircuitBreaker, PodState, Scrape
from specgate_router.settings import (
    ControlSettings,
    ResilienceSettings,
    RouterSettings,
    SettingsError,
    load,
)
from specgate_sim import profile as profiles

PROFILE = profiles.load("rtx-pro-6000-x8")
PARAMS = ControlSettings(hysteresis=0, cooldown_seconds=0)


def test_samples_are_taken_only_from_steady_single_mode_intervals() -> None:
    base = dict(t0=0.0, t1=0.5, tokens0=0.0, tokens1=100.0, steps_on0=0, steps_off0=0)
    good = control.sample_between(batch0=8, batch1=8, steps_on1=20, steps_off1=0, **base)
    assert good is not None and good.speculating_fraction == 1.0 and good.tokens_per_second == 200
    assert control.sample_between(batch0=8, batch1=8, steps_on1=10, steps_off1=10, **base) is None
    assert control.sample_between(batch0=2, batch1=12, steps_on1=0, steps_off1=20, **base) is None
    assert control.sample_between(batch0=0, batch1=0, steps_on1=0, steps_off1=20, **base) is None
    assert control.sample_between(batch0=8, batch1=8, steps_on1=-5, steps_off1=20, **base) is None


def test_a_sample_comes_from_the_engines_per_step_decode_moments() -> None:
    """SGLang's generation-token counter grows only when requests finish, so over a half-second
    scrape it says little; the per-step `decode_moments` of /v1/loads give the tokens and the
    mean batch (here 7, though both scrapes saw 8 running)."""

    def loads(steps: int, batch_sum: int, tokens: int) -> dict[str, Any]:
        return {
            "loads": [
                {
                    "num_running_reqs": 8,
                    "num_waiting_reqs": 0,
                    "max_running_requests": 64,
                    "decode_moments": [steps, batch_sum, 0, 0, 0, tokens],
                    "speculative": {
                        "disable_batch_threshold": 16,
                        "decode_steps_on": steps,
                        "decode_steps_off": 0,
                    },
                }
            ]
        }

    p = PodState(
        "p",
        "http://p",
        EngineClient("http://p", None),  # type: ignore[arg-type]
        control.Decision(16, control.Rule.HOLD, ""),
    )
    p.record(Scrape(10.0, EngineLoad.from_response(loads(100, 800, 2000))))
    p.record(Scrape(10.5, EngineLoad.from_response(loads(150, 1150, 2600))))
    (sample,) = p.samples
    assert sample.batch == 7.0 and sample.tokens_per_second == 1200.0
    assert sample.speculating_fraction == 1.0
    # An engine that has not decoded yet reports null moments: no sample, no error.
    idle = loads(0, 0, 0)
    idle["loads"][0]["decode_moments"] = None
    assert EngineLoad.from_response(idle).decode_tokens == 0.0
    # A scrape interval that held one step (a long prefill ran) is not dropped: the next
    # sample spans it, so the time the prefill took counts against the mode's rate.
    p.record(Scrape(11.0, EngineLoad.from_response(loads(151, 1157, 2608))))
    assert len(p.samples) == 1
    p.record(Scrape(11.5, EngineLoad.from_response(loads(161, 1227, 2688))))
    spanned = p.samples[-1]
    assert spanned.tokens_per_second == pytest.approx(88 / 1.0)  # over both intervals
    assert spanned.batch == pytest.approx(7.0)
    # Beyond SAMPLE_SPAN_SECONDS an interval without steps starts over instead.
    p.record(Scrape(12.0, EngineLoad.from_response(loads(161, 1227, 2688))))
    p.record(Scrape(20.0, EngineLoad.from_response(loads(162, 1234, 2696))))
    p.record(Scrape(20.5, EngineLoad.from_response(loads(172, 1304, 2776))))
    assert p.samples[-1].tokens_per_second == pytest.approx(80 / 0.5)


def test_a_sample_carries_the_decode_step_its_engine_timed_alone() -> None:
    """The engine's uninterrupted-step counters (decode steps right after another decode
    step) give each sample its mode's step time, which the model scales its profile by."""

    def loads(steps: int, timed: int, micros: int) -> dict[str, Any]:
        return {
            "loads": [
                {
                    "num_running_reqs": 8,
                    "num_waiting_reqs": 0,
                    "max_running_requests": 64,
                    "decode_moments": [steps, 8 * steps, 0, 0, 0, 16 * steps],
                    "speculative": {
                        "disable_batch_threshold": 16,
                        "decode_steps_on": steps,
                        "decode_steps_off": 0,
                        "uninterrupted_decode_steps": timed,
                        "uninterrupted_decode_us": micros,
                    },
                }
            ]
        }

    p = PodState(
        "p",
        "http://p",
        EngineClient("http://p", None),  # type: ignore[arg-type]
        control.Decision(16, control.Rule.HOLD, ""),
    )
    p.record(Scrape(10.0, EngineLoad.from_response(loads(100, 90, 900_000))))
    p.record(Scrape(10.5, EngineLoad.from_response(loads(150, 130, 1_380_000))))
    (sample,) = p.samples
    assert sample.step_seconds == pytest.approx(0.012)  # 480 ms over 40 steps timed alone


def test_a_sample_times_its_tokens_by_the_decode_cycles_that_made_them() -> None:
    """Decode steps of 120 ms, each giving 8 requests 4 tokens, scraped every half second: a
    scrape interval holds four steps or five, so against the wall clock its rate reads 256 or
    320 tok/s by where the scrapes fall (a probe of four scrapes once read that alias as a 4%
    difference between the modes). Timed by the steps' own launch-to-launch cycles, every
    sample reads the engine's 266.7."""

    def loads(at: float) -> dict[str, Any]:
        steps = int(at / 0.12)
        return {
            "loads": [
                {
                    "num_running_reqs": 8,
                    "num_waiting_reqs": 0,
                    "max_running_requests": 64,
                    "decode_moments": [steps, 8 * steps, 120_000 * steps, 0, 0, 32 * steps],
                    "speculative": {
                        "disable_batch_threshold": 0,
                        "decode_steps_on": 0,
                        "decode_steps_off": steps,
                    },
                }
            ]
        }

    p = PodState(
        "p",
        "http://p",
        EngineClient("http://p", None),  # type: ignore[arg-type]
        control.Decision(0, control.Rule.HOLD, ""),
    )
    for i in range(21):
        at = 10.01 + 0.5 * i
        p.record(Scrape(at, EngineLoad.from_response(loads(at))))
    rates = [s.tokens_per_second for s in p.samples]
    assert len(rates) == 20
    assert all(r == pytest.approx(32 / 0.12) for r in rates), rates
    # The wall clock's reading of the same intervals, which the samples no longer are.
    wall = {round(32 * (int((10.51 + 0.5 * i) / 0.12) - int((10.01 + 0.5 * i) / 0.12)) / 0.5)
            for i in range(20)}  # fmt: skip
    assert wall == {256, 320}


# ---- pools ----


@pytest.mark.parametrize(
    ("pods", "latency", "throughput", "threshold", "lo", "hi", "expected"),
    [
        (4, 16, 48, 8, 0, 1, 2),  # 16 latency streams need 2 pods at threshold 8
        (4, 8, 80, 8, 0, 1, 1),  # 80 throughput streams need 3 pods at 32 each
        (4, 16, 80, 8, 0, 1, 0),  # 16 latency streams would need 2: no pool at all
        (4, 16, 200, 8, 0, 1, 0),  # heavy throughput load: no pod to spare for latency
        (4, 16, 200, 8, 0.25, 1, 1),  # unless minLatencyFraction keeps one
        (4, 16, 48, 16, 0, 1, 1),
        (4, 0, 48, 8, 0, 1, 0),  # no latency traffic: no latency pool
        (4, 24, 10, 8, 0, 1, 3),  # one pod stays for throughput traffic
        (4, 40, 10, 8, 0, 1, 0),  # 40 latency streams do not fit in the 3 pods left
        (4, 40, 0, 8, 0, 1, 4),  # no throughput traffic: all pods for latency
        (4, 0.5, 10, 8, 0, 1, 1),
        (10, 40, 5, 8, 0.0, 0.5, 5),  # within maxLatencyFraction
        (10, 80, 5, 8, 0.0, 0.5, 0),  # a pool capped below the need is not made
        (10, 0, 50, 8, 0.3, 1.0, 3),  # minLatencyFraction floors it
        (1, 5, 5, 8, 0, 1, 1),
    ],
)
def test_latency_pool_size(
    pods: int,
    latency: float,
    throughput: float,
    threshold: int,
    lo: float,
    hi: float,
    expected: int,
) -> None:
    size = pools.latency_pool_size(
        pods,
        latency,
        throughput,
        threshold=threshold,
        min_fraction=lo,
        max_fraction=hi,
        throughput_batch_per_pod=32,
    )
    assert size == expected


def test_pool_assignment_is_sticky() -> None:
    first = pools.assign_pools(["a", "b", "c", "d"], set(), 2)
    assert first == {"a", "b"}
    assert pools.assign_pools(["a", "b", "c", "d"], {"c", "d"}, 2) == {"c", "d"}
    assert pools.assign_pools(["a", "b", "c", "d"], {"c", "d"}, 1) == {"c"}
    assert pools.assign_pools(["a", "b", "d"], {"c", "d"}, 2) == {"a", "d"}


# ---- placement ----


def settings(**kw: Any) -> RouterSettings:
    return RouterSettings.model_validate({"backends": ["http://x"], **kw})


def pod(
    name: str,
    *,
    running: int = 0,
    threshold: int | None = 8,
    pool: str = "mixed",
    at: float = 100.0,
    healthy: bool = True,
    max_running: int = 64,
) -> PodState:
    load = EngineLoad(
        running=running,
        waiting=0,
        max_running=max_running,
        threshold=threshold,
        threshold_known=True,
    )
    p = PodState(
        name,
        f"http://{name}",
        EngineClient(f"http://{name}", None),  # type: ignore[arg-type]
        control.Decision(threshold, control.Rule.HOLD, ""),
    )
    p.record(Scrape(at, load))
    p.healthy, p.pool = healthy, pool  # type: ignore[assignment]
    return p


def ctx(cls: str = "latency", now: float = 100.5, **kw: Any) -> placement.Context:
    return placement.Context(cls, now, settings(**kw))  # type: ignore[arg-type]


def test_filters_drop_unhealthy_draining_stale_and_open_circuits() -> None:
    sick = pod("sick", healthy=False)
    draining = pod("draining")
    draining.draining = True
    stale = pod("stale", at=90.0)
    broken = pod("broken")
    for _ in range(3):
        broken.breaker.on_failure(100.0, ResilienceSettings())
    good = pod("good")
    choice = placement.choose([sick, draining, stale, broken, good], ctx(), rng=random.Random(0))
    assert choice is good
    none = placement.choose([sick, draining, broken], ctx(), rng=random.Random(0))
    assert isinstance(none, placement.Saturated)
    assert none.reasons == {"healthy": 1, "not-draining": 1, "circuit-closed": 1}


def test_stale_metrics_only_deprioritise() -> None:
    """A pod whose metrics are late still serves when it is the only one that can."""
    stale = pod("stale", at=90.0)
    assert placement.choose([stale], ctx(), rng=random.Random(0)) is stale
    busy_fresh = pod("fresh", running=60)
    assert placement.choose([stale, busy_fresh], ctx(), rng=random.Random(0)) is busy_fresh


def test_latency_traffic_prefers_a_speculating_latency_pod() -> None:
    busy = pod("busy", running=8, pool="latency")  # one more request would stop speculation
    calm = pod("calm", running=2, pool="latency")
    bulk = pod("bulk", running=0, pool="throughput")
    assert placement.choose([busy, calm, bulk], ctx("latency"), rng=random.Random(0)) is calm


def test_latency_traffic_goes_by_load_where_nothing_would_speculate() -> None:
    """An overloaded latency pool does not keep pulling latency traffic it cannot speculate."""
    busy = pod("busy", running=30, pool="latency")
    bulk = pod("bulk", running=12, pool="throughput")
    assert placement.choose([busy, bulk], ctx("latency"), rng=random.Random(0)) is bulk
    spare = pod("spare", running=3, pool="throughput")  # would still speculate
    assert placement.choose([busy, bulk, spare], ctx("latency"), rng=random.Random(0)) is spare


def test_throughput_traffic_prefers_the_throughput_pool_even_when_fuller() -> None:
    calm = pod("calm", running=1, pool="latency")
    bulk = pod("bulk", running=40, pool="throughput")
    assert placement.choose([calm, bulk], ctx("throughput"), rng=random.Random(0)) is bulk


def test_throughput_traffic_fills_a_latency_pods_room_and_no_more() -> None:
    calm = pod("calm", running=2, pool="latency")
    bulk = pod("bulk", running=30, pool="throughput")
    calm.throughput_room, calm.pool_batch = 2, 4
    assert placement.choose([calm, bulk], ctx("throughput"), rng=random.Random(0)) is calm
    calm.throughput_in_flight = 2  # its room is taken: the throughput pool again
    assert placement.choose([calm, bulk], ctx("throughput"), rng=random.Random(0)) is bulk
    # Another router replica filled it: this one sent nothing there, but the pod reports the
    # batch it is sized for, so the room is gone for every replica.
    shared = pod("shared", running=4, pool="latency")
    shared.throughput_room, shared.pool_batch = 2, 4
    assert placement.choose([shared, bulk], ctx("throughput"), rng=random.Random(0)) is bulk


def test_load_breaks_class_ties_and_equal_scores_are_random() -> None:
    a, b = pod("a", running=1), pod("b", running=1)
    picks = {
        placement.choose([a, b], ctx(), rng=random.Random(seed)).name  # type: ignore[union-attr]
        for seed in range(20)
    }
    assert picks == {"a", "b"}
    c = pod("c", running=0)
    assert placement.choose([a, c], ctx(), rng=random.Random(0)) is c


def test_every_plugin_the_resource_can_name_is_registered() -> None:
    from typing import get_args

    from specgate import api

    assert set(placement.FILTERS) == set(get_args(api.FilterName))
    assert set(placement.SCORERS) == set(get_args(api.ScorerName))
    assert set(placement.PICKERS) == set(get_args(api.PickerName))


def test_the_configured_scorers_and_weights_decide() -> None:
    # Latency traffic: class-fit (weight 2 by default) sends it to the speculating pod even
    # though it is fuller; with load alone, the emptier pod wins.
    fits = pod("fits", running=4, threshold=8)
    empty_over = pod("empty-over", running=1, threshold=0)
    assert placement.choose([fits, empty_over], ctx(), rng=random.Random(0)) is fits
    load_only = {"plugins": {"scorers": [{"name": "load", "weight": 1}]}}
    assert (
        placement.choose([fits, empty_over], ctx(**load_only), rng=random.Random(0)) is empty_over
    )


def test_filters_come_from_the_configuration() -> None:
    stale = pod("stale", at=90.0)
    fresh = pod("fresh", running=60)
    assert placement.choose([stale, fresh], ctx(), rng=random.Random(0)) is fresh
    without = {"plugins": {"filters": ["healthy", "not-draining", "circuit-closed"]}}
    assert placement.choose([stale, fresh], ctx(**without), rng=random.Random(0)) is stale


def test_weighted_random_picks_in_proportion_to_the_score() -> None:
    busy, idle = pod("busy", running=48), pod("idle", running=0)
    cfg = {"plugins": {"picker": "weighted-random", "scorers": [{"name": "load", "weight": 1}]}}
    picks = [
        placement.choose([busy, idle], ctx(**cfg), rng=random.Random(seed)).name  # type: ignore[union-attr]
        for seed in range(400)
    ]
    share = picks.count("idle") / len(picks)
    assert 0.72 < share < 0.88  # scores 1.0 and 0.25: 0.8 expected
    maxed = [
        placement.choose([busy, idle], ctx(), rng=random.Random(seed)).name  # type: ignore[union-attr]
        for seed in range(50)
    ]
    assert set(maxed) == {"idle"}


def test_a_configuration_without_the_healthy_filter_is_refused() -> None:
    with pytest.raises(Exception, match="healthy"):
        settings(plugins={"filters": ["not-draining"]})


def test_breaker_opens_then_half_opens_for_one_trial() -> None:
    params = ResilienceSettings(breaker_failures=2, breaker_open_seconds=5)
    b = CircuitBreaker()
    b.on_failure(0.0, params)
    assert b.allows(0.1, params)
    b.on_failure(0.2, params)
    assert not b.allows(1.0, params) and b.state(1.0, params) == "open"
    assert b.allows(5.3, params) and b.state(5.3, params) == "half_open"
    b.on_dispatch(5.3, params)
    assert not b.allows(5.4, params)  # one trial at a time
    b.on_failure(5.5, params)
    assert b.state(6.0, params) == "open"
    b.on_success()
    assert b.state(6.0, params) == "closed"


# ---- requests ----


def test_classification_order() -> None:
    s = settings(
        classRules={"apiKeys": {"batch-key": "throughput"}, "throughputAboveMaxTokens": 1000},
        defaultClass="latency",
    )
    assert requests.classify({"x-specgate-class": "Throughput"}, 10, s) == "throughput"
    assert requests.classify({"authorization": "Bearer batch-key"}, 10, s) == "throughput"
    assert requests.classify({}, 5000, s) == "throughput"
    assert requests.classify({}, 10, s) == "latency"
    with pytest.raises(BadRequest, match="x-specgate-class"):
        requests.classify({"x-specgate-class": "bulk"}, 10, s)


@pytest.mark.parametrize(
    ("path", "body", "fragment"),
    [
        ("/v1/chat/completions", b"{not json", "not valid JSON"),
        ("/v1/chat/completions", b"[1, 2]", "JSON object"),
        ("/v1/chat/completions", b'{"messages": []}', "messages"),
        ("/v1/chat/completions", b'{"messages": [{}], "stream": "yes"}', "stream"),
        ("/v1/chat/completions", b'{"messages": [{}], "max_tokens": 0}', "max_tokens"),
        ("/v1/chat/completions", b'{"messages": [{}], "max_tokens": true}', "max_tokens"),
        ("/v1/completions", b'{"model": "m"}', "prompt"),
        ("/v1/completions", b'{"prompt": "x", "model": 7}', "model"),
        ("/generate", b'{"sampling_params": {}}', "text or input_ids"),
        (
            "/generate",
            b'{"text": "x", "sampling_params": {"max_new_tokens": -1}}',
            "max_new_tokens",
        ),
    ],
)
def test_malformed_requests_are_rejected(path: str, body: bytes, fragment: str) -> None:
    with pytest.raises(BadRequest, match=fragment):
        requests.parse(path, body, {}, settings(model="m"))


def test_unknown_model_is_404() -> None:
    with pytest.raises(ModelNotFound):
        requests.parse(
            "/v1/completions", b'{"model": "other", "prompt": "x"}', {}, settings(model="m")
        )


def test_streams_ask_the_engine_for_usage_and_remember_the_client_did_not() -> None:
    routed = requests.parse(
        "/v1/chat/completions",
        b'{"messages": [{"role": "user", "content": "x"}], "stream": true}',
        {},
        settings(model="m"),
    )
    assert b'"include_usage": true' in routed.body and not routed.client_wants_usage
    body = b'{"prompt": "x", "stream": true, "stream_options": {"include_usage": true}}'
    asked = requests.parse("/v1/completions", body, {}, settings(model="m"))
    assert asked.client_wants_usage


# ---- settings ----


def test_the_operators_router_config_is_valid_router_settings() -> None:
    from specgate import api
    from specgate_operator import render

    from .conftest import minimal_resource

    sdd = api.SpecDecodeDeployment.model_validate(minimal_resource())
    parsed = RouterSettings.model_validate(render.router_config(sdd))
    assert parsed.discovery.kubernetes is not None
    assert parsed.discovery.kubernetes.service == "demo-engine"
    assert parsed.leader_election is not None and parsed.status_target is not None


def test_settings_errors_name_the_field(tmp_path: Any) -> None:
    cfg = tmp_path / "router.yaml"
    cfg.write_text("backends: [http://a]\ncontrol:\n  treshold: 3\n")
    with pytest.raises(SettingsError, match=r"control\.treshold"):
        load(cfg, environ={})
    with pytest.raises(SettingsError, match="no engine pods"):
        load(None, environ={})


def test_engine_key_comes_from_the_environment() -> None:
    s = load(
        None, overrides={"backends": ["http://a"]}, environ={"SPECGATE_ENGINE_API_KEY": "sekret"}
    )
    assert s.engine_api_key == "sekret" and "sekret" not in repr(s)


def test_pooled_samples_are_the_newest_and_bounded() -> None:
    def series(pod: int, n: int) -> list[control.Sample]:
        return [control.Sample(float(t), 4.0 + pod, 100.0, 1.0) for t in range(n)]

    fleet = [series(p, 1200) for p in range(64)]
    pooled = control.pool_samples(fleet, limit=4800)
    assert len(pooled) == 4800
    assert min(s.at for s in pooled) == 1200 - 4800 // 64
    assert control.pool_samples([series(0, 10)]) == series(0, 10)  # fewer than the limit: all
    assert control.pool_samples([]) == []


def _tpot_samples(alpha: float, beta: float, batches: range) -> list[control.Sample]:
    """Speculating samples on the line TPOT(b) = alpha + beta * b (batch / tok/s is TPOT)."""
    return [control.Sample(100.0, float(b), b / (alpha + beta * b), 1.0) for b in batches]


def test_latency_batch_meets_the_tpot_target_from_the_speculating_line() -> None:
    samples = _tpot_samples(0.008, 0.0015, range(1, 7)) * 2  # two scrapes at each batch
    kw = {"now": 100.0, "min_samples": 4}
    # 0.008 + 0.0015 b <= 0.015  <=>  b <= 4.67
    assert pools.latency_batch_for_tpot(samples, threshold=6, target_seconds=0.015, **kw) == 4
    assert pools.latency_batch_for_tpot(samples, threshold=3, target_seconds=0.015, **kw) == 3
    assert pools.latency_batch_for_tpot(samples, threshold=6, target_seconds=0.005, **kw) is None
    flat = _tpot_samples(0.010, 0.0, range(1, 7))
    assert pools.latency_batch_for_tpot(flat, threshold=6, target_seconds=0.015, **kw) == 6
    few = samples[:3]
    assert pools.latency_batch_for_tpot(few, threshold=6, target_seconds=0.015, **kw) is None
    plain = [control.Sample(s.at, s.batch, s.tokens_per_second, 0.0) for s in samples]
    assert pools.latency_batch_for_tpot(plain, threshold=6, target_seconds=0.015, **kw) is None


def test_a_tpot_target_sizes_the_latency_pool() -> None:
    pods = [f"p{i}" for i in range(8)]
    kw = {
        "latency_load": 16.0,
        "throughput_load": 64.0,
        "previous": set(),
        "default_threshold": 8,
        "min_fraction": 0.0,
        "max_fraction": 1.0,
        "throughput_batch_per_pod": 24,
    }
    assert len(pools.plan_latency_pool(pods, [5] * 8, **kw) or ()) == 4  # 16 at 5 per pod
    assert len(pools.plan_latency_pool(pods, [5] * 8, latency_batch=4, **kw) or ()) == 4
    # At 2 per pod the latency traffic needs 8 pods; the throughput traffic leaves 5, so the
    # pool takes the 4 that hold it at the threshold: over the target's batch, but speculated.
    assert len(pools.plan_latency_pool(pods, [5] * 8, latency_batch=2, **kw) or ()) == 4
    # Where the room would run over the threshold too, there is no pool.
    crowded = {**kw, "latency_load": 30.0}
    assert pools.plan_latency_pool(pods, [5] * 8, latency_batch=2, **crowded) == set()
    # A target looser than the threshold changes nothing.
    assert len(pools.plan_latency_pool(pods, [5] * 8, latency_batch=9, **kw) or ()) == 4


def _linear_prediction(tau: float = 3.0) -> control.RateModel:
    """Speculating steps of 3 ms at batch 1 growing 0.1 ms a request (plain: 2 ms flat)."""
    on = [[1, 0.003], [64, 0.003 + 63 * 0.0001]]
    profile = control.StepProfile.from_wire({"on": on, "off": [[1, 0.002], [64, 0.002]]})
    assert profile is not None
    return control.RateModel(profile, tau, "measured")


def test_the_model_predicts_the_batch_that_meets_a_tpot_target() -> None:
    model = _linear_prediction()
    # TPOT(b) = (3 + 0.1 (b - 1)) / 3 ms + 0.2 ms * b: 1.2, 1.43, 1.67, 1.9 ms at b = 1..4
    kw = {"threshold": 64, "target_seconds": 0.0017}
    assert pools.latency_batch_predicted(model, 0.0002, **kw) == 3
    assert pools.latency_batch_predicted(model, 0.0002, threshold=2, target_seconds=0.0017) == 2
    assert pools.latency_batch_predicted(model, 0.0002, threshold=64, target_seconds=0.001) is None
    # Without time between steps only the step grows: (3 + 0.1 (b - 1)) / 3 <= 1.7 up to b = 22
    assert pools.latency_batch_predicted(model, 0.0, **kw) == 22


def test_a_tpot_target_is_met_from_the_model_before_samples_reach_small_batches() -> None:
    # Samples at batch 17 only (a pod under throughput load): the fitted line cannot say.
    flat = _tpot_samples(0.004, 0.0, range(17, 18)) * 8
    kw = {"target_ms": 1.7, "now": 100.0, "min_samples": 4}
    assert pools.latency_batch_for_target(flat, [64, 64], **kw) is None
    model = _linear_prediction()
    models = [(model, 0.0002), (model, 0.0002), (model, 0.0003)]
    assert pools.latency_batch_for_target(flat, [64, 64], models=models, **kw) == 3  # median
    assert pools.latency_batch_for_target(flat, [64], models=[(model, 0.01)], **kw) is None
    assert pools.latency_batch_for_target(flat, [64], target_ms=None, now=100.0, min_samples=4,
                                            models=models) is None  # fmt: skip


def test_a_tpot_target_forms_a_pool_where_spreading_would_miss_it() -> None:
    """2 latency and 32 throughput streams on two pods that speculate up to 64: spread, every
    pod speculates, so without a target there is no pool; a target met only up to batch 3
    takes one pod for the latency traffic, and the throughput traffic fills what it leaves."""
    kw: dict[str, Any] = {
        "latency_load": 2.0,
        "throughput_load": 32.0,
        "previous": set(),
        "default_threshold": 8,
        "min_fraction": 0.0,
        "max_fraction": 1.0,
        "throughput_batch_per_pod": 64,
    }
    assert pools.plan_latency_pool(["a", "b"], [64, 64], **kw) is None
    assert pools.plan_latency_pool(["a", "b"], [64, 64], latency_batch=3, **kw) == {"a"}
    # Spread, 34 requests hold 17 a pod: a target met up to 20 needs no pool.
    assert pools.plan_latency_pool(["a", "b"], [64, 64], latency_batch=20, **kw) is None
    batch = pools.latency_pool_batch([64, 64], default_threshold=8, latency_batch=3)
    assert batch == 3
    assert pools.throughput_room(batch, latency_load=2.0, pool_size=1) == 1
    assert pools.throughput_room(batch, latency_load=5.0, pool_size=1) == 0
    assert pools.throughput_room(8, latency_load=5.0, pool_size=2) == 5
    assert pools.throughput_room(8, latency_load=5.0, pool_size=0) == 0


def test_router_replicas_size_pools_from_the_whole_fleets_load() -> None:
    """Two router replicas each carry half of 2 latency and 32 throughput streams. Alone,
    each sees 17 requests on two pods and forms no pool where one router would; scaled to
    the 34 the pods report (17 of them from the other replica), both see the fleet's mix and
    plan the same pool."""
    half = {"latency": 1.0, "throughput": 16.0}
    fleet = pools.fleet_class_load(half, 17.0)
    assert fleet == {"latency": 2.0, "throughput": 32.0}
    kw: dict[str, Any] = {
        "previous": set(),
        "default_threshold": 8,
        "min_fraction": 0.0,
        "max_fraction": 1.0,
        "throughput_batch_per_pod": 64,
        "latency_batch": 10,  # a TPOT target met up to 10 a pod
    }
    alone = pools.plan_latency_pool(
        ["a", "b"], [64, 64], latency_load=1.0, throughput_load=16.0, **kw
    )
    assert alone is None
    scaled = pools.plan_latency_pool(
        ["a", "b"], [64, 64], latency_load=fleet["latency"],
        throughput_load=fleet["throughput"], **kw,
    )  # fmt: skip
    assert scaled == {"a"}
    # No requests beyond this replica's own: its own counts stand.
    assert pools.fleet_class_load(half, 0.0) == half
    assert pools.fleet_class_load({"latency": 0.0, "throughput": 0.0}, 5.0) == {
        "latency": 0.0, "throughput": 0.0
    }  # fmt: skip


async def test_pods_learn_only_from_siblings_on_the_same_accelerators() -> None:
    """A deployment without a node selector can land on several GPU models. Engines that
    report no step profile share the rates their samples show: pod a's samples of both modes
    move its sibling b on the same accelerators, not pod c on others (nothing predicts its
    rates yet), nor d, idle on the same ones (no batch the move would switch)."""
    from specgate_router.state import RouterState

    params = {"threshold": 8, "minSamples": 2, "probeIntervalSeconds": 0}
    now = [100.0]
    state = RouterState(
        RouterSettings.model_validate(
            {"backends": ["http://a", "http://b", "http://c", "http://d"], "control": params}
        ),
        clock=lambda: now[0],
    )
    state.is_leader = False  # decide, push nothing
    hardware = {"a": "NVIDIA H200", "b": "NVIDIA H200", "c": "NVIDIA L40S", "d": "NVIDIA H200"}
    pods = {p.url.removeprefix("http://"): p for p in state.live_pods()}
    for name, pod_state in pods.items():
        load = EngineLoad(
            running=0 if name == "d" else 8, waiting=0, max_running=64, threshold=8,
            threshold_known=True,
            accelerator=hardware[name], num_accelerators=1,
        )  # fmt: skip
        pod_state.record(Scrape(now[0], load))
        assert pod_state.hardware == (hardware[name], 1)
    # At batch 8 speculating delivers 50 tok/s a request (a trial of it on pod a), plain 60.
    for t in range(3):
        pods["a"].samples.append(control.Sample(90.0 + t, 8.0, 8 * 50.0, 1.0))
        pods["a"].samples.append(control.Sample(93.0 + t, 8.0, 8 * 60.0, 0.0))
    for name in ("b", "c"):
        pods[name].samples.extend(control.Sample(96.0 + t, 8.0, 8 * 50.0, 1.0) for t in range(3))
    await state.control_step()
    moved = pods["a"].decision
    assert moved.model is not None and moved.model.profile.fitted
    assert (pods["b"].decision.rule, pods["b"].decision.threshold) == (control.Rule.MOVE, 0)
    assert pods["c"].decision.rule is control.Rule.NO_MODEL
    assert pods["c"].decision.threshold == 8
    assert pods["d"].decision.threshold == 8 and pods["d"].decision.rule is control.Rule.NO_GAIN
    view = pods["c"].view(now[0], state.settings.control, state.settings.resilience)
    assert view["accelerator"] == {"name": "NVIDIA L40S", "perEngine": 1}
    assert view["rule"] == "no-model"
    # A malformed report is unknown, not an error: pooled with the other unknown pods.
    odd = EngineLoad.from_response(
        {"accelerator": ["x"], "num_accelerators": True, "loads": [
            {"num_running_reqs": 1, "num_waiting_reqs": 0, "max_running_requests": 8}]}
    )  # fmt: skip
    assert (odd.accelerator, odd.num_accelerators) == (None, None)


async def test_the_control_step_lets_the_loop_run_between_pods() -> None:
    """At 64 pods one control step takes about 10 ms; taken at once, every request and scrape
    behind it waits that long. The step decides one pod at a time and lets the loop run
    between them: a callback scheduled before it runs while pods are still undecided, and each
    pod's decision is what `control.step` gives for all of them at once."""
    from specgate_router.state import RouterState

    now = [100.0]
    names = [f"p{i}" for i in range(6)]
    state = RouterState(
        RouterSettings.model_validate(
            {"backends": [f"http://{n}" for n in names], "control": {"minSamples": 2}}
        ),
        clock=lambda: now[0],
    )
    state.is_leader = False
    live = state.live_pods()
    for i, pod_state in enumerate(live):
        pod_state.record(Scrape(now[0], EngineLoad(
            running=4 + 4 * i, waiting=0, max_running=64, threshold=8, threshold_known=True,
        )))  # fmt: skip
        for t in range(3):
            pod_state.samples.append(control.Sample(90.0 + t, 4.0 + 4 * i, 200.0 + 40 * i, 1.0))
            pod_state.samples.append(control.Sample(93.0 + t, 4.0 + 4 * i, 260.0 + 30 * i, 0.0))
    params = state.settings.control
    expected = control.step([p.control_input(now[0], params) for p in live], now=now[0],
                            params=params)  # fmt: skip
    loop = asyncio.get_running_loop()
    turns: list[int] = []  # loop iterations that ran while the step was under way
    stepping = True

    def turn() -> None:
        if stepping:
            turns.append(sum(p.decision in expected for p in live))
            loop.call_soon(turn)

    loop.call_soon(turn)
    await state.control_step()
    stepping = False
    assert [p.decision for p in live] == expected
    assert len(turns) >= len(live) - 1, turns
    assert turns == sorted(turns) and turns[0] < len(live), turns  # pods decided one by one


def test_a_single_router_does_not_read_finished_requests_as_another_replicas() -> None:
    """A wave of requests finishes between a scrape and the next pool update: the pods last
    reported 16 running while this router now has 4 in flight. Those 16 were all its own, so
    the class load stays its own 4 (scaled to 16 it made the latency class need more pods
    than two hold and broke up the pools). Requests the pods report beyond the router's own
    at the moment of the report do count, as another replica's."""
    from specgate_router.state import RouterState

    now = [100.0]
    state = RouterState(
        RouterSettings.model_validate(
            {"backends": ["http://a", "http://b"], "pools": {"classMixWindowSeconds": 0.001}}
        ),
        clock=lambda: now[0],
    )
    pods = list(state.live_pods())
    load = EngineLoad(running=8, waiting=0, max_running=64, threshold=8, threshold_known=True)
    for pod in pods:
        pod.record(Scrape(now[0], load, own_in_flight=8))  # all 16 sent by this router
    state.in_flight_by_class.update(latency=2, throughput=2)  # the rest have finished
    now[0] += 0.5
    state.update_class_load(now[0])
    assert state.class_load == {"latency": 2.0, "throughput": 2.0}
    for pod in pods:
        pod.record(Scrape(now[0], load, own_in_flight=2))  # 8 running, 6 of them another's
    now[0] += 0.5
    state.update_class_load(now[0])
    assert state.class_load == {"latency": 8.0, "throughput": 8.0}  # 4 own + 12 others'


async def _chunks(gaps: list[float], read_timeout: float) -> AsyncIterator[bytes]:
    """An engine's stream: a chunk after each gap; a gap past `read_timeout` ends in the
    TimeoutError the connection's read timeout raises."""
    for gap in gaps:
        if gap > read_timeout:
            await asyncio.sleep(read_timeout)
            raise TimeoutError("read timeout")
        await asyncio.sleep(gap)
        yield b"data: {}\n\n"


async def test_a_stream_ends_at_its_deadline_however_far_its_reads_are_bounded() -> None:
    """The answer deadline holds whether the engine connection's read timeout ends a silent
    read first (it passes through as itself) or the deadline does (_AnswerTooLong), also
    once the deadline comes within a read timeout in the middle of the stream."""
    loop = asyncio.get_running_loop()
    got: list[bytes] = []
    with pytest.raises(TimeoutError) as raised:  # the read timeout, long before the deadline
        async for chunk in proxy._until(_chunks([0.0, 0.0, 9.0], 0.2), loop.time() + 60, 0.2):
            got.append(chunk)
    assert raised.type is TimeoutError and len(got) == 2
    started = loop.time()
    got = []
    with pytest.raises(proxy._AnswerTooLong):  # steady chunks, then the deadline within a read
        async for chunk in proxy._until(_chunks([0.1] * 50, 5.0), started + 0.45, 5.0):
            got.append(chunk)
    assert 0.45 <= loop.time() - started < 0.6 and 3 <= len(got) <= 4
    started = loop.time()
    with pytest.raises(proxy._AnswerTooLong):  # far at first (read timeout 0.3), then near
        async for _ in proxy._until(_chunks([0.2, 0.2, 0.25, 0.25], 0.3), started + 0.5, 0.3):
            pass
    assert 0.5 <= loop.time() - started < 0.65
