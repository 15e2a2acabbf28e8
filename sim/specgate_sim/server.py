"""The HTTP face of a simulated pod: SGLang 0.5.17's endpoints and shapes, plus the patch's
control contract (`specgate.contract`).

Checked against the 0.5.17 source: `/v1/loads` (entrypoints/v1_loads.py, LoadSnapshot),
`/server_info` (server args + `internal_states`), `/set_internal_state` (a list of booleans),
`/flush_cache` (idle engines only), auth (utils/auth.py: /health* and /metrics need no key,
everything else a Bearer key), metric names (observability/metrics_collector.py), native
`/generate` SSE ending in `data: [DONE]`.
"""

from __future__ import annotations

import asyncio
import json
import math
import secrets
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
)
from prometheus_client.registry import Collector
from starlette.types import ASGIApp, Receive, Scope, Send

from specgate import contract
from specgate_sim.engine import Histogram
from specgate_sim.pod import SimPod

SGLANG_VERSION = "0.5.17"
OPEN_PATHS = ("/health", "/metrics")  # SGLang serves these without the API key


def _error(status: int, message: str, kind: str = "BadRequestError") -> JSONResponse:
    return JSONResponse(
        {"object": "error", "message": message, "type": kind, "param": None, "code": status},
        status_code=status,
    )


def _sse(payload: Any) -> bytes:
    return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"


def _words(n: int, start: int) -> str:
    return "".join(f" t{i}" for i in range(start, start + n))


def _prompt_tokens_of_text(text: str) -> int:
    return max(1, math.ceil(len(text.split()) * 1.3))


class PodMetrics(Collector):
    """Reads the engine's counters at scrape time (no second copy of the numbers)."""

    def __init__(self, pod: SimPod) -> None:
        self.pod = pod

    def collect(self) -> Any:
        pod, stats = self.pod, self.pod.core.stats
        labels = {"model_name": pod.settings.model, "tp_rank": "0", "pp_rank": "0"}
        names, values = list(labels), list(labels.values())

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(name, doc, labels=names)
            g.add_metric(values, value)
            return g

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            c = CounterMetricFamily(name, doc, labels=names)
            c.add_metric(values, value)
            return c

        def histogram(name: str, doc: str, h: Histogram) -> HistogramMetricFamily:
            fam = HistogramMetricFamily(name, doc, labels=names)
            buckets = [("+Inf" if b == math.inf else str(b), c) for b, c in h.cumulative()]
            fam.add_metric(values, buckets, h.total)
            return fam

        accept = stats.accept_length()
        k = pod.profile.num_steps
        yield gauge(
            contract.METRIC_RUNNING, "The number of running requests.", len(pod.core.running)
        )
        yield gauge(
            contract.METRIC_QUEUED,
            "The number of requests in the waiting queue.",
            len(pod.core.waiting),
        )
        yield gauge(
            "sglang:gen_throughput", "The generation throughput (token/s).", pod.gen_throughput()
        )
        yield gauge("sglang:token_usage", "The token usage.", pod.core.token_usage())
        yield gauge(
            contract.METRIC_ACCEPT_LENGTH,
            "The average acceptance length of speculative decoding (speculating steps).",
            accept,
        )
        yield gauge(
            "sglang:spec_accept_rate",
            "The acceptance rate of drafted tokens.",
            (accept - 1) / k if accept else 0.0,
        )
        yield gauge("sglang:spec_num_steps", "Draft steps per speculative step.", k)
        yield gauge("sglang:spec_num_draft_tokens", "Tokens verified per request.", k + 1)
        yield gauge(
            contract.METRIC_THRESHOLD,
            "Speculation-disable batch threshold (-1: always speculate).",
            contract.threshold_gauge(pod.core.threshold),
        )
        steps = CounterMetricFamily(
            contract.METRIC_DECODE_STEPS.removesuffix("_total"),
            "Decode steps by speculation mode.",
            labels=[*names, "mode"],
        )
        steps.add_metric([*values, "on"], stats.decode_steps_on)
        steps.add_metric([*values, "off"], stats.decode_steps_off)
        yield steps
        yield counter(
            "sglang:spec_verify_calls", "Speculative verify forward passes.", stats.decode_steps_on
        )
        yield counter("sglang:num_requests", "Number of requests received.", stats.requests)
        yield counter(
            "sglang:prompt_tokens", "Number of prefill tokens processed.", stats.prompt_tokens
        )
        yield counter(
            contract.METRIC_GEN_TOKENS.removesuffix("_total"),
            "Number of generation tokens processed.",
            stats.generation_tokens,
        )
        yield histogram("sglang:time_to_first_token_seconds", "Time to first token.", stats.ttft)
        yield histogram("sglang:e2e_request_latency_seconds", "End-to-end latency.", stats.e2e)
        yield histogram("sglang:inter_token_latency_seconds", "Inter-token latency.", stats.itl)


def create_app(pod: SimPod) -> FastAPI:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(PodMetrics(pod))
    settings = pod.settings

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await pod.start()
        try:
            yield
        finally:
            await pod.stop()

    app = FastAPI(title=f"simulated SGLang pod {settings.name}", lifespan=lifespan)

    def _too_long(prompt: int, new: int) -> str | None:
        limit = pod.profile.context_length
        if prompt + new > limit:
            return (
                f"Requested token count exceeds the model's maximum context length of {limit}"
                f" tokens: {prompt} in the prompt + {new} to generate"
            )
        return None

    def server_args() -> dict[str, Any]:
        return {
            "model_path": settings.model,
            "served_model_name": settings.model,
            "tp_size": settings.tp_size,
            "max_running_requests": pod.core.max_running,
            "context_length": pod.profile.context_length,
            "speculative_algorithm": "EAGLE3",
            "speculative_num_steps": pod.profile.num_steps,
            "speculative_eagle_topk": 1,
            "speculative_num_draft_tokens": pod.profile.num_steps + 1,
            "speculative_off_step_tokens": pod.core.off_step_tokens,
            contract.THRESHOLD_KEY: pod.core.threshold,
        }

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200 if pod.alive else 503)

    @app.get("/health_generate")
    async def health_generate() -> Response:
        if not pod.alive:
            return Response(status_code=503)
        async for _ in pod.generate(1, 1):
            pass
        return Response(status_code=200)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(registry), media_type="text/plain; version=0.0.4")

    @app.get("/server_info")
    async def server_info() -> dict[str, Any]:
        stats = pod.core.stats
        return {
            **server_args(),
            "internal_states": [
                {
                    "avg_spec_accept_length": stats.accept_length(),
                    "speculative_num_steps": pod.profile.num_steps,
                    contract.THRESHOLD_KEY: pod.core.threshold,
                    "decode_steps_on": stats.decode_steps_on,
                    "decode_steps_off": stats.decode_steps_off,
                }
            ],
            "version": SGLANG_VERSION,
            "startup_time": pod.started_at,
        }

    @app.get("/v1/loads")
    async def loads(include: str | None = None) -> Response:
        sections = {s.strip() for s in include.split(",")} if include else {"all"}
        valid = {"core", "memory", "spec", "lora", "disagg", "queues", "all"}
        if not sections <= valid:
            bad = ", ".join(sorted(sections - valid))
            return JSONResponse({"detail": f"Invalid include sections: {bad}"}, status_code=400)
        core, stats = pod.core, pod.core.stats
        load: dict[str, Any] = {
            "timestamp": time.time(),
            "dp_rank": 0,
            "num_running_reqs": len(core.running),
            "num_waiting_reqs": len(core.waiting),
            "max_running_requests": core.max_running,
            "max_total_num_tokens": pod.profile.max_total_tokens,
            "token_usage": core.token_usage(),
            "gen_throughput": pod.gen_throughput(),
            "utilization": 1.0 if core.has_work() else 0.0,
            # In wall-clock microseconds, as a client of a time-scaled pod sees its steps.
            "decode_moments": [
                v / (settings.time_scale if i in (2, 4) else 1.0)
                for i, v in enumerate(stats.decode_moments)
            ]
            if stats.decode_moments[0]
            else None,
        }
        if sections & {"spec", "all"}:
            accept = stats.live_accept_length()
            load["speculative"] = {
                "accept_length": accept,
                "accept_rate": (accept - 1) / pod.profile.num_steps if accept else None,
                # Added by the specgate patch:
                "disable_batch_threshold": core.threshold,
                "speculating": core.speculating,
                "decode_steps_on": stats.decode_steps_on,
                "decode_steps_off": stats.decode_steps_off,
            }
            if settings.model_inputs:  # contract.STEP_PROFILE, ACCEPTANCE_COUNTERS
                load["speculative"] |= {
                    contract.STEP_PROFILE: pod.step_profile,
                    "num_steps": pod.profile.num_steps,
                    "off_step_tokens": core.off_step_tokens,
                    **{name: getattr(stats, name) for name in contract.ACCEPTANCE_COUNTERS},
                    "uninterrupted_decode_steps": stats.uninterrupted_decode_steps,
                    # Wall-clock, as the decode moments.
                    "uninterrupted_decode_us": stats.uninterrupted_decode_us / settings.time_scale,
                }
        return JSONResponse(
            {
                "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S+00:00", time.gmtime()),
                "version": SGLANG_VERSION,
                "accelerator": f"simulated ({pod.profile.name})",
                "num_accelerators": settings.tp_size,
                "loads": [load],
            }
        )

    @app.api_route("/set_internal_state", methods=["POST", "PUT"])
    async def set_internal_state(request: Request) -> Response:
        body = await _json(request)
        if isinstance(body, Response):
            return body
        try:
            threshold = contract.parse_set_request(body)
        except contract.ThresholdError as exc:
            return _error(400, str(exc))
        pod.core.set_threshold(threshold)
        return JSONResponse([True])

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache(timeout: float = 0.0) -> Response:
        # SGLang flushes only an idle engine, waiting up to `timeout` s for it to become one.
        # A simulated pod keeps no prefix cache: there is nothing else to empty.
        if timeout < 0:
            return _error(400, "timeout: a number of seconds >= 0")
        until = time.monotonic() + timeout
        while pod.core.has_work() and time.monotonic() < until:
            await asyncio.sleep(0.02)
        if pod.core.has_work():
            return Response(
                "Cache not flushed because there are pending requests.\n", status_code=400
            )
        return Response("Cache flushed.\n", status_code=200)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {
            "object": "list",
            "data": [
                {
                    "id": settings.model,
                    "object": "model",
                    "created": int(pod.started_at),
                    "owned_by": "sglang",
                    "root": settings.model,
                    "max_model_len": pod.profile.context_length,
                }
            ],
        }

    @app.post("/generate")
    async def generate(request: Request) -> Response:
        body = await _json_object(request)
        if isinstance(body, Response):
            return body
        params = body.get("sampling_params") or {}
        max_new = params.get("max_new_tokens", 128)
        if not isinstance(max_new, int) or isinstance(max_new, bool) or max_new < 1:
            return _error(400, "sampling_params.max_new_tokens must be a positive integer")
        if "input_ids" in body:
            ids = body["input_ids"]
            if not isinstance(ids, list) or not all(isinstance(i, int) for i in ids):
                return _error(400, "input_ids must be a list of integers")
            prompt = len(ids)
        elif isinstance(body.get("text"), str):
            prompt = _prompt_tokens_of_text(body["text"])
        else:
            return _error(400, "either text or input_ids is required")
        if (problem := _too_long(prompt, max_new)) is not None:
            return _error(400, problem)
        rid = body.get("rid") or secrets.token_hex(8)

        def meta(completion: int, done: bool) -> dict[str, Any]:
            return {
                "id": rid,
                "prompt_tokens": prompt,
                "completion_tokens": completion,
                "finish_reason": {"type": "length", "length": completion} if done else None,
                "spec_accept_length": pod.core.stats.accept_length(),
            }

        if body.get("stream"):

            async def stream() -> AsyncIterator[bytes]:
                done_tokens = 0
                async for n in pod.generate(prompt, max_new):
                    done_tokens += n
                    finished = done_tokens >= max_new
                    yield _sse(
                        {
                            "text": _words(done_tokens, 0),
                            "output_ids": list(range(done_tokens)),
                            "meta_info": meta(done_tokens, finished),
                        }
                    )
                yield b"data: [DONE]\n\n"

            return StreamingResponse(stream(), media_type="text/event-stream")
        total = await _count(pod.generate(prompt, max_new))
        return JSONResponse(
            {
                "text": _words(total, 0),
                "output_ids": list(range(total)),
                "meta_info": meta(total, True),
            }
        )

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await _openai(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await _openai(request, chat=True)

    async def _openai(request: Request, *, chat: bool) -> Response:
        body = await _json_object(request)
        if isinstance(body, Response):
            return body
        if chat:
            messages = body.get("messages")
            if not isinstance(messages, list) or not messages:
                return _error(400, "messages must be a non-empty list")
            text = " ".join(str(m.get("content", "")) for m in messages if isinstance(m, dict))
            prompt = _prompt_tokens_of_text(text) + 4 * len(messages)
        else:
            raw = body.get("prompt")
            if isinstance(raw, str):
                prompt = _prompt_tokens_of_text(raw)
            elif isinstance(raw, list) and raw and all(isinstance(i, int) for i in raw):
                prompt = len(raw)
            else:
                return _error(400, "prompt must be a string or a list of token ids")
        default_max = 128 if chat else 16
        max_tokens = body.get("max_completion_tokens", body.get("max_tokens", default_max))
        if max_tokens is None:
            max_tokens = default_max
        if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
            return _error(400, "max_tokens must be a positive integer")
        if (problem := _too_long(prompt, max_tokens)) is not None:
            return _error(400, problem)
        model = body.get("model") or settings.model
        created = int(time.time())
        rid = ("chatcmpl-" if chat else "cmpl-") + secrets.token_hex(12)
        obj = "chat.completion" if chat else "text_completion"

        def choice(text: str, finish: str | None, *, delta: bool) -> dict[str, Any]:
            if chat:
                key = "delta" if delta else "message"
                content: dict[str, Any] = {"content": text}
                if not delta:
                    content["role"] = "assistant"
                return {"index": 0, key: content, "finish_reason": finish, "logprobs": None}
            return {"index": 0, "text": text, "finish_reason": finish, "logprobs": None}

        def usage(completion: int) -> dict[str, int]:
            return {
                "prompt_tokens": prompt,
                "completion_tokens": completion,
                "total_tokens": prompt + completion,
            }

        if body.get("stream"):
            include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
            chunk_obj = "chat.completion.chunk" if chat else "text_completion"

            async def stream() -> AsyncIterator[bytes]:
                sent = 0
                base = {"id": rid, "object": chunk_obj, "created": created, "model": model}
                if chat:
                    first = {
                        "index": 0,
                        "delta": {"role": "assistant", "content": ""},
                        "finish_reason": None,
                        "logprobs": None,
                    }
                    yield _sse({**base, "choices": [first]})
                async for n in pod.generate(prompt, max_tokens):
                    text = _words(n, sent)
                    sent += n
                    yield _sse({**base, "choices": [choice(text, None, delta=True)]})
                yield _sse({**base, "choices": [choice("", "length", delta=True)]})
                if include_usage:
                    yield _sse({**base, "choices": [], "usage": usage(sent)})
                yield b"data: [DONE]\n\n"

            return StreamingResponse(stream(), media_type="text/event-stream")
        total = await _count(pod.generate(prompt, max_tokens))
        return JSONResponse(
            {
                "id": rid,
                "object": obj,
                "created": created,
                "model": model,
                "choices": [choice(_words(total, 0), "length", delta=False)],
                "usage": usage(total),
            }
        )

    if settings.api_key:
        app.add_middleware(ApiKeyMiddleware, key=settings.api_key)
    return app


class ApiKeyMiddleware:
    """SGLang's rule (utils/auth.py): /health* and /metrics are open, everything else needs
    `Authorization: Bearer <key>`. Plain ASGI, so streamed answers are not re-buffered."""

    def __init__(self, app: ASGIApp, key: str) -> None:
        self.app, self.key = app, key

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and not scope["path"].startswith(OPEN_PATHS):
            given = dict(scope.get("headers") or []).get(b"authorization", b"").decode()
            scheme, _, token = given.partition(" ")
            if scheme.lower() != "bearer" or not secrets.compare_digest(token, self.key):
                await JSONResponse({"error": "Unauthorized"}, status_code=401)(scope, receive, send)
                return
        await self.app(scope, receive, send)


async def _count(tokens: AsyncIterator[int]) -> int:
    """Run a generation to the end; the number of tokens it produced."""
    return sum([n async for n in tokens])


MAX_BODY_BYTES = 4 * 1024 * 1024
"""The router's own request-body limit: a simulated pod takes no more than it."""


async def _json(request: Request) -> Any:
    """The body as JSON, or an error Response: 413 past MAX_BODY_BYTES (read no further),
    400 when it is not JSON (deep nesting and huge integers included)."""
    size, parts = 0, []
    async for chunk in request.stream():
        size += len(chunk)
        if size > MAX_BODY_BYTES:
            return _error(413, f"request body exceeds {MAX_BODY_BYTES} bytes")
        parts.append(chunk)
    try:
        return json.loads(b"".join(parts))
    except (ValueError, RecursionError):
        return _error(400, "request body is not valid JSON")


async def _json_object(request: Request) -> dict[str, Any] | Response:
    body = await _json(request)
    if isinstance(body, Response):
        return body
    if not isinstance(body, dict):
        return _error(400, "request body must be a JSON object")
    return body


def metrics_text(pod: SimPod) -> str:
    """The /metrics text without HTTP (for tests and the demo's own view)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(PodMetrics(pod))
    return generate_latest(registry).decode()
