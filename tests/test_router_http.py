"""The router over real HTTP in front of simulated pods."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import re
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
import yaml

from specgate.engine_client import EngineClient
from specgate.engine_http import EngineHttp
from specgate_router import replay
from specgate_router.control import Rule
from specgate_router.pods import public_id
from specgate_router.settings import ControlSettings
from specgate_sim import profile as profiles
from specgate_sim.cluster import SimCluster
from specgate_sim.pod import PodSettings

from .router_harness import (
    FaultyEngineHttp,
    is_error_event,
    run_router,
    stream_events,
)

pytestmark = pytest.mark.integration
PROFILE = profiles.load("rtx-pro-6000-x8")
KEY = "engine-key"
CHAT = "/v1/chat/completions"


def chat(max_tokens: int = 16, stream: bool = False, **extra: object) -> dict[str, object]:
    return {
        "model": "m",
        "messages": [{"role": "user", "content": "hello"}],
        "max_tokens": max_tokens,
        "stream": stream,
        **extra,
    }


def router_settings(urls: list[str], **extra: object) -> dict[str, object]:
    return {
        "model": "m",
        "backends": urls,
        "engineApiKey": KEY,
        "control": {
            "scrapeIntervalSeconds": 0.1,
            "staleAfterSeconds": 0.6,
            "staggerSeconds": 0,
            "cooldownSeconds": 0,
        },
        "resilience": {"backoffBaseSeconds": 0.01, "breakerOpenSeconds": 1.0},
        **extra,
    }


@pytest.fixture
async def http() -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(timeout=30) as client:
        yield client


@contextlib.asynccontextmanager
async def closed_loop(
    http: httpx.AsyncClient, url: str, clients: int, body: dict[str, object]
) -> AsyncIterator[list[int]]:
    """`clients` clients, each posting `body` to `url` again as soon as its answer is in, until
    the block ends (their requests in flight then finish first); yields the answers' status
    codes as they come. A client's exception surfaces when the block ends."""
    stop = asyncio.Event()
    statuses: list[int] = []

    async def client() -> None:
        while not stop.is_set():
            statuses.append((await http.post(url, json=body)).status_code)

    tasks = [asyncio.create_task(client()) for _ in range(clients)]
    try:
        yield statuses
    finally:
        stop.set()
        await asyncio.gather(*tasks)


def sims(
    count: int = 2,
    time_scale: float = 10.0,
    threshold: int | None = 8,
    model_inputs: bool = True,
) -> SimCluster:
    settings = PodSettings(
        api_key=KEY,
        threshold=threshold,
        time_scale=time_scale,
        model="m",
        seed=3,
        model_inputs=model_inputs,
    )
    return SimCluster(PROFILE, count, settings=settings)


async def test_streaming_passes_chunk_by_chunk(http: httpx.AsyncClient) -> None:
    async with (
        sims(1, time_scale=1.0, threshold=0) as pods,
        run_router(router_settings(pods.urls)) as r,
    ):
        status, events = await stream_events(http, r.url + CHAT, chat(max_tokens=40, stream=True))
    assert status == 200 and events[-1][1] == "[DONE]"
    content = [(t, e) for t, e in events if e != "[DONE]"]
    assert len(content) >= 40  # one event per decode step (no speculation: one token each)
    # The first token reached the client long before the last was produced (~20 ms a step).
    assert content[-1][0] - content[1][0] > 0.4
    # The usage chunk the router asked for was not passed to a client that did not ask.
    assert all("usage" not in json.loads(e) for _, e in content)


async def test_threshold_is_pushed_and_read_back(
    http: httpx.AsyncClient, engine_http: EngineHttp
) -> None:
    async with sims(2) as pods:
        settings = router_settings(pods.urls)
        settings["control"] = {**settings["control"], "mode": "off"}  # type: ignore[dict-item]
        async with run_router(settings) as r:
            for _ in range(100):
                values = [
                    await EngineClient(u, engine_http, api_key=KEY).threshold() for u in pods.urls
                ]
                if values == [0, 0]:
                    break
                await asyncio.sleep(0.05)
            assert values == [0, 0]
            view = (await http.get(r.url + "/specgate/pods")).json()
            assert [p["threshold"] for p in view["pods"]] == [0, 0]
            metrics = (await http.get(r.url + "/metrics")).text
            assert 'specgate_threshold_changes_total{direction="lower"' in metrics


async def test_control_and_access_lines_come_on_loggers_of_their_own(
    http: httpx.AsyncClient, caplog: pytest.LogCaptureFixture
) -> None:
    """A threshold change is logged with its reason on specgate.router, a proxied request on
    specgate.router.access, which `--no-access-log` silences (a GPU benchmark keeps the first
    without paying for the second)."""
    caplog.set_level(logging.INFO, logger="specgate.router")
    async with sims(1) as pods:
        settings = router_settings(pods.urls)
        settings["control"] = {**settings["control"], "mode": "off"}  # type: ignore[dict-item]
        async with run_router(settings) as r:
            assert (await http.post(r.url + CHAT, json=chat())).status_code == 200
            for _ in range(100):
                if any(
                    rec.name == "specgate.router" and "threshold of" in rec.getMessage()
                    for rec in caplog.records
                ):
                    break
                await asyncio.sleep(0.05)
    control = [rec.getMessage() for rec in caplog.records if rec.name == "specgate.router"]
    assert any("-> 0 (fixed: control.mode off)" in line for line in control), control
    access = [rec for rec in caplog.records if rec.name == "specgate.router.access"]
    assert [rec.getMessage() for rec in access] == ["request done"]
    assert access[0].__dict__["status"] == 200


def test_no_access_log_silences_requests_and_keeps_control(monkeypatch: pytest.MonkeyPatch) -> None:
    from specgate_router import main

    parser = argparse.ArgumentParser()
    main.add_arguments(parser)
    args = parser.parse_args(["--backend", "http://127.0.0.1:9", "--model", "m", "--no-access-log"])
    monkeypatch.setattr(main.uvicorn, "run", lambda app, **kwargs: None)
    access = logging.getLogger("specgate.router.access")
    try:
        assert main.run(args) == 0
        assert not access.isEnabledFor(logging.INFO)
        assert logging.getLogger("specgate.router").isEnabledFor(logging.INFO)
    finally:
        access.setLevel(logging.NOTSET)


async def test_latency_and_throughput_traffic_go_to_their_pools(http: httpx.AsyncClient) -> None:
    """Closed-loop clients of both classes (16, twice what two pods at threshold 4 hold, so the
    margin survives a slow machine) make the router split them into pools; once requests
    placed before the split have finished, each class runs on its own pool. Threshold pinned
    at 4: the latency pod speculates its 2 clients' requests. The class mix is smoothed over a
    second: over 0.3 s a moment when most requests had just finished (20 tokens each, so they
    finish together) left the smoothed load under what two pods hold, and the pools read at
    3 s were "mixed" in about one run in five."""
    async with sims(2, time_scale=2.0, threshold=4) as pods:
        settings = router_settings(pods.urls, pools={"classMixWindowSeconds": 1.0})
        settings["control"] = {
            **settings["control"],
            "threshold": 4,  # type: ignore[dict-item]
            "minThreshold": 4,
            "maxThreshold": 4,
        }
        async with run_router(settings) as r:
            placed: list[tuple[float, str, str]] = []
            stop_at = asyncio.get_running_loop().time() + 4.0

            async def client(cls: str) -> None:
                loop = asyncio.get_running_loop()
                while loop.time() < stop_at:
                    resp = await http.post(
                        r.url + CHAT, json=chat(20), headers={"x-specgate-class": cls}
                    )
                    assert resp.status_code == 200
                    placed.append((loop.time(), cls, resp.headers["x-specgate-pod"]))

            clients = [
                asyncio.create_task(client(c)) for c in ("latency",) * 2 + ("throughput",) * 14
            ]
            await asyncio.sleep(3.0)  # read the pools while the load stands
            view = (await http.get(r.url + "/specgate/pods")).json()
            await asyncio.gather(*clients)
            pools = {p["id"]: p["pool"] for p in view["pods"]}
            assert sorted(pools.values()) == ["latency", "throughput"]
            late = [(cls, pod) for at, cls, pod in placed if at > stop_at - 2.0]
            assert late and {cls for cls, _ in late} == {"latency", "throughput"}
            at_home = sum(pools[pod] == cls for cls, pod in late)
            assert at_home / len(late) >= 0.8, late  # class-blind placement gives about 0.5


async def test_stale_metrics_stop_pushes_and_deprioritise_the_pod(
    http: httpx.AsyncClient, engine_http: EngineHttp
) -> None:
    async with sims(2) as pods:
        blind = pods.urls[0]
        silent = FaultyEngineHttp(  # the blind pod's scrapes time out; all else gets through
            lambda method, url: url.startswith(blind + "/v1/loads") or url == blind + "/metrics",
            error=TimeoutError,
        )
        settings = router_settings(pods.urls)
        settings["control"] = {**settings["control"], "mode": "off"}  # type: ignore[dict-item]
        async with run_router(settings, engine_http=silent) as r:
            await asyncio.sleep(0.5)
            for _ in range(6):
                resp = await http.post(r.url + CHAT, json=chat(4))
                assert resp.status_code == 200
                assert resp.headers["x-specgate-pod"] == public_id(pods.urls[1].split("://")[1])
            assert (
                await EngineClient(blind, engine_http, api_key=KEY).threshold() == 8
            )  # never pushed
            assert await EngineClient(pods.urls[1], engine_http, api_key=KEY).threshold() == 0
            view = {p["url"]: p for p in (await http.get(r.url + "/specgate/pods")).json()["pods"]}
            assert view[blind]["fresh"] is False and view[blind]["healthy"] is True


async def test_a_pod_killed_under_load_loses_no_request(http: httpx.AsyncClient) -> None:
    async with sims(2, time_scale=4.0) as pods, run_router(router_settings(pods.urls)) as r:

        async def one(i: int) -> str:
            status, events = await stream_events(
                http,
                r.url + CHAT,
                chat(max_tokens=120, stream=True),
                headers={"x-request-id": f"req-{i}"},
            )
            if status != 200:
                return f"http-{status}"
            if any(is_error_event(e) for _, e in events):
                assert events[-1][1] == "[DONE]"  # a clean end, not a hang
                return "error-event"
            return "ok" if events[-1][1] == "[DONE]" else "truncated"

        tasks = [asyncio.create_task(one(i)) for i in range(24)]
        await asyncio.sleep(0.4)
        await pods.kill(0)
        results = await asyncio.wait_for(asyncio.gather(*tasks), timeout=60)
        assert "truncated" not in results and all(not r.startswith("http-5") for r in results)
        assert results.count("ok") + results.count("error-event") == 24
        # After the kill every new request lands on the survivor.
        after = await asyncio.gather(*(http.post(r.url + CHAT, json=chat(8)) for _ in range(10)))
        assert all(resp.status_code == 200 for resp in after)


async def test_failure_before_first_byte_is_retried_on_another_pod(http: httpx.AsyncClient) -> None:
    async with sims(2) as pods:
        broken = pods.urls[0]
        refusing = FaultyEngineHttp(lambda method, url: url == broken + CHAT)
        async with run_router(router_settings(pods.urls), engine_http=refusing) as r:
            results = await asyncio.gather(
                *(http.post(r.url + CHAT, json=chat(4)) for _ in range(8))
            )
            assert all(resp.status_code == 200 for resp in results)
            metrics = (await http.get(r.url + "/metrics")).text
            assert 'specgate_router_retries_total{reason="connect"}' in metrics
            view = {p["url"]: p for p in (await http.get(r.url + "/specgate/pods")).json()["pods"]}
            assert view[broken]["circuit"] in ("open", "half_open")


async def test_a_single_pods_dropped_connection_is_retried_on_it(http: httpx.AsyncClient) -> None:
    """With one pod there is no other to retry on: a connection it dropped before the first
    byte (a keep-alive connection closed under the request) is retried on the same pod."""
    async with sims(1) as pods:
        dropped: list[str] = []

        def drop_first(method: str, url: str) -> bool:
            if url.endswith(CHAT) and not dropped:
                dropped.append(url)
                return True
            return False

        async with run_router(
            router_settings(pods.urls), engine_http=FaultyEngineHttp(drop_first)
        ) as r:
            resp = await http.post(r.url + CHAT, json=chat(4))
            assert resp.status_code == 200, resp.text
            assert dropped == [pods.urls[0] + CHAT]
            metrics = (await http.get(r.url + "/metrics")).text
            assert 'specgate_router_retries_total{reason="connect"} 1.0' in metrics


async def test_all_pods_down_gives_503_with_retry_after(http: httpx.AsyncClient) -> None:
    async with sims(2) as pods, run_router(router_settings(pods.urls)) as r:
        await pods.kill(0)
        await pods.kill(1)
        await asyncio.sleep(0.8)
        resp = await http.post(r.url + CHAT, json=chat(4))
        assert resp.status_code == 503 and resp.headers["retry-after"] == "1"
        assert resp.json()["error"]["message"].startswith("no engine pod can take the request")
        assert (await http.get(r.url + "/readyz")).status_code == 503


@pytest.mark.parametrize(
    ("path", "body", "status"),
    [
        (CHAT, b"{", 400),
        (CHAT, b'{"model": "m", "messages": "hi"}', 400),
        (CHAT, b'{"model": "other", "messages": [{"role": "user", "content": "x"}]}', 404),
        ("/v1/completions", b'{"model": "m", "prompt": "x", "max_tokens": -1}', 400),
        ("/generate", b'{"sampling_params": {"max_new_tokens": 3}}', 400),
        (
            CHAT,
            b'{"model": "m", "messages": [{"role": "user", "content": "x"}], '
            b'"max_tokens": 1000000}',
            400,
        ),
    ],
)
async def test_malformed_requests_get_4xx_in_openai_shape(
    path: str, body: bytes, status: int, http: httpx.AsyncClient
) -> None:
    async with sims(1) as pods, run_router(router_settings(pods.urls)) as r:
        resp = await http.post(
            r.url + path, content=body, headers={"content-type": "application/json"}
        )
    assert resp.status_code == status
    assert resp.json().get("error", {}).get("message") or resp.json().get("message")


async def test_oversized_body_is_413(http: httpx.AsyncClient) -> None:
    async with sims(1) as pods:
        settings = router_settings(pods.urls, resilience={"maxBodyBytes": 2048})
        async with run_router(settings) as r:
            big = chat(4, padding="x" * 5000)
            resp = await http.post(r.url + CHAT, json=big)
    assert resp.status_code == 413


async def test_bad_class_header_is_400(http: httpx.AsyncClient) -> None:
    async with sims(1) as pods, run_router(router_settings(pods.urls)) as r:
        resp = await http.post(r.url + CHAT, json=chat(4), headers={"x-specgate-class": "bulk"})
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "x-specgate-class"


async def test_config_reload_drops_no_request(tmp_path: Path, http: httpx.AsyncClient) -> None:
    async with sims(2) as pods:
        config = tmp_path / "router.yaml"
        config.write_text(yaml.safe_dump(router_settings(pods.urls, defaultClass="latency")))
        async with (
            run_router(router_settings(pods.urls), config_path=str(config)) as r,
            closed_loop(http, r.url + CHAT, 4, chat(8)) as statuses,
        ):
            await asyncio.sleep(0.5)
            config.write_text(yaml.safe_dump(router_settings(pods.urls, defaultClass="throughput")))
            for _ in range(60):
                if r.state.settings.default_class == "throughput":
                    break
                await asyncio.sleep(0.1)
            await asyncio.sleep(0.5)
            config.write_text("not: [valid")  # a broken file is ignored, the old one kept
            await asyncio.sleep(1.5)
        assert r.state.settings.default_class == "throughput"
        assert statuses and set(statuses) == {200}


async def test_shutdown_drains_in_flight_streams(http: httpx.AsyncClient) -> None:
    async with (
        sims(1, time_scale=2.0, threshold=0) as pods,
        run_router(router_settings(pods.urls)) as r,
    ):
        stream = asyncio.create_task(
            stream_events(http, r.url + CHAT, chat(max_tokens=60, stream=True))
        )
        await asyncio.sleep(0.2)
        r.server.should_exit = True  # SIGTERM
        status, events = await asyncio.wait_for(stream, timeout=30)
    assert status == 200 and events[-1][1] == "[DONE]"
    assert not any(is_error_event(e) for _, e in events)


async def test_observability_endpoints(http: httpx.AsyncClient) -> None:
    async with sims(2) as pods, run_router(router_settings(pods.urls)) as r:
        resp = await http.post(
            r.url + CHAT, json=chat(8, stream=True), headers={"x-request-id": "abc-123"}
        )
        assert resp.headers["x-request-id"] == "abc-123"
        await http.post(
            r.url + "/generate", json={"text": "x", "sampling_params": {"max_new_tokens": 5}}
        )
        assert (await http.get(r.url + "/healthz")).status_code == 200
        assert (await http.get(r.url + "/readyz")).json()["usable"] == 2
        models = (await http.get(r.url + "/v1/models")).json()
        assert models["data"][0]["id"] == "m"
        metrics = (await http.get(r.url + "/metrics")).text
        for name in (
            "specgate_router_requests_total",
            "specgate_router_ttft_seconds_bucket",
            "specgate_router_tpot_seconds_bucket",
            "specgate_pod_batch",
            "specgate_pod_threshold",
            "specgate_pod_speculating",
            "specgate_pod_accept_length",
            "specgate_pod_scrape_age_seconds",
            "specgate_pod_circuit_open",
            "specgate_router_output_tokens_total",
        ):
            assert name in metrics, name
        assert 'specgate_router_output_tokens_total{traffic_class="latency"} 13.0' in metrics
        view = (await http.get(r.url + "/specgate/pods")).json()
        assert view["leader"] is True and len(view["pods"]) == 2


async def test_the_controllers_samples_are_exported_for_replay(http: httpx.AsyncClient) -> None:
    """GET /specgate/samples: each pod's learning samples (rows of replay.SAMPLE_FIELDS, on
    the router's clock) and the control settings, enough to replay the controller offline."""
    async with sims(1, time_scale=10.0, threshold=8) as pods:
        settings = router_settings(pods.urls)
        async with run_router(settings) as r:
            async with closed_loop(http, r.url + CHAT, 4, chat(max_tokens=100)):
                for _ in range(100):
                    await asyncio.sleep(0.1)
                    exported = (await http.get(r.url + "/specgate/samples")).json()
                    if len(exported["pods"][0]["samples"]) >= 5:
                        break
            view = (await http.get(r.url + "/specgate/pods")).json()["pods"][0]
            one = await http.get(r.url + "/specgate/samples", params={"pod": view["name"]})
            missing = await http.get(r.url + "/specgate/samples", params={"pod": "nope:1"})
    assert [p["name"] for p in one.json()["pods"]] == [view["name"]]
    assert missing.status_code == 404
    assert missing.json()["error"]["message"] == f"no pod 'nope:1'; the router knows {view['name']}"
    assert exported["fields"] == ["at", "batch", "tokensPerSecond", "speculatingFraction"]
    params = ControlSettings.model_validate(exported["control"])
    assert params.scrape_interval_seconds == 0.1 and params.mode == "dynamic"
    (pod,) = exported["pods"]
    assert pod["name"] == view["name"] and pod["threshold"] == view["threshold"]
    _, samples = replay.pod_samples(exported)
    assert len(samples) >= 5 and all(s.at <= exported["now"] for s in samples)
    # Four clients under threshold 8: speculating, at a batch of at most four.
    assert all(s.speculating_fraction >= 0.9 and 0 < s.batch <= 4 for s in samples)
    assert all(s.tokens_per_second > 0 for s in samples)
    assert replay.replay(samples, params=params)[0].threshold == 8


async def test_metrics_endpoint_lists_every_pod_gauge(http: httpx.AsyncClient) -> None:
    async with sims(1) as pods, run_router(router_settings(pods.urls)) as r:
        resp = await http.get(r.url + "/metrics")
    assert resp.status_code == 200
    for name in (
        "specgate_pod_gen_throughput",
        "specgate_pod_in_flight",
        "specgate_pod_pool",
        "specgate_pod_healthy",
    ):
        assert f"{name}{{engine_pod=" in resp.text, name


async def test_a_pod_held_away_from_its_threshold_runs_a_trial(
    http: httpx.AsyncClient, caplog: pytest.LogCaptureFixture
) -> None:
    """Eight clients hold a pod at batch 8, plain under threshold 2. The pod reports no step
    profile, so the law has only plain decoding's samples there: it tries speculation (a
    trial), counts both ends in specgate_trials_total, logs the reading, and the threshold
    changes are counted by rule."""
    caplog.set_level(logging.INFO, logger="specgate.router")
    async with sims(1, time_scale=10.0, threshold=2, model_inputs=False) as pods:
        settings = router_settings(pods.urls)
        settings["control"] = {
            **settings["control"],
            "threshold": 2,  # type: ignore[dict-item]
            "maxThreshold": 64,
            "cooldownSeconds": 0.5,
            "minSamples": 3,
        }
        async with (
            run_router(settings) as r,
            closed_loop(http, r.url + CHAT, 8, chat(max_tokens=200)),
        ):
            ended: list[str] = []
            view: dict[str, object] = {}
            for _ in range(300):
                await asyncio.sleep(0.1)
                metrics = (await http.get(r.url + "/metrics")).text
                ended = [
                    o
                    for o in ("read", "ended")
                    if f'mode="speculation",outcome="{o}"}} 1.0' in metrics
                ]
                if ended:
                    view = (await http.get(r.url + "/specgate/pods")).json()["pods"][0]
                    break
    assert 'mode="speculation",outcome="started"} 1.0' in metrics, metrics[-3000:]
    assert len(ended) == 1, metrics[-3000:]
    lines = [
        rec.getMessage()
        for rec in caplog.records
        if rec.name == "specgate.router" and rec.getMessage().startswith("trial on ")
    ]
    assert len(lines) == 1 and f" {ended[0]}: " in lines[0], lines
    assert 'rule="trial"' in metrics and 'rule="trial-return"' in metrics, metrics[-3000:]
    assert view["rule"] in {r.value for r in Rule}, view
    readings = view["prediction"]
    assert readings is None or isinstance(readings, dict), view


async def test_a_new_pod_gets_the_predicted_threshold_without_learning(
    http: httpx.AsyncClient,
) -> None:
    """The issue's reproduction over real HTTP: one pod at the resource's default threshold of
    8 and default cooldown, a profile where speculation pays at every batch, 16 streams. The
    router reads the pod's step profile and acceptance and moves the threshold above the load
    at once (in one step, not by doubling), and the pod speculates at batch 16. The
    prediction shows in /specgate/pods and /metrics."""
    h200 = profiles.load("h200-3b-synthetic-deployed")
    settings = PodSettings(api_key=KEY, threshold=8, time_scale=5.0, model="m", seed=4)
    async with SimCluster(h200, 1, settings=settings) as pods:
        config = router_settings(pods.urls)
        config["control"] = {"scrapeIntervalSeconds": 0.25, "staleAfterSeconds": 1.5}
        async with (
            run_router(config) as r,
            closed_loop(http, r.url + CHAT, 16, chat(max_tokens=300)),
        ):
            view: dict[str, object] = {}
            for _ in range(100):
                await asyncio.sleep(0.1)
                view = (await http.get(r.url + "/specgate/pods")).json()["pods"][0]
                if isinstance(view["threshold"], int) and view["threshold"] > 16:
                    break
            metrics = (await http.get(r.url + "/metrics")).text
            pods_core = pods.pods[0].core
            # At a moment the pod holds 12 or more streams (under threshold 8 it would not
            # speculate there): a single look can fall between two requests on a busy host.
            speculating = False
            for _ in range(50):
                await asyncio.sleep(0.1)
                if len(pods_core.running) >= 12:
                    speculating = pods_core.speculating
                    break
    assert isinstance(view["threshold"], int) and view["threshold"] >= 32, view
    assert view["rule"] in ("move", "hold", "no-gain"), view
    assert str(view["reason"]).startswith("speculation pays up to"), view
    prediction = view["prediction"]
    assert isinstance(prediction, dict) and prediction["correction"] is not None
    # The simulated engine runs its profile's steps: the mode it ran reads about 1.
    assert 0.8 < max(prediction["stepScale"].values()) < 1.25, prediction
    assert prediction["acceptLengthSource"] in ("measured", "estimated while off (uncalibrated)")
    assert 'specgate_pod_control_rule{engine_pod="' in metrics
    assert 'specgate_threshold_changes_total{direction="raise",engine_pod="' in metrics
    assert speculating


@contextlib.asynccontextmanager
async def frozen_pod(loads_body: bytes | None = None) -> AsyncIterator[str]:
    """An engine that answers its scrapes (idle, patched; or `loads_body`) but never answers
    a request: the socket stays open, as with a stopped process behind a live proxy or a
    wedged scheduler."""
    loads = (
        loads_body
        or json.dumps(
            {
                "loads": [
                    {
                        "num_running_reqs": 0,
                        "num_waiting_reqs": 0,
                        "max_running_requests": 256,
                        "speculative": {
                            "disable_batch_threshold": 8,
                            "speculating": True,
                            "decode_steps_on": 0,
                            "decode_steps_off": 0,
                        },
                    }
                ]
            }
        ).encode()
    )
    hung: list[asyncio.StreamWriter] = []

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            head = await reader.readuntil(b"\r\n\r\n")
            line = head.split(b"\r\n", 1)[0]
            length = (
                int(re.search(rb"(?i)content-length: *(\d+)", head).group(1))
                if re.search(rb"(?i)content-length", head)
                else 0
            )
            await reader.readexactly(length)
            if b" /v1/loads" in line or b" /server_info" in line:
                body = (
                    loads if b"/v1/loads" in line else b'{"speculative_disable_batch_threshold": 8}'
                )
                writer.write(
                    b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                    + f"Content-Length: {len(body)}\r\n\r\n".encode()
                    + body
                )
                await writer.drain()
                continue
            hung.append(writer)  # a request: never answered
            await asyncio.sleep(3600)

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        for writer in hung:
            writer.close()
        server.close()


async def test_a_frozen_pod_costs_one_first_byte_timeout_and_leaves_rotation(
    http: httpx.AsyncClient,
) -> None:
    """Requests to a pod that never answers wait the first-byte limit, are retried on the
    other pod and succeed; the frozen pod's circuit opens, so the next requests go straight to
    the live pod. A busy live pod (one long request sent to it directly) makes the frozen,
    idle-looking one the first choice."""
    async with sims(1, time_scale=1.0, threshold=8) as pods, frozen_pod() as frozen:
        config = router_settings([frozen, *pods.urls])
        config["resilience"] = {
            **config["resilience"],  # type: ignore[dict-item]
            "firstByteTimeoutSeconds": 0.5,
            "breakerOpenSeconds": 30,
        }
        background = asyncio.create_task(
            http.post(
                pods.urls[0] + "/v1/chat/completions",
                json=chat(max_tokens=2000),
                headers={"Authorization": f"Bearer {KEY}"},
            )
        )
        try:
            async with run_router(config) as r:
                for _ in range(50):  # both scraped, the live pod busy
                    view = (await http.get(r.url + "/specgate/pods")).json()["pods"]
                    if all(p["fresh"] for p in view) and max(p["batch"] or 0 for p in view) >= 1:
                        break
                    await asyncio.sleep(0.1)
                took = []
                for _ in range(4):
                    started = asyncio.get_running_loop().time()
                    resp = await http.post(r.url + CHAT, json=chat(max_tokens=4))
                    took.append(asyncio.get_running_loop().time() - started)
                    assert resp.status_code == 200, resp.text
                    assert resp.headers["x-specgate-pod"] != public_id(frozen.split("://")[1])
                metrics = (await http.get(r.url + "/metrics")).text
                view = (await http.get(r.url + "/specgate/pods")).json()["pods"]
        finally:
            background.cancel()
            with contextlib.suppress(asyncio.CancelledError, httpx.HTTPError):
                await background
    assert 0.5 <= took[0] < 1.5, took  # the limit, then the live pod
    assert max(took[1:]) < 0.5, took  # the frozen pod is out of rotation
    assert 'specgate_router_retries_total{reason="first_byte_timeout"} 1.0' in metrics
    (state,) = [p for p in view if p["url"] == frozen]
    assert state["circuit"] == "open"
