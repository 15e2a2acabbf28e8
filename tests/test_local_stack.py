"""`specgate up`: the local stack (simulated pods and the router on localhost), in process and as
the command a user runs."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import replace

import httpx
import pytest

from specgate_sim.cluster import free_ports
from specgate_sim.local import StackConfig, running_stack, sglang_command, sglang_env

pytestmark = pytest.mark.integration


def test_a_real_engine_gets_the_off_step_flag_only_where_it_differs_from_sglangs_default() -> None:
    base = StackConfig(engine="sglang", model_path="/m/target", draft_model_path="/m/draft")
    plain = sglang_command(base, 30000)
    assert "--speculative-off-step-tokens" not in plain
    four = sglang_command(replace(base, off_step_tokens=4), 30000)
    flag = four.index("--speculative-off-step-tokens")
    assert four[flag + 1] == "4"
    cut = "--speculative-disable-batch-threshold"
    assert four[: four.index(cut)] == plain[: plain.index(cut)]  # the rest as before
    assert not any("api-key" in a for a in plain)  # the key: in the environment only
    assert sglang_env("k", 1)["SGLANG_API_KEY"] == "k"
    with pytest.raises(SystemExit, match="--off-step-tokens 5: at most 4 with --engine sglang"):
        sglang_command(replace(base, off_step_tokens=5), 30000)


async def test_the_stacks_pods_decode_off_steps_of_the_configured_tokens() -> None:
    """With the router holding speculation off, a request through it decodes on a pod four
    tokens a step: of 13 new tokens the prefill gives 1, then three decode steps 4 each (12
    steps with SGLang's one-token step)."""
    cfg = StackConfig(
        pods=1,
        port=free_ports(1)[0],
        threshold=0,
        time_scale=20.0,
        off_step_tokens=4,
        control={"mode": "off"},
    )
    async with running_stack(cfg) as stack, httpx.AsyncClient(timeout=30) as http:
        assert stack.sims is not None
        body = {"model": cfg.model, "prompt": "hi", "max_tokens": 13, "ignore_eos": True}
        resp = await http.post(stack.router_url + "/v1/completions", json=body)
        assert resp.status_code == 200, resp.text
        assert resp.json()["usage"]["completion_tokens"] == 13
        stats = stack.sims.pods[0].core.stats
        assert (stats.decode_steps_on, stats.decode_steps_off) == (0, 3)


def test_specgate_up_serves_through_the_router_and_stops_on_ctrl_c() -> None:
    port = free_ports(1)[0]
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "specgate.cli",
            "up",
            "--pods",
            "2",
            "--port",
            str(port),
            "--time-scale",
            "20",
            "--off-step-tokens",
            "4",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        assert proc.stdout is not None
        first = proc.stdout.readline()
        assert f"router (OpenAI API) at http://127.0.0.1:{port}/v1" in first, first
        engines = [proc.stdout.readline() for _ in range(2)]
        assert all("engine pod (sim) at http://127.0.0.1:" in line for line in engines), engines
        body = {
            "model": "sim-model",
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 8,
        }
        deadline = time.monotonic() + 30
        while True:  # the router admits traffic once it has scraped its pods
            resp = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=body, timeout=30)
            if resp.status_code == 200 or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert resp.status_code == 200, resp.text
        assert resp.json()["usage"]["completion_tokens"] == 8
        # The official OpenAI client, as the README shows it: a completion and a stream.
        from openai import OpenAI

        client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", timeout=30)
        chat = client.chat.completions.create(
            model="sim-model", messages=[{"role": "user", "content": "hi"}], max_tokens=6
        )
        assert chat.choices[0].message.content and chat.usage is not None
        assert chat.usage.completion_tokens == 6
        stream = client.chat.completions.create(
            model="sim-model",
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=5,
            stream=True,
        )
        pieces = [c.choices[0].delta.content for c in stream if c.choices]
        assert "".join(p for p in pieces if p)
        assert [m.id for m in client.models.list()] == ["sim-model"]
        pods = httpx.get(f"http://127.0.0.1:{port}/specgate/pods", timeout=10).json()["pods"]
        assert len(pods) == 2
        # Ctrl-C with a long stream open: the stream ends at once with an error event and
        # [DONE], and the stack stops with no traceback.
        long = {**body, "max_tokens": 30_000, "stream": True}
        with httpx.stream("POST", f"http://127.0.0.1:{port}/v1/chat/completions", json=long,
                          timeout=60) as streamed:  # fmt: skip
            assert streamed.status_code == 200, streamed.read()
            lines = streamed.iter_lines()
            assert next(line for line in lines if line.startswith("data: {"))
            interrupted = time.monotonic()
            proc.send_signal(signal.SIGINT)
            rest = [line for line in lines if line.startswith("data: ")]
        assert time.monotonic() - interrupted < 5
        assert rest[-1] == "data: [DONE]" and "stopping" in rest[-2], rest[-3:]
        out, _ = proc.communicate(timeout=60)
        assert proc.returncode == 0, out[-2000:]
        assert "stopping: draining the router, then the engines" in out
        assert "Traceback" not in out and "CancelledError" not in out, out[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.parametrize("command", ["up", "sim"])
def test_a_bad_off_step_setting_is_refused_naming_the_flag(command: str) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "specgate.cli", command, "--off-step-tokens", "0"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2
    assert "argument --off-step-tokens: 0: must be at least 1" in result.stderr
