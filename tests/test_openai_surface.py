"""The OpenAI surface as clients and benchmark tools expect it: `/health`, `/v1/models/{id}`,
complete model objects, and one error shape (OpenAI's) whatever produced the error; log lines
that are all JSON, stamped to the millisecond in UTC."""

from __future__ import annotations

import json
import logging
import re
import subprocess
import sys
import time

import httpx
from aiohttp import web

from specgate import logs

from .router_harness import run_router
from .test_hostile_engine import FakeEngine, fake_engine
from .test_router_http import CHAT, chat, router_settings, sims


def _openai_error(resp: httpx.Response, status: int) -> dict[str, object]:
    assert resp.status_code == status, resp.text
    body = resp.json()
    assert set(body) == {"error"}, body
    assert {"message", "type", "param", "code"} <= set(body["error"]), body
    error: dict[str, object] = body["error"]
    return error


async def test_health_and_model_objects_as_openai_clients_expect() -> None:
    async with (
        sims(1) as pods,
        run_router(router_settings(pods.urls)) as r,
        httpx.AsyncClient(timeout=10) as http,
    ):
        assert (await http.get(r.url + "/health")).status_code == 200
        listed = (await http.get(r.url + "/v1/models")).json()["data"]
        assert listed == [(await http.get(r.url + "/v1/models/m")).json()]
        assert listed[0]["id"] == "m" and listed[0]["object"] == "model"
        assert isinstance(listed[0]["created"], int) and listed[0]["created"] <= time.time()
        missing = _openai_error(await http.get(r.url + "/v1/models/other"), 404)
        assert missing["code"] == "model_not_found" and "other" in str(missing["message"])
    # No usable pod: /health says so, as /readyz does.
    async with (
        run_router(router_settings(["http://127.0.0.1:9"]), ready=False) as r,
        httpx.AsyncClient(timeout=10) as http,
    ):
        assert (await http.get(r.url + "/health")).status_code == 503


async def test_every_error_has_openais_shape() -> None:
    async with (
        run_router(router_settings(["http://127.0.0.1:9"]), ready=False) as r,
        httpx.AsyncClient(timeout=10) as http,
    ):
        unknown = _openai_error(await http.get(r.url + "/v1/nothing-here"), 404)
        assert unknown["type"] == "invalid_request_error"
        _openai_error(await http.delete(r.url + "/v1/chat/completions"), 405)
        _openai_error(await http.get(r.url + "/specgate/samples", params={"pod": "x"}), 404)


async def _sglang_error(request: web.Request) -> web.Response:
    body = {"object": "error", "message": "prompt too long", "type": "BadRequestError",
            "param": None, "code": 400}  # fmt: skip
    return web.json_response(body, status=400)


async def _plain_error(request: web.Request) -> web.Response:
    return web.Response(status=422, text="unprocessable")


async def test_an_engines_own_error_reaches_the_client_in_openais_shape() -> None:
    for answer, status, message in ((_sglang_error, 400, "prompt too long"),
                                    (_plain_error, 422, "unprocessable")):  # fmt: skip
        engine = FakeEngine(answer=answer)
        async with (
            fake_engine(engine),
            run_router(router_settings([engine.url])) as r,
            httpx.AsyncClient(timeout=10) as http,
        ):
            error = _openai_error(await http.post(r.url + CHAT, json=chat()), status)
        assert error["message"] == message and error["code"] == status


def test_log_lines_carry_utc_milliseconds() -> None:
    record = logging.makeLogRecord({"msg": "x", "created": 1_700_000_000.25, "msecs": 250.0})
    line = json.loads(logs.JsonFormatter().format(record))
    assert line["ts"] == "2023-11-14T22:13:20.250Z"


def test_extra_fields_are_data_and_objects_are_left_out() -> None:
    """kopf attaches its settings object to every record: a repr of a kilobyte a line."""
    record = logging.makeLogRecord(
        {"msg": "x", "request_id": "r1", "k8s_ref": {"name": "demo"}, "settings": object()}
    )
    line = json.loads(logs.JsonFormatter().format(record))
    assert line["request_id"] == "r1" and line["k8s_ref"] == {"name": "demo"}
    assert "settings" not in line


def test_every_line_the_router_logs_is_json() -> None:
    """uvicorn's own start-up and shutdown lines included."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "specgate.cli", "router", "--port", "18931", "--host",
         "127.0.0.1", "--backend", "http://127.0.0.1:9", "--log-level", "info"],
        stderr=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        for _ in range(100):
            try:
                httpx.get("http://127.0.0.1:18931/healthz", timeout=1)
                break
            except httpx.HTTPError:
                time.sleep(0.1)
    finally:
        proc.terminate()
        _, err = proc.communicate(timeout=30)
    lines = [line for line in err.splitlines() if line.strip()]
    assert any("uvicorn" in line for line in lines), err
    for line in lines:
        parsed = json.loads(line)
        assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z", parsed["ts"]), line
