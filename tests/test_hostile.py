"""Hostile and broken input: what a client or an engine pod may send, and the clear answer
each gets. Request bodies nested deeply get 400; an engine's non-finite, negative or
out-of-range numbers, and oversized answers, are dropped and counted, never acted on; a
threshold a pod reports outside the resource's bounds is not adopted; a 502 names no pod
address and says when to retry."""

from __future__ import annotations

import asyncio
import json
import math
import re

import httpx
import pytest

from specgate.engine_client import EngineLoad
from specgate_router import requests as routed
from specgate_router.errors import BadRequest
from specgate_router.settings import RouterSettings

from .router_harness import run_router
from .test_router_http import CHAT, KEY, chat, frozen_pod, router_settings, sims

SETTINGS = RouterSettings(backends=["http://x"], model="m")


def _chat_body(content: str = "hi") -> bytes:
    return json.dumps({"model": "m", "messages": [{"role": "user", "content": content}]}).encode()


@pytest.mark.parametrize("depth", [65, 1000, 100_000])
def test_a_deeply_nested_body_gets_400(depth: int) -> None:
    raw = b'{"model": "m", "messages": ' + b"[" * depth + b"]" * depth + b"}"
    with pytest.raises(BadRequest, match="nested"):
        routed.parse("/v1/chat/completions", raw, {}, SETTINGS)


def test_brackets_inside_strings_and_ordinary_bodies_pass() -> None:
    req = routed.parse("/v1/chat/completions", _chat_body("[" * 500 + "{" * 500), {}, SETTINGS)
    assert req.path == "/v1/chat/completions"
    many = [{"role": "user", "content": str(i)} for i in range(200)]  # wide, not deep
    raw = json.dumps({"model": "m", "messages": many}).encode()
    assert routed.parse("/v1/chat/completions", raw, {}, SETTINGS).body


def _loads(**changes: object) -> dict[str, object]:
    load: dict[str, object] = {
        "num_running_reqs": 3,
        "num_waiting_reqs": 0,
        "max_running_requests": 64,
        "decode_moments": [10.0, 30.0, 1000.0, 90.0, 3000.0, 30.0],
        "speculative": {"disable_batch_threshold": 8, "decode_steps_on": 4, "decode_steps_off": 6},
    }
    for key, value in changes.items():
        if key.startswith("spec_"):
            load["speculative"][key.removeprefix("spec_")] = value  # type: ignore[index]
        else:
            load[key] = value
    return {"loads": [load]}


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"decode_moments": [10.0, math.nan, 1.0, 1.0, 1.0, 1.0]}, "decode_moments[1]"),
        ({"decode_moments": [10.0, math.inf, 1.0, 1.0, 1.0, 1.0]}, "decode_moments[1]"),
        ({"decode_moments": [-1.0, 1.0, 1.0, 1.0, 1.0, 1.0]}, "decode_moments[0]"),
        ({"num_running_reqs": -1}, "num_running_reqs"),
        ({"num_running_reqs": 2.5}, "num_running_reqs"),
        ({"spec_disable_batch_threshold": 10**9}, "speculative_disable_batch_threshold"),
        ({"spec_disable_batch_threshold": -5}, "speculative_disable_batch_threshold"),
        ({"spec_accept_length": math.nan}, "accept_length"),
        ({"gen_throughput": math.inf}, "gen_throughput"),
        ({"speculative": "x"}, "speculative"),
    ],
)
def test_an_engines_bad_numbers_are_refused_naming_the_field(
    change: dict[str, object], field: str
) -> None:
    assert EngineLoad.from_response(_loads()).running == 3
    with pytest.raises(ValueError, match=re.escape(field)):
        EngineLoad.from_response(_loads(**change))


async def _scraped(loads_body: bytes, control: dict[str, object]) -> tuple[dict, str]:  # type: ignore[type-arg]
    async with frozen_pod(loads_body) as pod, httpx.AsyncClient(timeout=10) as http:
        config = router_settings([pod])
        config["control"] = {**config["control"], **control}  # type: ignore[dict-item]
        async with run_router(config) as r:
            await asyncio.sleep(0.6)
            view = (await http.get(r.url + "/specgate/pods")).json()["pods"][0]
            metrics = (await http.get(r.url + "/metrics")).text
    return view, metrics


async def test_a_pod_reporting_nan_is_stale_and_counted_not_acted_on() -> None:
    body = json.dumps(_loads(decode_moments=[10.0, float("nan"), 1, 1, 1, 1])).encode()
    view, metrics = await _scraped(body, {})
    assert view["fresh"] is False and "decode_moments[1]" in view["scrapeError"]
    assert view["decidedThreshold"] == 8  # the resource's: nothing was decided on it
    assert "specgate_pod_rejected_metrics_total" in metrics


async def test_an_oversized_scrape_answer_is_refused() -> None:
    huge = json.dumps({"loads": [{"num_running_reqs": 0, "pad": "x" * (5 * 2**20)}]}).encode()
    view, _ = await _scraped(huge, {})
    assert view["fresh"] is False and "over" in view["scrapeError"]


@pytest.mark.parametrize("reported", [10**6, 0])
async def test_a_threshold_outside_the_resources_bounds_is_not_adopted(reported: int) -> None:
    body = json.dumps(_loads(spec_disable_batch_threshold=reported)).encode()
    view, _ = await _scraped(body, {"minThreshold": 2, "maxThreshold": 64, "threshold": 8})
    assert view["decidedThreshold"] == 8, view  # the resource's, not the pod's


async def test_a_502_says_when_to_retry_and_names_no_pod() -> None:
    async with sims(1, time_scale=1.0) as pods, httpx.AsyncClient(timeout=10) as http:
        config = router_settings(pods.urls)
        config["resilience"] = {**config["resilience"], "firstByteTimeoutSeconds": 0.3}  # type: ignore[dict-item]
        async with run_router(config) as r:
            await asyncio.sleep(0.5)
            await pods.stop()  # every pod gone after the router saw them healthy
            resp = await http.post(r.url + CHAT, json=chat())
    assert resp.status_code in (502, 503), resp.text
    assert "Retry-After" in resp.headers
    assert "127.0.0.1" not in resp.text and str(KEY) not in resp.text
