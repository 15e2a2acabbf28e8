"""A hostile or broken engine pod, and hostile request bodies, against the router: everything an
engine reports is bounded by the contract, its errors are counted and shown in /specgate/pods,
pushes back off whatever the failure, a huge answer is passed through rather than held, and
nothing a client sees names a pod's address."""

from __future__ import annotations

import asyncio
import json
import logging
import re
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest
from aiohttp import web

from specgate_router import requests as routed
from specgate_router.errors import BadRequest
from specgate_router.settings import RouterSettings
from specgate_sim.cluster import free_ports
from specgate_sim.local import StackConfig, running_stack

from .router_harness import run_router
from .test_hostile import _raw
from .test_router_http import CHAT, KEY, chat, router_settings, sims

IDLE_LOADS = {
    "loads": [
        {
            "num_running_reqs": 0,
            "num_waiting_reqs": 0,
            "max_running_requests": 64,
            "speculative": {"disable_batch_threshold": 8, "speculating": True},
        }
    ]
}


@dataclass
class FakeEngine:
    """An engine whose every answer the test sets: /v1/loads and /server_info bodies, the
    chat answer, and whether a push is applied. Counts the pushes it gets."""

    loads: bytes = json.dumps(IDLE_LOADS).encode()
    server_info: Callable[[int | None], bytes] = lambda threshold: json.dumps(
        {"speculative_disable_batch_threshold": threshold}
    ).encode()
    answer: Callable[[web.Request], Any] | None = None
    applies_pushes: bool = True
    threshold: int | None = 8
    pushes: list[float] = field(default_factory=list)
    url: str = ""

    async def _loads(self, request: web.Request) -> web.Response:
        return web.Response(body=self.loads, content_type="application/json")

    async def _server_info(self, request: web.Request) -> web.Response:
        return web.Response(body=self.server_info(self.threshold), content_type="application/json")

    async def _set(self, request: web.Request) -> web.Response:
        self.pushes.append(asyncio.get_running_loop().time())
        body = await request.json()
        if self.applies_pushes:
            self.threshold = body.get("speculative_disable_batch_threshold", self.threshold)
        return web.json_response([True])

    async def _chat(self, request: web.Request) -> Any:
        await request.read()
        assert self.answer is not None
        return await self.answer(request)

    async def _health(self, request: web.Request) -> web.Response:
        return web.Response(text="ok")


@asynccontextmanager
async def fake_engine(engine: FakeEngine) -> AsyncIterator[FakeEngine]:
    app = web.Application()
    app.router.add_get("/v1/loads", engine._loads)
    app.router.add_get("/server_info", engine._server_info)
    app.router.add_post("/set_internal_state", engine._set)
    app.router.add_post("/v1/chat/completions", engine._chat)
    app.router.add_get("/health", engine._health)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    engine.url = f"http://127.0.0.1:{port}"
    try:
        yield engine
    finally:
        await runner.cleanup()


async def _view_after(engine: FakeEngine, seconds: float, **control: object) -> dict[str, Any]:
    async with fake_engine(engine), httpx.AsyncClient(timeout=10) as http:
        config = router_settings([engine.url])
        config["control"] = {**config["control"], **control}  # type: ignore[dict-item]
        async with run_router(config, ready=False) as r:
            await asyncio.sleep(seconds)
            view: dict[str, Any] = (await http.get(r.url + "/specgate/pods")).json()["pods"][0]
            view["metrics"] = (await http.get(r.url + "/metrics")).text
    return view


async def test_a_scrape_answer_bigger_than_the_contracts_largest_is_refused_and_counted() -> None:
    """300 KiB of /v1/loads (the contract's largest is tens of KiB): refused before it is
    parsed, every scrape, and the failures show in /specgate/pods."""
    padded = {"loads": [{**IDLE_LOADS["loads"][0], "pad": "x" * 300_000}]}
    view = await _view_after(FakeEngine(loads=json.dumps(padded).encode()), 0.6)
    assert view["fresh"] is False and "over" in view["scrapeError"]
    assert view["scrapeFailures"] >= 3


async def test_deeply_nested_engine_json_is_a_counted_bad_answer_not_an_exception() -> None:
    view = await _view_after(FakeEngine(loads=b"[" * 200_000), 0.6)
    assert view["fresh"] is False and "nested too deep" in view["scrapeError"]
    assert view["scrapeFailures"] >= 3
    assert "specgate_pod_rejected_metrics_total{" in view["metrics"]


async def test_a_step_profile_past_the_contracts_points_is_refused() -> None:
    points = [[b, 0.01 + b * 1e-6] for b in range(1, 5001)]
    loads = json.loads(json.dumps(IDLE_LOADS))
    loads["loads"][0]["speculative"]["step_profile"] = {"on": points, "off": points}
    view = await _view_after(FakeEngine(loads=json.dumps(loads).encode()), 0.6)
    assert view["prediction"] == {"error": view["prediction"]["error"]}
    assert "1-64" in view["prediction"]["error"]


@pytest.mark.parametrize("broken", ["never applies", "answers a string"])
async def test_pushes_to_an_engine_that_fails_them_back_off(
    broken: str, caplog: pytest.LogCaptureFixture
) -> None:
    """An engine that accepts a push and never applies it, or whose /server_info is not an
    object, is pushed to less and less often (0.5 s doubling), not once a second forever,
    and logs no traceback."""
    engine = FakeEngine(applies_pushes=broken != "never applies")
    if broken == "answers a string":
        engine.server_info = lambda threshold: b'"a string"'
    with caplog.at_level(logging.WARNING):
        view = await _view_after(engine, 8.0, mode="off")
    # Backing off from 0.5 s (doubling, jittered 0.5-1.5x), eight seconds hold at most six
    # pushes; a retry every second would make eight or more.
    assert 2 <= len(engine.pushes) <= 6, engine.pushes
    # Each push failed and was counted, but for one in flight when the view was read (the
    # engine has it, the router has not yet seen it fail).
    assert len(engine.pushes) - 1 <= view["pushFailures"] <= len(engine.pushes)
    assert not [r for r in caplog.records if r.exc_info], "a traceback was logged"


async def _huge_answer(request: web.Request) -> web.StreamResponse:
    response = web.StreamResponse(headers={"Content-Type": "application/json"})
    await response.prepare(request)
    await response.write(b'{"choices": [{"message": {"content": "')
    for _ in range(20):
        await response.write(b"a" * (1 << 20))
    await response.write(b'"}}], "usage": {"completion_tokens": 7}}')
    await response.write_eof()
    return response


async def test_a_huge_non_streamed_answer_is_passed_through_not_held() -> None:
    """A 20 MB answer reaches the client whole, relayed as it comes (chunked, where a held
    answer would carry its length), and its tokens are still counted from its tail."""
    engine = FakeEngine(answer=_huge_answer)
    async with (
        fake_engine(engine),
        httpx.AsyncClient(timeout=30) as http,
        run_router(router_settings([engine.url])) as r,
    ):
        resp = await http.post(r.url + CHAT, json=chat())
        metrics = (await http.get(r.url + "/metrics")).text
    assert resp.status_code == 200
    assert len(resp.content) > 20 * (1 << 20) and resp.json()["usage"]["completion_tokens"] == 7
    assert "content-length" not in resp.headers
    assert re.search(r'specgate_router_output_tokens_total\{traffic_class="\w+"\} 7\.0', metrics)


async def _refuses_key(request: web.Request) -> web.Response:
    return web.Response(status=401, text="bad key")


async def _cut_stream(request: web.Request) -> web.StreamResponse:
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await response.prepare(request)
    await response.write(b'data: {"choices": [{"delta": {"content": "a"}}]}\n\n')
    request.transport.close()  # type: ignore[union-attr]
    return response


async def test_no_answer_names_a_pods_address() -> None:
    """A pod that refuses the router's key, one that breaks mid-stream, and the pod header:
    what the client sees carries no address (the log keeps it)."""
    for answer, stream in ((_refuses_key, False), (_cut_stream, True)):
        engine = FakeEngine(answer=answer)
        async with (
            fake_engine(engine),
            httpx.AsyncClient(timeout=10) as http,
            run_router(router_settings([engine.url])) as r,
        ):
            resp = await http.post(r.url + CHAT, json=chat(stream=stream))
        address = engine.url.removeprefix("http://")
        assert address not in resp.text and "127.0.0.1" not in resp.text, resp.text
        assert address not in resp.headers.get("x-specgate-pod", "")
        if stream:
            assert "failed mid-stream" in resp.text
        else:
            assert resp.status_code == 502 and "refused the router's API key" in resp.text


SETTINGS = RouterSettings(backends=["http://x"], model="m")


@pytest.mark.parametrize(
    ("body", "field"),
    [
        (b'"max_tokens": ' + b"9" * 5000, "max_tokens"),
        (b'"logit_bias": {"5": ' + b"1" * 50 + b"}", "logit_bias.5"),
        (b'"n": -' + b"1" * 4400, "n"),
    ],
)
def test_an_enormous_integer_gets_400_naming_its_field(body: bytes, field: str) -> None:
    raw = b'{"model": "m", "messages": [{"role": "user", "content": "x"}], ' + body + b"}"
    with pytest.raises(BadRequest) as info:
        routed.parse("/v1/chat/completions", raw, {}, SETTINGS)
    assert info.value.message.startswith(f"{field}: an integer of ")


async def test_an_enormous_integer_is_a_400_over_http_not_a_500() -> None:
    async with (
        run_router(router_settings(["http://127.0.0.1:9"]), ready=False) as r,
        httpx.AsyncClient(timeout=10) as http,
    ):
        raw = b'{"model": "m", "messages": [], "max_tokens": ' + b"9" * 5000 + b"}"
        resp = await http.post(
            r.url + CHAT, content=raw, headers={"Content-Type": "application/json"}
        )
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "max_tokens"


async def test_every_server_the_product_starts_bounds_request_heads() -> None:
    """`specgate up` (the local stack) and the simulated pods serve with the router's head
    bounds: a 1 MiB header gets 431 at the parser; an ordinary request is served."""
    cfg = StackConfig(pods=1, port=free_ports(1)[0], time_scale=10.0)
    async with running_stack(cfg) as stack:
        for url in (stack.router_url, stack.engine_urls[0]):
            port = int(url.rsplit(":", 1)[1])
            get = b"GET /health HTTP/1.1\r\nhost: x\r\n"
            huge = await _raw(port, get + b"x-big: " + b"a" * (1 << 20) + b"\r\n\r\n")
            assert huge.startswith(b"HTTP/1.1 431"), (url, huge[:100])
            ok = await _raw(port, get + b"connection: close\r\n\r\n")
            assert ok.startswith(b"HTTP/1.1 "), (url, ok[:100])
            assert not ok.startswith(b"HTTP/1.1 431")


async def test_a_simulated_pod_refuses_a_body_past_the_routers_limit() -> None:
    async with sims(1) as pods, httpx.AsyncClient(timeout=30) as http:
        headers = {"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"}
        big = b'{"text": "' + b"a" * (5 << 20) + b'"}'
        resp = await http.post(pods.urls[0] + "/generate", content=big, headers=headers)
        assert resp.status_code == 413
        deep = b'{"text": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
        resp = await http.post(pods.urls[0] + "/generate", content=deep, headers=headers)
        assert resp.status_code == 400
