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


async def _raw(port: int, head: bytes, body: bytes = b"") -> bytes:
    """Send bytes on one connection; everything the router answers until it closes or 2 s."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    chunks: list[bytes] = []
    try:
        writer.write(head + body)
        await writer.drain()
        while chunk := await asyncio.wait_for(reader.read(65536), 2):
            chunks.append(chunk)
    except (ConnectionError, TimeoutError):
        pass  # the router closed the connection mid-write, or kept it open: what came counts
    finally:
        writer.close()
    return b"".join(chunks)


async def test_an_oversized_request_head_gets_431_and_ordinary_ones_pass() -> None:
    """The router bounds a request's head at the parser (resilience.maxHeaderBytes and
    maxHeaders): one huge header, or too many, gets 431 and a closed connection before the
    parser buffers it; normal requests, a big body behind a small head, and two requests on
    one kept-alive connection are served."""
    async with run_router(router_settings(["http://127.0.0.1:9"])) as router:
        get = b"GET /healthz HTTP/1.1\r\nhost: x\r\n"
        ok = await _raw(router.port, get + b"connection: close\r\n\r\n")
        assert ok.startswith(b"HTTP/1.1 200"), ok[:200]
        huge = await _raw(router.port, get + b"x-big: " + b"a" * (1 << 20) + b"\r\n\r\n")
        assert huge.startswith(b"HTTP/1.1 431"), huge[:200]
        assert b"maxHeaderBytes" not in huge and b"headers" in huge
        many = b"".join(b"x-h%d: v\r\n" % i for i in range(150))
        assert (await _raw(router.port, get + many + b"\r\n")).startswith(b"HTTP/1.1 431")
        # Just under the bounds: served.
        fine = b"".join(b"x-h%d: v\r\n" % i for i in range(90))
        answer = await _raw(router.port, get + fine + b"x-big: " + b"a" * 30_000 + b"\r\n"
                            b"connection: close\r\n\r\n")  # fmt: skip
        assert answer.startswith(b"HTTP/1.1 200"), answer[:200]
        # A body is not a head: a 1 MiB body behind a small head reaches the application.
        body = b'{"model": "m", "messages": [{"role": "user", "content": "' + b"a" * (1 << 20)
        body += b'"}]}'
        post = (b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json"
                b"\r\nconnection: close\r\ncontent-length: %d\r\n\r\n" % len(body))  # fmt: skip
        answer = await _raw(router.port, post, body)
        assert not answer.startswith(b"HTTP/1.1 431") and answer.startswith(b"HTTP/1.1 "), answer
        # Two requests on one connection, the second past the first's head bytes in total.
        first = get + b"x-a: " + b"a" * 40_000 + b"\r\n\r\n"
        second = get + b"x-b: " + b"b" * 40_000 + b"\r\nconnection: close\r\n\r\n"
        twice = await _raw(router.port, first + second)
        assert twice.count(b"HTTP/1.1 200") == 2, twice[:300]


@pytest.mark.parametrize(
    ("path", "body", "field"),
    [
        ("/v1/chat/completions", {"custom_logit_processor": "gASV..."}, "custom_logit_processor"),
        ("/v1/completions", {"prompt": "x", "lora_path": "/etc/passwd"}, "lora_path"),
        ("/v1/chat/completions", {"bootstrap_host": "10.0.0.1", "rid": "r"}, "bootstrap_host"),
        ("/v1/chat/completions", {"priority": -100}, "priority"),
        ("/generate", {"text": "x", "sampling_params": {"custom_params": {}}}, "custom_params"),
        ("/generate", {"text": "x", "return_hidden_states": True}, "return_hidden_states"),
    ],
)
def test_engine_internal_fields_are_refused_by_name(
    path: str, body: dict[str, object], field: str
) -> None:
    if path.startswith("/v1/chat"):
        body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], **body}
    with pytest.raises(BadRequest, match=field) as caught:
        routed.parse(path, json.dumps(body).encode(), {}, SETTINGS)
    assert caught.value.param == field
    # What a client may set still passes, cache_salt included.
    ok = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "cache_salt": "tenant-a"}
    assert routed.parse("/v1/chat/completions", json.dumps(ok).encode(), {}, SETTINGS).body


def test_a_resource_may_allow_an_engine_field_and_only_that_one() -> None:
    """spec.router.allowedEngineFields reaches the router through the operator's rendering:
    a deployment serving LoRA adapters lets clients name one; the other fields stay refused,
    and a name outside the list is refused by the schema."""
    from specgate import api
    from specgate_operator import render
    from specgate_router.settings import RouterSettings

    from .conftest import minimal_resource

    sdd = api.SpecDecodeDeployment.model_validate(
        minimal_resource(router={"allowedEngineFields": ["lora_path"]})
    )
    config = render.router_config(sdd)
    assert config["allowedEngineFields"] == ["lora_path"]
    settings = RouterSettings.model_validate({**config, "backends": ["http://x"]})
    body = {"model": settings.model, "messages": [{"role": "user", "content": "hi"}]}
    lora = json.dumps({**body, "lora_path": "adapter-a"}).encode()
    assert json.loads(routed.parse("/v1/chat/completions", lora, {}, settings).body)["lora_path"]
    code = json.dumps({**body, "custom_logit_processor": "x"}).encode()
    with pytest.raises(BadRequest, match="custom_logit_processor"):
        routed.parse("/v1/chat/completions", code, {}, settings)
    assert "allowedEngineFields" not in render.router_config(
        api.SpecDecodeDeployment.model_validate(minimal_resource())
    )
    with pytest.raises(ValueError, match="allowedEngineFields"):
        api.SpecDecodeDeployment.model_validate(
            minimal_resource(router={"allowedEngineFields": ["anything"]})
        )


@pytest.mark.parametrize(
    ("headers", "expected"),
    [
        ({"traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
          "tracestate": "vendor=abc"},
         (("traceparent", "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"),
          ("tracestate", "vendor=abc"))),
        ({"traceparent": "00-4BF92F3577B34DA6A3CE929D0E0E4736-00F067AA0BA902B7-01"},
         (("traceparent", "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"),)),
        ({"traceparent": "00-00000000000000000000000000000000-00f067aa0ba902b7-01"}, ()),
        ({"traceparent": "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"}, ()),
        ({"traceparent": "00-xyz-00f067aa0ba902b7-01\r\nX-Evil: 1"}, ()),
        ({"tracestate": "vendor=abc"}, ()),
        ({"traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
          "tracestate": "x" * 600},
         (("traceparent", "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"),)),
    ],
)  # fmt: skip
def test_a_well_formed_trace_context_reaches_the_engine_and_nothing_else(
    headers: dict[str, str], expected: tuple[tuple[str, str], ...]
) -> None:
    from specgate_router import proxy

    assert routed.trace_context(headers) == expected
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    req = routed.parse("/v1/chat/completions", json.dumps(body).encode(), headers, SETTINGS)
    assert req.trace == expected

    class State:
        settings = SETTINGS

    sent = proxy._headers(State(), "rid-1", req)  # type: ignore[arg-type]
    assert {k: v for k, v in sent.items() if k.startswith("trace")} == dict(expected)
    assert sent["x-request-id"] == "rid-1"
