"""A client for one engine pod (patched SGLang or the simulator), over the control contract.

The router's scraper and pusher use it, and so do the simulator's tests, so the simulator is
checked with the very code that will talk to real pods. All I/O goes through an injected
`EngineHttp` (tests put in one that fails on purpose, or use real sockets).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterable
from typing import Any

from prometheus_client.parser import text_string_to_metric_families
from pydantic import BaseModel, ConfigDict, Field

from specgate import contract
from specgate.engine_http import RETRYABLE, UNREACHABLE, EngineHttp


class EngineError(Exception):
    """The engine answered with an error (status), did not answer in time (status 0), or could
    not be reached at all (status 0, `unreachable`: connection refused, no route)."""

    def __init__(self, url: str, status: int, message: str, *, unreachable: bool = False) -> None:
        self.url, self.status, self.message = url, status, message
        self.unreachable = unreachable
        super().__init__(
            f"{url}: {status or ('unreachable' if unreachable else 'no answer')}: {message}"
        )


class EngineLoad(BaseModel):
    """One `/v1/loads?include=core,spec` snapshot (dp rank 0)."""

    model_config = ConfigDict(frozen=True)

    running: int
    waiting: int
    max_running: int
    token_usage: float = 0.0
    gen_throughput: float = 0.0
    accept_length: float | None = None
    decode_steps: float = 0.0
    """Decode steps since start, and the sums of their batch sizes and generated tokens (from
    `decode_moments`; 0 until the first decode step)."""
    decode_batch_sum: float = 0.0
    decode_tokens: float = 0.0
    decode_step_us: float = 0.0
    """The sum of the decode steps' launch intervals, prefills between them included."""
    # Present only on patched engines:
    threshold: int | None = None
    threshold_known: bool = False
    speculating: bool | None = None
    decode_steps_on: int | None = None
    decode_steps_off: int | None = None
    accelerator: str | None = None
    """The pod's accelerator as SGLang names it ("NVIDIA H200") and how many one engine
    uses: pods that report the same pair share their learning samples."""
    num_accelerators: int | None = None
    speculative: dict[str, Any] = Field(default_factory=dict, repr=False)
    """The whole `speculative` section, for what the router's prediction reads from it
    (contract.STEP_PROFILE, contract.ACCEPTANCE_COUNTERS, contract.STEP_TIME_COUNTERS),
    checked there."""

    @classmethod
    def from_response(cls, data: dict[str, Any]) -> EngineLoad:
        """Parse and check: every number finite and in range, or ValueError naming the field.
        An engine's numbers move thresholds; a broken or hostile one must not."""
        loads = data.get("loads") if isinstance(data, dict) else None
        if not isinstance(loads, list) or not loads or not isinstance(loads[0], dict):
            raise ValueError("no loads in /v1/loads response")
        load = loads[0]
        _check_numbers(load)
        spec = load.get("speculative") or {}
        moments = dict(zip(contract.DECODE_MOMENTS, load.get("decode_moments") or (), strict=False))
        return cls(
            running=int(load.get("num_running_reqs", 0)),
            waiting=int(load.get("num_waiting_reqs", 0)),
            max_running=int(load.get("max_running_requests", 0)),
            token_usage=float(load.get("token_usage", 0.0)),
            gen_throughput=float(load.get("gen_throughput", 0.0)),
            accept_length=spec.get("accept_length"),
            decode_steps=float(moments.get("steps", 0.0)),
            decode_batch_sum=float(moments.get("batch", 0.0)),
            decode_tokens=float(moments.get("generated", 0.0)),
            decode_step_us=float(moments.get("step_us", 0.0)),
            threshold=spec.get("disable_batch_threshold"),
            threshold_known="disable_batch_threshold" in spec,
            speculating=spec.get("speculating"),
            decode_steps_on=spec.get("decode_steps_on"),
            decode_steps_off=spec.get("decode_steps_off"),
            speculative=spec if isinstance(spec, dict) else {},
            **_hardware(data),
        )


def _hardware(data: dict[str, Any]) -> dict[str, Any]:
    """accelerator and num_accelerators when well-formed; a malformed one is unknown."""
    name, count = data.get("accelerator"), data.get("num_accelerators")
    return {
        "accelerator": name if isinstance(name, str) and 0 < len(name) <= 200 else None,
        "num_accelerators": count
        if isinstance(count, int) and not isinstance(count, bool) and 1 <= count <= 4096
        else None,
    }


_COUNTS = ("num_running_reqs", "num_waiting_reqs", "max_running_requests")
_LIMIT = float(1 << 40)


def _check_numbers(load: dict[str, Any]) -> None:
    for name in _COUNTS:
        value = load.get(name, 0)
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= 1 << 24:
            raise ValueError(f"{name}: a whole number in [0, 2^24], got {value!r}")
    for name in ("token_usage", "gen_throughput"):
        _finite(load.get(name, 0.0), name)
    moments = load.get("decode_moments")
    if moments is not None:
        if not isinstance(moments, list) or len(moments) > 16:
            raise ValueError("decode_moments: a short list of numbers")
        for i, value in enumerate(moments):
            _finite(value, f"decode_moments[{i}]")
    spec = load.get("speculative")
    if spec is None:
        return
    if not isinstance(spec, dict):
        raise ValueError("speculative: an object")
    threshold = spec.get("disable_batch_threshold")
    if threshold is not None:
        contract.parse_threshold(threshold)  # ThresholdError is a ValueError
    for name in ("decode_steps_on", "decode_steps_off"):
        if spec.get(name) is not None:
            _finite(spec[name], f"speculative.{name}")
    if spec.get("accept_length") is not None:
        _finite(spec["accept_length"], "speculative.accept_length", high=257.0)


def _finite(value: Any, name: str, high: float = _LIMIT) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"{name}: a number, got {value!r}")
    if not 0 <= value <= high:  # NaN fails both comparisons
        raise ValueError(f"{name}: a finite number in [0, {high:g}], got {value!r}")


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text -> {sample name[{mode}]: value}, summed over other labels."""
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            key = sample.name
            if "mode" in sample.labels:
                key = f"{key}{{mode={sample.labels['mode']}}}"
            out[key] = out.get(key, 0.0) + float(sample.value)
    return out


def counter_total(text: str, name: str) -> float:
    """Sum of one metric's samples, by scanning lines: the full parser costs milliseconds on a
    large exposition, time the router's event loop would spend not proxying."""
    total, prefix = 0.0, name
    for line in text.splitlines():
        if line.startswith(prefix) and len(line) > len(prefix) and line[len(prefix)] in "{ ":
            value = line.rsplit("}", 1)[-1].split()[0] if "{" in line else line.split()[1]
            total += float(value)
    return total


MAX_REPLY_BYTES = 4 * 1024 * 1024
"""The most the router reads of an engine's control-plane answer (/v1/loads, /server_info,
/metrics): a few KiB normally; a hostile or broken engine's 100 MB would cost the router
that much memory every scrape."""


MAX_JSON_REPLY_BYTES = 256 * 1024
"""The most the router reads of an engine's JSON answer (/v1/loads, /server_info, a push's
answer): the contract's largest, a 64-point step profile per mode on every data-parallel
rank, is a few tens of KiB; parsing more on every scrape would cost the event loop."""


class ReplyTooLarge(Exception):
    pass


async def read_capped(chunks: AsyncIterable[bytes], limit: int) -> bytes:
    """A body read chunk by chunk, ReplyTooLarge as soon as it passes `limit` bytes (never
    held whole past it)."""
    parts, size = [], 0
    async for chunk in chunks:
        size += len(chunk)
        if size > limit:
            raise ReplyTooLarge(f"answer over {limit} bytes")
        parts.append(chunk)
    return b"".join(parts)


async def _read_capped(resp: Any, limit: int) -> bytes:
    length = resp.headers.get("Content-Length")
    if length is not None and length.isdigit() and int(length) > limit:
        raise ReplyTooLarge(f"answer of {int(length)} bytes, over {limit}")
    return await read_capped(resp.content.iter_chunked(64 * 1024), limit)


class EngineReply:
    """An engine's answer, read whole: status and body."""

    def __init__(self, status: int, body: bytes) -> None:
        self.status, self.body = status, body

    @property
    def text(self) -> str:
        return self.body.decode(errors="replace")

    def json(self) -> Any:
        """The body as JSON; ValueError for anything else, a nesting too deep included."""
        try:
            return json.loads(self.body)
        except RecursionError:
            raise ValueError("JSON nested too deep") from None


class EngineClient:
    def __init__(self, base_url: str, http: EngineHttp, *, api_key: str | None = None) -> None:
        self.base_url = base_url.rstrip("/")
        self._http = http
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}

    async def _call(
        self,
        method: str,
        path: str,
        timeout: float | None,
        body: bytes | None = None,
        max_bytes: int = MAX_REPLY_BYTES,
    ) -> EngineReply:
        headers = self._headers
        if body is not None:
            headers = {**headers, "Content-Type": "application/json"}
        try:
            resp = await self._http.request(
                method, self.base_url + path, body=body, headers=headers, timeout=timeout
            )
            try:
                reply = EngineReply(resp.status, await _read_capped(resp, max_bytes))
            finally:
                resp.release()
        except UNREACHABLE as exc:
            raise EngineError(
                self.base_url, 0, str(exc) or "connect failed", unreachable=True
            ) from exc
        except RETRYABLE as exc:
            raise EngineError(self.base_url, 0, str(exc) or type(exc).__name__) from exc
        except ReplyTooLarge as exc:
            raise EngineError(self.base_url, 200, f"bad {path.split('?')[0]}: {exc}") from exc
        if reply.status >= 400:
            raise EngineError(self.base_url, reply.status, reply.text[:500])
        return reply

    async def _get(
        self, path: str, timeout: float | None = None, max_bytes: int = MAX_REPLY_BYTES
    ) -> EngineReply:
        return await self._call("GET", path, timeout, max_bytes=max_bytes)

    async def loads(self, timeout: float | None = None) -> EngineLoad:
        resp = await self._get("/v1/loads?include=core,spec", timeout, MAX_JSON_REPLY_BYTES)
        try:
            return EngineLoad.from_response(resp.json())
        except (ValueError, TypeError) as exc:
            raise EngineError(self.base_url, resp.status, f"bad /v1/loads: {exc}") from exc

    async def metrics(self, timeout: float | None = None) -> dict[str, float]:
        resp = await self._get("/metrics", timeout)
        try:
            return parse_metrics(resp.text)
        except ValueError as exc:
            raise EngineError(self.base_url, resp.status, f"bad /metrics: {exc}") from exc

    async def counter(self, name: str, timeout: float | None = None) -> float:
        """One counter from /metrics, summed over its labels."""
        resp = await self._get("/metrics", timeout)
        try:
            return counter_total(resp.text, name)
        except (ValueError, IndexError) as exc:
            raise EngineError(self.base_url, resp.status, f"bad /metrics: {exc}") from exc

    async def server_info(self, timeout: float | None = None) -> dict[str, Any]:
        resp = await self._get("/server_info", timeout, MAX_JSON_REPLY_BYTES)
        try:
            data = resp.json()
        except ValueError as exc:
            raise EngineError(self.base_url, resp.status, f"bad /server_info: {exc}") from exc
        if not isinstance(data, dict):
            raise EngineError(self.base_url, resp.status, "bad /server_info: not an object")
        return data

    async def threshold(self) -> int | None:
        info = await self.server_info()
        if contract.THRESHOLD_KEY not in info:
            raise EngineError(self.base_url, 200, "engine does not report a threshold: unpatched?")
        value: int | None = info[contract.THRESHOLD_KEY]
        return value

    async def set_threshold(self, threshold: int | None, timeout: float | None = None) -> None:
        request = json.dumps(contract.set_request(threshold)).encode()
        resp = await self._call(
            "POST", "/set_internal_state", timeout, body=request, max_bytes=MAX_JSON_REPLY_BYTES
        )
        try:
            body = resp.json()
        except ValueError as exc:
            raise EngineError(self.base_url, resp.status, f"bad answer: {exc}") from exc
        if not (isinstance(body, list) and body and all(body)):
            raise EngineError(self.base_url, resp.status, f"engine refused: {body!r:.200}")

    async def healthy(self, timeout: float = 2.0) -> bool:
        try:
            await self._get("/health", timeout)
        except EngineError:
            return False
        return True
