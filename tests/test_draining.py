"""How answers end: the router's answer limit, and an engine pod's preStop drain run against a
simulated engine as the kubelet runs it (`python3 -c` with the rendered arguments)."""

from __future__ import annotations

import asyncio
import contextlib
import sys
import time
from collections.abc import AsyncIterator
from urllib.parse import urlsplit

import httpx
import pytest

from specgate_operator import render

from .router_harness import is_error_event, run_router, stream_events
from .test_router_http import CHAT, KEY, chat, router_settings, sims

pytestmark = pytest.mark.integration


@pytest.fixture
async def http() -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(timeout=60) as client:
        yield client


def _limits(urls: list[str], **resilience: float) -> dict[str, object]:
    config = router_settings(urls)
    config["resilience"] = {**config["resilience"], **resilience}  # type: ignore[dict-item]
    return config


async def test_a_stream_past_the_answer_limit_ends_with_a_timeout_event(
    http: httpx.AsyncClient,
) -> None:
    async with (
        sims(1, time_scale=1.0, threshold=0) as pods,
        run_router(_limits(pods.urls, answerTimeoutSeconds=0.6)) as r,
    ):
        started = time.monotonic()
        status, events = await stream_events(http, r.url + CHAT, chat(max_tokens=5000, stream=True))
        took = time.monotonic() - started
        metrics = (await http.get(r.url + "/metrics")).text
    assert status == 200 and events[-1][1] == "[DONE]"
    error = events[-2][1]
    assert is_error_event(error) and '"code": 504' in error and "0.6s" in error, error
    assert len(events) > 3  # tokens arrived before the limit cut the answer
    assert 0.6 <= took < 2.0, took
    assert 'code="answer_timeout"' in metrics


async def test_a_non_streamed_answer_waits_past_the_first_byte_limit_while_its_pod_answers(
    http: httpx.AsyncClient,
) -> None:
    """A non-streamed answer's first byte is its whole body: a pod that keeps answering
    scrapes is waited for past the first-byte limit (a frozen one is not: see
    test_router_http's frozen pod), up to the answer limit, then 504 in OpenAI's shape."""
    async with sims(1, time_scale=1.0, threshold=0) as pods:
        async with run_router(_limits(pods.urls, firstByteTimeoutSeconds=0.3)) as r:
            started = time.monotonic()
            resp = await http.post(r.url + CHAT, json=chat(max_tokens=60))
            took = time.monotonic() - started
        assert resp.status_code == 200, resp.text
        assert resp.json()["usage"]["completion_tokens"] == 60
        assert took > 3 * 0.3, took  # longer than the first-byte limit, yet served
        limits = _limits(pods.urls, firstByteTimeoutSeconds=0.3, answerTimeoutSeconds=0.5)
        async with run_router(limits) as r:
            started = time.monotonic()
            resp = await http.post(r.url + CHAT, json=chat(max_tokens=60))
            took = time.monotonic() - started
            view = (await http.get(r.url + "/specgate/pods")).json()["pods"]
    assert resp.status_code == 504, resp.text
    assert resp.json()["error"]["code"] == "answer_timeout"
    assert 0.5 <= took < 1.5, took
    assert view[0]["circuit"] == "closed"  # a long answer is not the pod's failure


async def _drain(port: int, settle: float, most: float) -> float:
    """Run the engine's preStop hook as the kubelet would; the seconds it took."""
    started = time.monotonic()
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", render.ENGINE_DRAIN_SCRIPT, str(port), str(settle), str(most)
    )
    assert await asyncio.wait_for(proc.wait(), most + 30) == 0
    return time.monotonic() - started


async def test_the_engine_drain_waits_for_running_requests_and_no_longer(
    http: httpx.AsyncClient,
) -> None:
    async with sims(1, time_scale=1.0, threshold=0) as pods:
        url = pods.urls[0]
        port = urlsplit(url).port
        assert port is not None
        assert await _drain(port, 0, 30) < 2  # idle: at once
        answer = asyncio.create_task(
            http.post(
                url + CHAT, json=chat(max_tokens=100), headers={"Authorization": f"Bearer {KEY}"}
            )
        )
        try:
            for _ in range(100):
                if "sglang:num_running_reqs 1" in (await http.get(url + "/metrics")).text:
                    break
                await asyncio.sleep(0.05)
            took = await _drain(port, 0, 60)
            assert answer.done(), "the drain ended while a request ran"
            assert (await answer).status_code == 200
            assert took < 60
            # A request longer than the drain: the hook gives up at its bound.
            answer = asyncio.create_task(
                http.post(
                    url + CHAT,
                    json=chat(max_tokens=5000, stream=True),
                    headers={"Authorization": f"Bearer {KEY}"},
                )
            )
            await asyncio.sleep(0.3)
            took = await _drain(port, 0.5, 1.5)
            assert 1.5 <= took < 4, took
            assert not answer.done()
        finally:
            answer.cancel()
            with contextlib.suppress(asyncio.CancelledError, httpx.HTTPError):
                await answer
    # The engine gone (stopped or crashed): nothing to wait for.
    assert await _drain(port, 0, 30) < 2
