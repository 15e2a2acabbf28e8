"""`specgate smoke` (what the chart's `helm test` runs): a client's requests through a real
router, passing where the router serves and failing in one line that says why where it does
not."""

from __future__ import annotations

import asyncio
import os
import re
import subprocess
import sys
import time

import httpx
import pytest

from specgate import smoke
from specgate_router import client_auth

from .router_harness import run_router
from .test_client_auth import _key
from .test_router_http import router_settings, sims
from .tools import specgate_up

pytestmark = pytest.mark.integration


def _smoke(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "specgate.cli", "smoke", *args],
        capture_output=True, text=True, timeout=120,
        env={"PATH": os.environ["PATH"], **env},
    )  # fmt: skip


def test_the_smoke_test_passes_through_specgate_up_and_fails_in_one_line() -> None:
    with specgate_up() as url:
        # Started together with the stack: it waits for the router and its pods.
        done = _smoke(url, "--wait", "60")
        assert done.returncode == 0, done.stderr
        lines = done.stdout.splitlines()
        assert [re.sub(r" \(\d+ ms\).*", "", line) for line in lines] == [
            "ok GET /health 200",
            "ok GET /v1/models 200",
            "ok POST /v1/chat/completions 200",
            "ok POST /v1/chat/completions (stream) 200",
        ]
        assert lines[1].endswith(": sim-model") and lines[3].endswith("[DONE]")
        missing = _smoke(url, "--model", "llama")
        assert missing.returncode == 1 and missing.stderr.count("\n") == 1
        assert "'llama' is not served (served: ['sim-model'])" in missing.stderr
    started = time.monotonic()
    gone = _smoke(url, "--wait", "1")
    assert gone.returncode == 1 and gone.stderr.startswith("error: GET /health: ")
    assert time.monotonic() - started < 30  # the wait is bounded
    bad = _smoke("demo-router:8000")
    assert bad.returncode == 2 and "http(s)://HOST[:PORT]" in bad.stderr


async def test_a_router_that_wants_a_key_is_named_as_the_failure() -> None:
    key = client_auth.new_key()
    keys = [_key("tester", key).model_dump(by_alias=True)]
    async with sims(1) as cluster:
        settings = router_settings(cluster.urls, clientAuth={"keys": keys})
        async with run_router(settings) as router:
            with pytest.raises(smoke.SmokeFailure, match="HTTP 401: the router wants a client key"):
                await asyncio.to_thread(smoke.run, router.url, report=lambda _: None)
            lines: list[str] = []
            steps = await asyncio.to_thread(
                smoke.run, router.url, api_key=key, wait_seconds=30, report=lines.append
            )
    assert [s.status for s in steps] == [200] * 4 and len(lines) == 4


def test_an_answer_that_is_not_what_a_client_expects_fails() -> None:
    def pod(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"data": [{"id": "m"}]})
        if request.url.path == "/v1/chat/completions":
            return httpx.Response(200, json={"choices": []})
        return httpx.Response(200)

    with (
        httpx.Client(transport=httpx.MockTransport(pod)) as client,
        pytest.raises(smoke.SmokeFailure, match=r"no choices\[0\]\.message\.content"),
    ):
        smoke.run("http://router", client=client, report=lambda _: None)
