"""`specgate smoke URL`: one request of each kind a client sends, through a router (what
`helm test` runs against a SpecDecodeDeployment, and what a user runs after an install).

Steps, each one line on stdout, stopping at the first that fails: `GET /health`, `GET
/v1/models` (the model to ask: the given one or the first served), a chat completion, and the
same one streamed to its `[DONE]`. Every wait and every answer is bounded.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import httpx

MAX_ANSWER_BYTES = 1 << 20
TIMEOUT_SECONDS = 60.0
PROMPT = [{"role": "user", "content": "Say hello in five words."}]
MAX_TOKENS = 16


class SmokeFailure(Exception):
    """A step that did not answer as a client expects; the message names it and the answer."""


@dataclass(frozen=True)
class Step:
    name: str
    status: int
    seconds: float
    detail: str = ""

    def line(self) -> str:
        tail = f": {self.detail}" if self.detail else ""
        return f"ok {self.name} {self.status} ({self.seconds * 1000:.0f} ms){tail}"


def _read(response: httpx.Response) -> bytes:
    body = b""
    for chunk in response.iter_bytes():
        body += chunk
        if len(body) > MAX_ANSWER_BYTES:
            raise SmokeFailure(f"the answer is over {MAX_ANSWER_BYTES >> 20} MiB")
    return body


def _error(name: str, status: int, body: bytes) -> SmokeFailure:
    text = body[:300].decode("utf-8", "replace").strip()
    hint = {
        401: ": the router wants a client key (--api-key-env, or tests.apiKeySecret in the chart)",
        403: ": this key may not send this traffic class",
        404: ": no such path or model (check the URL and --model)",
        503: ": no engine pod is ready yet",
    }.get(status, "")
    return SmokeFailure(f"{name}: HTTP {status}{hint}: {text}")


def _json(name: str, body: bytes) -> dict[str, Any]:
    try:
        value = json.loads(body)
    except ValueError:
        raise SmokeFailure(f"{name}: the answer is not JSON: {body[:120]!r}") from None
    if not isinstance(value, dict):
        raise SmokeFailure(f"{name}: the answer is not a JSON object")
    return value


def _events(lines: Iterator[str], name: str) -> tuple[int, bool]:
    """Content chunks of a stream and whether it ended with [DONE]."""
    chunks, size = 0, 0
    for line in lines:
        size += len(line)
        if size > MAX_ANSWER_BYTES:
            raise SmokeFailure(f"{name}: the stream is over {MAX_ANSWER_BYTES >> 20} MiB")
        if not line.startswith("data:"):
            continue
        data = line.removeprefix("data:").strip()
        if data == "[DONE]":
            return chunks, True
        event = _json(name, data.encode())
        if "error" in event:
            raise SmokeFailure(f"{name}: the stream ended with an error: {event['error']}")
        chunks += 1
    return chunks, False


def run(
    url: str,
    *,
    model: str | None = None,
    api_key: str | None = None,
    wait_seconds: float = 0.0,
    client: httpx.Client | None = None,
    report: Callable[[str], None] = print,
    sleep: Callable[[float], None] = time.sleep,
) -> list[Step]:
    """The steps against the router at `url`; SmokeFailure at the first that fails. Until
    `wait_seconds` have passed, a router that does not answer yet, or answers 503 (no engine
    pod ready), is asked again every second."""
    if client is None:
        with httpx.Client(timeout=TIMEOUT_SECONDS) as own:
            return run(url, model=model, api_key=api_key, wait_seconds=wait_seconds,
                       client=own, report=report, sleep=sleep)  # fmt: skip
    deadline = time.monotonic() + max(0.0, wait_seconds)
    http = client
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    base = url.rstrip("/")
    steps: list[Step] = []

    def call(
        method: str, path: str, body: dict[str, Any] | None = None
    ) -> tuple[int, bytes, float]:
        while True:
            started = time.monotonic()
            try:
                with http.stream(method, base + path, json=body, headers=headers) as response:
                    data = _read(response)
            except httpx.TransportError as exc:
                if time.monotonic() < deadline:
                    sleep(1.0)
                    continue
                raise SmokeFailure(f"{method} {path}: {exc or type(exc).__name__}") from None
            if response.status_code == 503 and time.monotonic() < deadline:
                sleep(1.0)
                continue
            if response.status_code != 200:
                raise _error(f"{method} {path}", response.status_code, data)
            return response.status_code, data, time.monotonic() - started

    def done(step: Step) -> None:
        steps.append(step)
        report(step.line())

    status, _, seconds = call("GET", "/health")
    done(Step("GET /health", status, seconds))

    status, data, seconds = call("GET", "/v1/models")
    served = [
        m.get("id") for m in _json("GET /v1/models", data).get("data") or [] if isinstance(m, dict)
    ]
    if model is None:
        if not served or not isinstance(served[0], str):
            raise SmokeFailure("GET /v1/models: the router serves no model")
        model = served[0]
    elif model not in served:
        raise SmokeFailure(f"GET /v1/models: {model!r} is not served (served: {served})")
    done(Step("GET /v1/models", status, seconds, model))

    name = "POST /v1/chat/completions"
    request = {"model": model, "messages": PROMPT, "max_tokens": MAX_TOKENS}
    status, data, seconds = call("POST", "/v1/chat/completions", request)
    answer = _json(name, data)
    try:
        content = answer["choices"][0]["message"]["content"]
        tokens = answer["usage"]["completion_tokens"]
    except (KeyError, IndexError, TypeError):
        raise SmokeFailure(f"{name}: no choices[0].message.content or usage") from None
    if not isinstance(content, str) or not isinstance(tokens, int) or tokens < 1:
        raise SmokeFailure(f"{name}: no tokens came back")
    done(Step(name, status, seconds, f"{tokens} tokens"))

    name = "POST /v1/chat/completions (stream)"
    started = time.monotonic()
    try:
        with http.stream(
            "POST", base + "/v1/chat/completions", headers=headers,
            json={**request, "stream": True},
        ) as response:  # fmt: skip
            if response.status_code != 200:
                raise _error(name, response.status_code, _read(response))
            chunks, finished = _events(response.iter_lines(), name)
    except httpx.HTTPError as exc:
        raise SmokeFailure(f"{name}: {exc or type(exc).__name__}") from None
    if not finished:
        raise SmokeFailure(f"{name}: the stream ended without [DONE] after {chunks} events")
    done(Step(name, 200, time.monotonic() - started, f"{chunks} events, [DONE]"))
    return steps


__all__ = ["SmokeFailure", "Step", "run"]
