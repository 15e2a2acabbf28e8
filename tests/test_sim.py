"""The simulator: calibration against its source figures, the engine's mode switching, and the
HTTP API exercised with the same client code the router uses (`specgate.engine_client`)."""

from __future__ import annotations

import asyncio
import json
import re
import resource
from collections.abc import AsyncIterator

import httpx
import pytest

from specgate import contract
from specgate.engine_client import EngineClient, EngineError
from specgate.engine_http import EngineHttp
from specgate_sim import profile as profiles
from specgate_sim.cluster import SimCluster
from specgate_sim.engine import (
    EngineCore,
    HostSpells,
    SimRequest,
    Step,
    closed_loop_throughput,
)
from specgate_sim.pod import PodSettings

from .conftest import ROOT

PROFILE = profiles.load("rtx-pro-6000-x8")


@pytest.mark.parametrize("name", profiles.available())
def test_profile_reproduces_its_source_figures_within_10_percent(name: str) -> None:
    prof = profiles.load(name)
    assert prof.targets, f"profile {name} names no source figures"
    for target in prof.targets:
        measured = closed_loop_throughput(
            prof,
            target.concurrency,
            threshold=None if target.speculating else 0,
            output_tokens=target.output_tokens,
            prompt_tokens=target.prompt_tokens,
        )
        error = abs(measured - target.tok_s) / target.tok_s
        assert error <= 0.10, f"{name}: {target.what}: {measured:.1f} vs {target.tok_s}"


def test_throughput_curves_cross() -> None:
    """Speculation wins at low concurrency and loses at high: the reason specgate exists."""
    on = {c: closed_loop_throughput(PROFILE, c, threshold=None) for c in (1, 2, 64)}
    off = {c: closed_loop_throughput(PROFILE, c, threshold=0) for c in (1, 2, 64)}
    assert on[1] > 1.5 * off[1] and on[2] > off[2]
    assert off[64] > 1.8 * on[64]
    assert 2 <= PROFILE.crossover_batch() < 16


def test_a_threshold_at_the_crossover_gives_the_better_of_both() -> None:
    best = PROFILE.crossover_batch()
    for c in (1, 4, 16, 64):
        on = closed_loop_throughput(PROFILE, c, threshold=None)
        off = closed_loop_throughput(PROFILE, c, threshold=0)
        switched = closed_loop_throughput(PROFILE, c, threshold=best)
        assert switched >= 0.95 * max(on, off), (c, switched, on, off)


def _run(core: EngineCore, *, until: float) -> float:
    now = 0.0
    while (step := core.plan()) is not None and now < until:
        now += step.duration
        core.finish(step, now)
    return now


def test_engine_speculates_only_at_or_below_the_threshold() -> None:
    core = EngineCore(PROFILE, threshold=2, seed=1)
    for i in range(8):
        core.add(SimRequest(f"r{i}", 16, 400, 0.0))
    _run(core, until=2.0)
    assert core.stats.decode_steps_off > 10 * max(1, core.stats.decode_steps_on)
    core.set_threshold(64)
    before = core.stats.decode_steps_off
    _run(core, until=2.0)
    assert core.stats.decode_steps_off == before and core.stats.decode_steps_on > 10


def test_a_draft_that_accepts_less_further_along_the_chain() -> None:
    """With positionDecay, position j accepts at rate * decay^(j-1): the measured accept length
    follows the chain formula with the decay, while the agreement counted on off steps (the
    first position only) keeps the undecayed rate, times the off-agreement factor. The
    controller's estimate while off must then be calibrated to be right, as on a GPU."""
    decaying = PROFILE.model_copy(
        update={"acceptance": PROFILE.acceptance.model_copy(update={"position_decay": 0.7})}
    )
    rate = decaying.acceptance.per_token_rate
    expected = 1 + rate + rate**2 * 0.7 + rate**3 * 0.7**3
    assert decaying.mean_accept_length() == pytest.approx(expected)
    core = EngineCore(decaying, threshold=None, seed=3)
    for i in range(8):
        core.add(SimRequest(f"r{i}", 16, 100_000, 0.0))
    _run(core, until=10.0)
    assert core.stats.accept_length() == pytest.approx(expected, abs=0.1)
    assert core.stats.accept_length() < PROFILE.mean_accept_length() - 0.3
    core.set_threshold(0)
    core.off_agreement_factor = 0.9
    _run(core, until=10.0)
    agreed = core.stats.draft_first_agreed / core.stats.draft_first_proposed
    assert agreed == pytest.approx(rate * 0.9, abs=0.03)


def test_accept_length_is_not_diluted_by_steps_without_speculation() -> None:
    core = EngineCore(PROFILE, threshold=None, seed=2)
    for i in range(4):
        core.add(SimRequest(f"r{i}", 16, 100_000, 0.0))
    _run(core, until=5.0)
    speculating = core.stats.accept_length()
    assert abs(speculating - PROFILE.mean_accept_length()) < 0.15
    core.set_threshold(0)
    _run(core, until=5.0)
    assert core.stats.decode_steps_off > 100
    assert core.stats.accept_length() == speculating


def test_an_off_step_of_several_tokens_decodes_them_for_one_steps_overhead() -> None:
    """--speculative-off-step-tokens K: K tokens a request per off step (fewer at a request's
    end), for the time of one step's overhead plus K forwards; speculating steps unchanged."""
    deployed = profiles.load("h200-3b-synthetic-deployed")
    one, four = (EngineCore(deployed, threshold=0, seed=5, off_step_tokens=k) for k in (1, 4))
    for core in (one, four):
        core.add(SimRequest("a", 16, 10, 0.0))
        core.add(SimRequest("b", 16, 6, 0.0))
        _run(core, until=1.0)
    assert (one.stats.decode_steps_off, four.stats.decode_steps_off) == (9, 3)  # 10 = 1 + 4 + 4 + 1
    assert one.stats.generation_tokens == four.stats.generation_tokens == 16
    overhead = deployed.step.overhead_s
    forward = deployed.step_time(32, False) - overhead
    assert deployed.step_time(32, False, 4) == pytest.approx(overhead + 4 * forward)
    assert deployed.step_time(32, True, 4) == deployed.step_time(32, True)
    # Closed loop at c = 64: more than plain, by less than four steps' overhead would give.
    plain = closed_loop_throughput(deployed, 64, threshold=0)
    several = closed_loop_throughput(deployed, 64, threshold=0, off_step_tokens=4)
    assert 1.1 * plain < several < 4 * plain
    with pytest.raises(ValueError, match="off_step_tokens 0"):
        EngineCore(deployed, off_step_tokens=0)


def _step(core: EngineCore) -> Step:
    step = core.plan()
    assert step is not None
    core.finish(step, 0.0)
    return step


def test_slow_spells_stretch_the_hosts_part_of_a_step_for_their_share_of_the_time() -> None:
    """HostSpells: a decode step in a slow spell takes the profile's time plus (slowdown - 1)
    times its host part, spells share the time as their means say, and the acceptance draws
    are those of a pod without spells."""
    deployed = profiles.load("h200-3b-synthetic-deployed")
    spells = HostSpells(slowdown=3.0, fast_seconds=0.2, slow_seconds=0.2)
    for on in (True, False):
        noisy, calm = (
            EngineCore(deployed, threshold=None if on else 0, seed=9, host_spells=h)
            for h in (spells, None)
        )
        for core in (noisy, calm):
            for i in range(8):
                core.add(SimRequest(f"r{i}", 16, 10**9, 0.0))
            assert _step(core).kind == "prefill"
        fast = deployed.step_time(8, on)
        slow = fast + 2.0 * deployed.host_time(on)
        in_slow = total = 0.0
        for _ in range(40_000):  # about 1,500 spells
            step, quiet = _step(noisy), _step(calm)
            assert quiet.duration == fast
            assert step.duration in (pytest.approx(fast), pytest.approx(slow))
            assert [n for _, n in step.tokens] == [n for _, n in quiet.tokens]
            total += step.duration
            in_slow += step.duration if step.duration > (fast + slow) / 2 else 0.0
        assert in_slow / total == pytest.approx(0.5, abs=0.05)
    # A speculating step's host part holds its three draft steps' overheads besides its own.
    assert deployed.host_time(True) > deployed.host_time(False) == deployed.step.overhead_s
    # Closed loop: throughput falls by the slow share's stretch; slowdown 1 changes nothing.
    calm_tok_s = closed_loop_throughput(deployed, 8, threshold=None, requests_per_client=200)
    assert (
        closed_loop_throughput(
            deployed, 8, threshold=None, requests_per_client=200, host_spells=HostSpells(1.0)
        )
        == calm_tok_s
    )
    noisy_tok_s = closed_loop_throughput(
        deployed, 8, threshold=None, requests_per_client=200, host_spells=HostSpells(2.0, 0.6, 0.4)
    )
    step_s = deployed.step_time(8, True)
    expected = 0.6 + 0.4 * step_s / (step_s + deployed.host_time(True))
    assert noisy_tok_s / calm_tok_s == pytest.approx(expected, abs=0.05)
    for bad in ("0.5", "2:3", "x", "2:0:4"):
        with pytest.raises(ValueError):
            HostSpells.parse(bad)
    assert HostSpells.parse("1.5") == HostSpells(1.5, 6.0, 4.0)


def test_waiting_queue_and_running_cap() -> None:
    core = EngineCore(PROFILE, threshold=0, seed=3, max_running_requests=4)
    for i in range(10):
        core.add(SimRequest(f"r{i}", 16, 50, 0.0))
    step = core.plan()
    assert step is not None and step.kind == "prefill" and step.batch == 4
    assert len(core.waiting) == 6 and len(core.running) == 4


# ---- over HTTP ----

KEY = "test-key"


@pytest.fixture
async def pods() -> AsyncIterator[SimCluster]:
    settings = PodSettings(api_key=KEY, threshold=8, time_scale=20.0, seed=7, model="sim-llama")
    async with SimCluster(PROFILE, 2, settings=settings) as cluster:
        yield cluster


@pytest.fixture
async def http() -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(timeout=10) as client:
        yield client


async def test_control_contract_set_and_read_back(
    pods: SimCluster, http: httpx.AsyncClient, engine_http: EngineHttp
) -> None:
    engine = EngineClient(pods.urls[0], engine_http, api_key=KEY)
    assert await engine.threshold() == 8
    await engine.set_threshold(3)
    assert await engine.threshold() == 3
    metrics = await engine.metrics()
    assert metrics[contract.METRIC_THRESHOLD] == 3.0
    load = await engine.loads()
    assert load.threshold == 3 and load.threshold_known
    await engine.set_threshold(None)
    assert await engine.threshold() is None
    assert (await engine.metrics())[contract.METRIC_THRESHOLD] == -1.0
    # The other pod was not touched.
    assert await EngineClient(pods.urls[1], engine_http, api_key=KEY).threshold() == 8


@pytest.mark.parametrize(
    "bad",
    [-1, 2.5, "4", True, [3]],
    ids=["negative", "float", "string", "bool", "list"],
)
async def test_control_contract_rejects_bad_values_with_400(
    bad: object, pods: SimCluster, http: httpx.AsyncClient, engine_http: EngineHttp
) -> None:
    resp = await http.post(
        pods.urls[0] + "/set_internal_state",
        json={"server_args": {contract.THRESHOLD_KEY: bad}},
        headers={"Authorization": f"Bearer {KEY}"},
    )
    assert resp.status_code == 400
    assert contract.THRESHOLD_KEY in resp.json()["message"]
    assert await EngineClient(pods.urls[0], engine_http, api_key=KEY).threshold() == 8


async def test_control_contract_rejects_unknown_keys(
    pods: SimCluster, http: httpx.AsyncClient
) -> None:
    resp = await http.post(
        pods.urls[0] + "/set_internal_state",
        json={"server_args": {"pp_max_micro_batch_size": 4}},
        headers={"Authorization": f"Bearer {KEY}"},
    )
    assert resp.status_code == 400 and "pp_max_micro_batch_size" in resp.json()["message"]


async def test_api_key_is_enforced_except_health_and_metrics(
    pods: SimCluster, http: httpx.AsyncClient, engine_http: EngineHttp
) -> None:
    url = pods.urls[0]
    assert (await http.get(url + "/server_info")).status_code == 401
    wrong = {"Authorization": "Bearer nope"}
    assert (await http.post(url + "/set_internal_state", json={}, headers=wrong)).status_code == 401
    assert (await http.get(url + "/health")).status_code == 200
    assert (await http.get(url + "/health_generate")).status_code == 200
    assert (await http.get(url + "/metrics")).status_code == 200
    with pytest.raises(EngineError) as info:
        await EngineClient(url, engine_http, api_key="wrong").set_threshold(1)
    assert info.value.status == 401


async def test_metrics_parse_with_prometheus_parser(
    pods: SimCluster, http: httpx.AsyncClient, engine_http: EngineHttp
) -> None:
    engine = EngineClient(pods.urls[0], engine_http, api_key=KEY)
    await engine.set_threshold(0)
    headers = {"Authorization": f"Bearer {KEY}"}
    body = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 20}}
    resp = await http.post(pods.urls[0] + "/generate", json=body, headers=headers)
    assert resp.status_code == 200
    metrics = await engine.metrics()
    assert metrics["sglang:generation_tokens_total"] == 20
    assert metrics["sglang:num_requests_total"] == 1
    assert metrics["sglang:prompt_tokens_total"] == 3
    assert metrics["sglang:spec_decode_steps_total{mode=off}"] == 19
    # The per-step sums SGLang 0.5.17 reports in /v1/loads: 19 decode steps at batch 1.
    loads = (await http.get(pods.urls[0] + "/v1/loads?include=core", headers=headers)).json()
    steps, batch, step_us, _, _, generated = loads["loads"][0]["decode_moments"]
    assert (steps, batch, generated) == (19, 19, 19) and step_us > 0
    assert metrics["sglang:spec_decode_steps_total{mode=on}"] == 0
    assert metrics["sglang:time_to_first_token_seconds_count"] == 1
    for name in (
        "sglang:num_running_reqs",
        "sglang:num_queue_reqs",
        "sglang:gen_throughput",
        "sglang:token_usage",
        "sglang:spec_accept_length",
    ):
        assert name in metrics


async def test_loads_shape(pods: SimCluster, http: httpx.AsyncClient) -> None:
    resp = await http.get(
        pods.urls[0] + "/v1/loads?include=core,spec", headers={"Authorization": f"Bearer {KEY}"}
    )
    data = resp.json()
    assert set(data) >= {"timestamp", "version", "accelerator", "num_accelerators", "loads"}
    load = data["loads"][0]
    assert {"num_running_reqs", "num_waiting_reqs", "max_running_requests"} <= set(load)
    assert {"accept_length", "accept_rate"} <= set(load["speculative"])
    core_only = await http.get(
        pods.urls[0] + "/v1/loads?include=core", headers={"Authorization": f"Bearer {KEY}"}
    )
    assert "speculative" not in core_only.json()["loads"][0]
    bad = await http.get(
        pods.urls[0] + "/v1/loads?include=bogus", headers={"Authorization": f"Bearer {KEY}"}
    )
    assert bad.status_code == 400


async def test_generate_stream_and_openai_shapes(pods: SimCluster, http: httpx.AsyncClient) -> None:
    headers = {"Authorization": f"Bearer {KEY}"}
    url = pods.urls[0]
    async with http.stream(
        "POST",
        url + "/generate",
        json={"text": "hello there", "sampling_params": {"max_new_tokens": 12}, "stream": True},
        headers=headers,
    ) as resp:
        events = [line async for line in resp.aiter_lines() if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]"
    last = json.loads(events[-2][6:])
    assert last["meta_info"]["completion_tokens"] == 12
    assert last["meta_info"]["finish_reason"] == {"type": "length", "length": 12}

    resp = await http.post(
        url + "/v1/chat/completions",
        json={
            "model": "sim-llama",
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 5,
        },
        headers=headers,
    )
    chat = resp.json()
    assert chat["object"] == "chat.completion"
    assert chat["choices"][0]["message"]["role"] == "assistant"
    assert chat["usage"]["completion_tokens"] == 5

    async with http.stream(
        "POST",
        url + "/v1/completions",
        json={
            "model": "sim-llama",
            "prompt": "x",
            "max_tokens": 7,
            "stream": True,
            "stream_options": {"include_usage": True},
        },
        headers=headers,
    ) as resp:
        chunks = [line[6:] async for line in resp.aiter_lines() if line.startswith("data: ")]
    assert chunks[-1] == "[DONE]"
    usage = json.loads(chunks[-2])["usage"]
    assert usage["completion_tokens"] == 7
    text = "".join(json.loads(c)["choices"][0]["text"] for c in chunks[:-2])
    assert len(text.split()) == 7

    models = (await http.get(url + "/v1/models", headers=headers)).json()
    assert models["data"][0]["id"] == "sim-llama"


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/generate", {"sampling_params": {"max_new_tokens": 3}}),
        ("/generate", {"text": "x", "sampling_params": {"max_new_tokens": 0}}),
        ("/v1/chat/completions", {"messages": []}),
        ("/v1/completions", {"prompt": {"not": "text"}}),
        ("/v1/completions", {"prompt": "x", "max_tokens": -5}),
    ],
)
async def test_malformed_requests_get_400_with_a_message(
    path: str, body: dict[str, object], pods: SimCluster, http: httpx.AsyncClient
) -> None:
    resp = await http.post(
        pods.urls[0] + path, json=body, headers={"Authorization": f"Bearer {KEY}"}
    )
    assert resp.status_code == 400 and resp.json()["message"]


async def test_threshold_switches_mode_under_load(
    pods: SimCluster, http: httpx.AsyncClient, engine_http: EngineHttp
) -> None:
    engine = EngineClient(pods.urls[0], engine_http, api_key=KEY)
    await engine.set_threshold(2)
    headers = {"Authorization": f"Bearer {KEY}"}

    async def one() -> None:
        body = {"input_ids": [1] * 8, "sampling_params": {"max_new_tokens": 200}}
        (await http.post(pods.urls[0] + "/generate", json=body, headers=headers)).raise_for_status()

    await asyncio.gather(*(one() for _ in range(8)))
    load = await engine.loads()
    assert load.decode_steps_off is not None and load.decode_steps_on is not None
    # 8 running > threshold 2: nearly all steps without speculation (only the drain speculates).
    assert load.decode_steps_off > 5 * load.decode_steps_on


async def test_idle_pods_do_not_burn_cpu() -> None:
    settings = PodSettings(threshold=8, time_scale=1.0)
    async with SimCluster(PROFILE, 40, settings=settings):
        await asyncio.sleep(0.3)
        before = resource.getrusage(resource.RUSAGE_SELF)
        await asyncio.sleep(2.0)
        after = resource.getrusage(resource.RUSAGE_SELF)
    used = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    assert used < 0.5, f"40 idle pods used {used:.2f} CPU-seconds in 2 s"


async def test_fast_counter_scan_agrees_with_the_prometheus_parser(
    pods: SimCluster, http: httpx.AsyncClient
) -> None:
    from specgate.engine_client import counter_total, parse_metrics

    headers = {"Authorization": f"Bearer {KEY}"}
    body = {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 33}}
    await http.post(pods.urls[0] + "/generate", json=body, headers=headers)
    text = (await http.get(pods.urls[0] + "/metrics")).text
    full = parse_metrics(text)
    for name in ("sglang:generation_tokens_total", "sglang:num_requests_total"):
        assert counter_total(text, name) == full[name] > 0
    assert counter_total(text, "sglang:no_such_metric") == 0.0
    assert counter_total('x_total{a="1"} 2\nx_total{a="2"} 3.5\nx_totals 9\n', "x_total") == 5.5


async def test_flush_cache_only_when_idle(
    pods: SimCluster, http: httpx.AsyncClient, engine_http: EngineHttp
) -> None:
    """SGLang's /flush_cache: 400 while requests run, 200 once idle, waiting up to ?timeout
    seconds for that (lab/bench/gpu_envelope.py --flush-cache calls it between windows)."""
    headers = {"Authorization": f"Bearer {KEY}"}
    url = pods.urls[0]
    body = {"input_ids": [1] * 8, "sampling_params": {"max_new_tokens": 400}}
    running = asyncio.create_task(http.post(url + "/generate", json=body, headers=headers))
    while not (await EngineClient(url, engine_http, api_key=KEY).loads()).running:
        await asyncio.sleep(0.01)
    busy = await http.post(url + "/flush_cache", headers=headers)
    assert busy.status_code == 400 and "pending requests" in busy.text
    waited = await http.post(url + "/flush_cache?timeout=30", headers=headers)
    # It waited for the engine to go idle (the response may still be on its way to the client).
    assert waited.status_code == 200
    assert (await EngineClient(url, engine_http, api_key=KEY).loads()).running == 0
    (await running).raise_for_status()
    assert (await http.post(url + "/flush_cache", headers={})).status_code == 401


async def test_a_pod_with_several_token_off_steps_says_so_and_streams_them(
    http: httpx.AsyncClient,
) -> None:
    """`specgate sim --off-step-tokens 4` as the operator's `offStepTokens: 4` runs SGLang: the
    pod reports the setting where SGLang's server args do, and an off pod decodes four tokens
    a request per step."""
    settings = PodSettings(threshold=0, time_scale=20.0, seed=3, off_step_tokens=4)
    async with SimCluster(PROFILE, 1, settings=settings) as cluster:
        info = (await http.get(cluster.urls[0] + "/server_info")).json()
        assert info["speculative_off_step_tokens"] == 4
        body = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 13}}
        resp = await http.post(cluster.urls[0] + "/generate", json=body)
        assert resp.status_code == 200, resp.text
        meta = resp.json()["meta_info"]
        assert meta["completion_tokens"] == 13
    assert cluster.pods[0].core.stats.decode_steps_off == 3  # 1 from the prefill, then 4 + 4 + 4


@pytest.mark.parametrize("name", profiles.available())
def test_a_profile_cites_files_that_exist(name: str) -> None:
    """Every repository path a profile's source names exists (globs match something)."""
    source = profiles.load(name).source
    cited = re.findall(r"\b((?:lab|sim|worker-image)/[\w./*-]+\w|README\.md)", source)
    assert cited, source
    for path in cited:
        assert list(ROOT.glob(path)), f"{name} cites {path}, which does not exist"


# ---- what the router's prediction reads ----


def _closed_loop(core: EngineCore, clients: int, seconds: float) -> None:
    now, issued = 0.0, 0

    def submit() -> None:
        nonlocal issued
        issued += 1
        req = SimRequest(f"r{issued}", 64, 200, now)
        req.sink = lambda n, done: submit() if done else None
        core.add(req)

    for _ in range(clients):
        submit()
    while now < seconds and (step := core.plan()) is not None:
        now += step.duration
        core.finish(step, now)


def test_off_steps_count_the_drafts_first_position_agreement() -> None:
    """While off, the draft's proposal agrees with the target's token at the workload's
    per-token rate; the speculating draws are the ones they were without this count."""
    core = EngineCore(PROFILE, threshold=0, seed=3)
    core.set_acceptance(0.7)
    _closed_loop(core, 16, 30.0)
    stats = core.stats
    assert stats.decode_steps_on == 0 and stats.draft_first_proposed > 5000
    assert stats.draft_first_agreed / stats.draft_first_proposed == pytest.approx(0.7, abs=0.02)
    assert stats.live_accept_length() is None  # no stale figure while off
    on = EngineCore(PROFILE, threshold=None, seed=3)
    on.set_acceptance(0.7)
    _closed_loop(on, 4, 30.0)
    assert on.stats.draft_first_proposed == 0
    assert on.stats.spec_first_agreed / on.stats.spec_request_steps == pytest.approx(0.7, abs=0.03)
    assert on.stats.live_accept_length() == pytest.approx(1 + 0.7 + 0.7**2 + 0.7**3, abs=0.08)


def test_decode_step_time_counts_prefills_in_the_moments_and_not_in_the_uninterrupted_steps() -> (
    None
):
    """As in SGLang, a decode step's moment is the interval from the previous decode step's
    start, so a prefill between them counts; the uninterrupted-step counters leave those
    intervals out and hold only decode steps' own time."""
    core = EngineCore(PROFILE, threshold=None, seed=1)
    now, prefills, decodes = 0.0, [], []
    for name in ("a", "b"):
        core.add(SimRequest(name, 64, 40, now))
        for expected in ("prefill", "decode", "decode", "decode"):
            step = core.plan()
            assert step is not None and step.kind == expected
            (prefills if expected == "prefill" else decodes).append(step.duration)
            now += step.duration
            core.finish(step, now)
    stats = core.stats
    # Six decode steps. The first counts its own time; b's first, after b's prefill, counts
    # a's last step and the prefill; each other one the step before it.
    a1, a2, a3, b1, b2, _ = decodes
    assert stats.decode_moments[0] == 6
    assert stats.decode_moments[2] == pytest.approx(
        1e6 * (a1 + a1 + a2 + a3 + prefills[1] + b1 + b2)
    )
    assert stats.uninterrupted_decode_steps == 4
    assert stats.uninterrupted_decode_us == pytest.approx(1e6 * (a1 + a2 + b1 + b2))


def test_set_acceptance_changes_the_workload_from_the_next_step() -> None:
    core = EngineCore(PROFILE, threshold=None, seed=1)
    _closed_loop(core, 4, 20.0)
    before = core.stats.accept_length()
    core.set_acceptance(0.2)
    steps, accepted = core.stats.spec_request_steps, core.stats.spec_accepted_tokens
    _closed_loop(core, 4, 20.0)
    after = (core.stats.spec_accepted_tokens - accepted) / (core.stats.spec_request_steps - steps)
    assert before > 2.5 and 1 + after == pytest.approx(1.25, abs=0.05)
    with pytest.raises(ValueError, match="a rate in"):
        core.set_acceptance(1.5)


@pytest.mark.parametrize("model_inputs", [True, False])
async def test_loads_carry_the_step_profile_in_wall_clock_seconds(
    model_inputs: bool, http: httpx.AsyncClient
) -> None:
    settings = PodSettings(time_scale=20.0, seed=1, model_inputs=model_inputs)
    async with SimCluster(PROFILE, 1, settings=settings) as cluster:
        spec = (await http.get(cluster.urls[0] + "/v1/loads?include=spec")).json()["loads"][0][
            "speculative"
        ]
    if not model_inputs:
        assert contract.STEP_PROFILE not in spec
        assert not set(contract.ACCEPTANCE_COUNTERS) & set(spec)
        return
    profile = spec[contract.STEP_PROFILE]
    batches = [b for b, _ in profile["on"]]
    assert batches == sorted(batches) and batches[0] == 1
    for b, seconds in profile["on"]:
        assert seconds == pytest.approx(PROFILE.step_time(b, True) / 20.0)
    for b, seconds in profile["off"]:
        assert seconds == pytest.approx(PROFILE.step_time(b, False) / 20.0)
    assert spec["num_steps"] == PROFILE.num_steps and spec["off_step_tokens"] == 1
    assert set(contract.ACCEPTANCE_COUNTERS) <= set(spec)
    assert spec["accept_length"] is None  # an idle pod has not speculated lately


class _WitnessLock:
    """A lock that records who held it and whether two ever held it at once."""

    def __init__(self) -> None:
        self.inner = asyncio.Lock()
        self.holding = 0
        self.most_at_once = 0
        self.steps = 0

    async def __aenter__(self) -> None:
        await self.inner.acquire()
        self.holding += 1
        self.most_at_once = max(self.most_at_once, self.holding)
        self.steps += 1

    async def __aexit__(self, *exc: object) -> None:
        self.holding -= 1
        self.inner.release()


async def _decode_on_both(cluster: SimCluster, tokens: int) -> None:
    async def one(pod_index: int) -> None:
        async for _ in cluster.pods[pod_index].generate(8, tokens):
            pass

    await asyncio.gather(*(one(i) for i in (0, 1) for _ in range(3)))


async def test_pods_on_a_shared_gpu_take_turns_step_by_step() -> None:
    """`--gpus N`: pod i on simulated GPU i mod N, and the pods of one GPU never step at the
    same time; by default each pod has its own."""
    settings = PodSettings(threshold=None, time_scale=50.0, seed=3)
    async with SimCluster(PROFILE, 2, settings=settings, gpus=1) as cluster:
        gpu = cluster.pods[0].gpu
        assert gpu is not None and cluster.pods[1].gpu is gpu
        witness = _WitnessLock()
        gpu.lock = witness  # type: ignore[assignment]
        await _decode_on_both(cluster, 40)
        assert witness.most_at_once == 1 and witness.steps >= 2 * 40 // 8
    async with SimCluster(PROFILE, 4, settings=settings, gpus=2) as cluster:
        first, second, third, fourth = (pod.gpu for pod in cluster.pods)
        assert first is third and second is fourth and first is not second
    async with SimCluster(PROFILE, 2, settings=settings) as cluster:
        assert cluster.pods[0].gpu is None and cluster.pods[1].gpu is None
