"""Forwarding: pick a pod, send, retry failures that happen before the first byte on another
pod, then relay the answer unbuffered.

Failure handling, from the list of mistakes not to repeat:
- every engine call has connect and read timeouts (`resilience`);
- a connection error, a 5xx, or no first byte within `firstByteTimeoutSeconds` (the pod is
  then marked unhealthy and its circuit opened) is retried on a different pod,
  or on one already tried once every pod has been (a single pod's dropped keep-alive connection
  is worth a second try), at most `maxAttempts` times, with jittered exponential backoff, and
  counts against that pod's circuit breaker, which takes a failing pod out of the retries;
- after the first byte reached the client, a failure ends the stream with an SSE error event
  (and `data: [DONE]`), never a hang;
- an answer ends within `answerTimeoutSeconds` of the request's arrival: a stream past it ends
  with an error event, a non-streamed request gets 504. A non-streamed answer's first byte is
  its whole body, so it is waited for as long while its pod's scraped decode steps grow; a pod
  that shows no progress is frozen and the request is retried elsewhere;
- no pod available is a 503 with Retry-After; a request is never dropped without an answer.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import aiohttp
from starlette.responses import Response, StreamingResponse

from specgate.engine_http import RETRYABLE
from specgate_router import placement
from specgate_router.errors import AnswerTimeout, NoCapacity, UpstreamFailed, UpstreamRejectedKey
from specgate_router.pods import PodState
from specgate_router.requests import RoutedRequest
from specgate_router.state import RouterState

log = logging.getLogger("specgate.router.proxy")

_TOKENS = re.compile(rb'"completion_tokens"\s*:\s*(\d+)')
MAX_BUFFERED_ANSWER_BYTES = 8 * 1024 * 1024
"""A non-streamed answer is held whole up to this size (so an engine that breaks mid-body
can be retried on another pod); a larger one is passed through as it arrives, so a hostile
or enormous answer costs the router at most this much per request."""
TAIL_BYTES = 4096
"""What a passed-through answer keeps of its end, where the usage object is."""


class _AnswerTooLong(Exception):
    """The answer ran past its deadline (resilience.answerTimeoutSeconds)."""


class _Retry(Exception):
    """This attempt failed before anything reached the client."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason


@dataclass
class Timing:
    started: float
    first: float | None = None
    last: float | None = None
    tokens: int = 0


@dataclass
class SseTap:
    """Sees a stream event by event: notes the completion-token count, and drops the usage-only
    chunk the router asked for on the client's behalf."""

    drop_usage: bool
    tokens: int = 0
    done: bool = False
    """Whether the stream's `data: [DONE]` has gone by."""
    _buffer: bytes = field(default=b"", repr=False)

    def feed(self, chunk: bytes) -> bytes:
        self._buffer += chunk
        out = []
        while b"\n\n" in self._buffer:
            event, self._buffer = self._buffer.split(b"\n\n", 1)
            if self._keep(event):
                out.append(event + b"\n\n")
        return b"".join(out)

    def flush(self) -> bytes:
        rest, self._buffer = self._buffer, b""
        return rest

    def _keep(self, event: bytes) -> bool:
        if event.strip() == b"data: [DONE]":
            self.done = True
        if b"completion_tokens" in event:  # the usage chunk: most events carry none
            found = _TOKENS.findall(event)
            if found:
                self.tokens = max(self.tokens, int(found[-1]))
        usage_only = b'"usage"' in event and b'"choices":[]' in event.replace(b" ", b"")
        return not (self.drop_usage and usage_only)


def _headers(state: RouterState, request_id: str, req: RoutedRequest) -> dict[str, str]:
    headers = {"Content-Type": "application/json", "x-request-id": request_id, **dict(req.trace)}
    if state.settings.engine_api_key:
        headers["Authorization"] = f"Bearer {state.settings.engine_api_key}"
    return headers


async def _open(
    state: RouterState, pod: PodState, req: RoutedRequest, request_id: str
) -> tuple[aiohttp.ClientResponse, AsyncIterator[bytes], bytes]:
    """Send and wait for the first byte of the answer; anything failing so far is retryable."""
    try:
        resp = await state.engine_http.post(
            pod.url + req.path, req.body, _headers(state, request_id, req)
        )
    except RETRYABLE as exc:
        raise _Retry("connect", f"{type(exc).__name__}: {exc}") from exc
    if resp.status >= 500:
        try:
            detail = (await resp.read())[:300].decode(errors="replace")
        except RETRYABLE as exc:
            detail = f"(body cut: {type(exc).__name__})"
        finally:
            resp.release()
        raise _Retry("upstream_5xx", f"HTTP {resp.status}: {detail}")
    if resp.status in (401, 403):
        resp.release()
        log.error("engine pod %s refused the router's API key (HTTP %d)", pod.name, resp.status)
        raise UpstreamRejectedKey(
            "an engine pod refused the router's API key: its administrator should check the"
            " engine key Secret"
        )
    chunks = resp.content.iter_any()
    try:
        first = await chunks.__anext__()
    except StopAsyncIteration:
        first = b""
    except RETRYABLE as exc:
        resp.release()
        raise _Retry("first_byte", f"{type(exc).__name__}: {exc}") from exc
    return resp, chunks, first


async def _first_byte(
    state: RouterState, pod: PodState, req: RoutedRequest, request_id: str, deadline: float
) -> tuple[aiohttp.ClientResponse, AsyncIterator[bytes], bytes]:
    """`_open`, bounded. A stream's first byte comes within `firstByteTimeoutSeconds`, else the
    pod is frozen (TimeoutError). A non-streamed answer's first byte is its whole body: it is
    waited for until the deadline while the pod makes progress (its scrapes show decode steps
    in every `firstByteTimeoutSeconds`), and the pod is frozen once it shows none. A pod that
    reports no decode steps is held to the first-byte limit as for a stream. AnswerTimeout
    past the deadline."""
    loop = asyncio.get_running_loop()
    limit = state.settings.resilience.first_byte_timeout_seconds
    if req.stream:  # one bounded wait, no task: the common path stays as cheap as it was
        remaining = deadline - loop.time()
        try:
            async with asyncio.timeout(min(limit, remaining)):
                return await _open(state, pod, req, request_id)
        except TimeoutError:
            if limit > remaining:
                raise AnswerTimeout(_too_long(state)) from None
            raise
    # One timer re-armed while the pod makes progress, no task: a task and a wait per request
    # cost the router about 2% of its CPU at 200 req/s.
    steps = _decode_steps(pod)
    frozen = False
    timer: asyncio.TimerHandle | None = None

    def arm(bound: asyncio.Timeout, now: float) -> None:
        nonlocal timer
        when = min(now + limit, deadline)
        timer = loop.call_at(when, check, bound, when)

    def check(bound: asyncio.Timeout, when: float) -> None:
        nonlocal steps, frozen
        if when < deadline:  # a limit's wait, not the deadline's, ended
            before, steps = steps, _decode_steps(pod)
            if steps > before and pod.scrape_age(state.clock()) <= limit:
                arm(bound, loop.time())
                return
            frozen = True
        bound.reschedule(loop.time())

    try:
        async with asyncio.timeout(None) as bound:
            arm(bound, loop.time())
            return await _open(state, pod, req, request_id)
    except TimeoutError:
        if bound.expired() and not frozen:
            raise AnswerTimeout(_too_long(state)) from None
        raise  # the pod showed no decode steps for the limit (or its connection timed out)
    finally:
        if timer is not None:
            timer.cancel()


def _decode_steps(pod: PodState) -> float:
    """The pod's decode steps since it started, as last scraped (0 when unknown)."""
    return pod.last.load.decode_steps if pod.last is not None else 0.0


def _too_long(state: RouterState) -> str:
    limit = state.settings.resilience.answer_timeout_seconds
    return f"the answer took longer than the router's limit of {limit:g}s; ask for fewer tokens"


async def _until(
    chunks: AsyncIterator[bytes], deadline: float, read_timeout: float
) -> AsyncIterator[bytes]:
    """`chunks` as they come, until the loop-time `deadline` (then _AnswerTooLong). A read
    timeout of the engine's connection (also a TimeoutError) passes through as itself. A
    chunk awaited with more than `read_timeout` (the connection's own bound on a read) left
    before the deadline needs no timer: the read ends, or times out, first. A timer per chunk
    would cost a stream of 200 chunks about a millisecond of the router's CPU."""
    loop = asyncio.get_running_loop()
    while True:
        if deadline - loop.time() > read_timeout:
            try:
                chunk = await anext(chunks)
            except StopAsyncIteration:
                return
            yield chunk
            continue
        bound = asyncio.timeout_at(deadline)
        try:
            async with bound:
                chunk = await anext(chunks)
        except StopAsyncIteration:
            return
        except TimeoutError:
            if bound.expired():
                raise _AnswerTooLong from None
            raise
        yield chunk


async def forward(state: RouterState, req: RoutedRequest, request_id: str) -> Response:
    settings = state.settings  # this request keeps the settings it started with
    res = settings.resilience
    tried: set[str] = set()
    last_error = "no attempt made"
    timing = Timing(started=time.monotonic())
    deadline = asyncio.get_running_loop().time() + res.answer_timeout_seconds
    for attempt in range(res.max_attempts):
        now = state.clock()
        ctx = placement.Context(req.traffic_class, now, settings, frozenset(tried))
        choice = placement.choose(state.live_pods(), ctx, rng=state.rng)
        if isinstance(choice, placement.Saturated) and tried:
            ctx = placement.Context(req.traffic_class, now, settings, frozenset())
            choice = placement.choose(state.live_pods(), ctx, rng=state.rng)
        if isinstance(choice, placement.Saturated):
            if attempt == 0:
                state.metrics.saturated.labels(req.traffic_class).inc()
                state.metrics.requests.labels(req.traffic_class, "", "503").inc()
                why = ", ".join(f"{n} {k}" for k, n in sorted(choice.reasons.items())) or "no pods"
                raise NoCapacity(
                    f"no engine pod can take the request now ({why})",
                    retry_after=res.retry_after_seconds,
                )
            break
        pod = choice
        tried.add(pod.name)
        pod.breaker.on_dispatch(now, res)
        pod.in_flight += 1
        pod.throughput_in_flight += req.traffic_class == "throughput"
        pod.dispatched_since_scrape += 1
        state.in_flight += 1
        state.in_flight_by_class[req.traffic_class] += 1
        state.metrics.in_flight.inc()
        released = False

        def release(pod: PodState = pod) -> None:
            nonlocal released
            if not released:
                released = True
                pod.in_flight -= 1
                pod.throughput_in_flight -= req.traffic_class == "throughput"
                state.in_flight -= 1
                state.in_flight_by_class[req.traffic_class] -= 1
                state.metrics.in_flight.dec()

        try:
            resp, chunks, first = await _first_byte(state, pod, req, request_id, deadline)
        except (_Retry, TimeoutError) as failure:
            release()
            if isinstance(failure, TimeoutError):
                # Silent past the limit: a frozen or wedged engine. Out of rotation until a
                # scrape answers again and its circuit half-opens.
                exc = _Retry(
                    "first_byte_timeout",
                    f"no first byte within {res.first_byte_timeout_seconds:g}s",
                )
                pod.healthy = False
                pod.breaker.trip(state.clock(), res)
            else:
                exc = failure
                pod.breaker.on_failure(state.clock(), res)
            last_error = f"{pod.name}: {exc}"
            log.warning(
                "attempt %d on %s failed: %s",
                attempt + 1,
                pod.name,
                exc,
                extra={"request_id": request_id},
            )
            if attempt + 1 < res.max_attempts:
                state.metrics.retries.labels(exc.reason).inc()
                backoff = min(res.backoff_max_seconds, res.backoff_base_seconds * 2**attempt)
                await asyncio.sleep(backoff * (0.5 + state.rng.random()))
            continue
        except AnswerTimeout:
            release()
            state.metrics.requests.labels(req.traffic_class, pod.name, "504").inc()
            raise
        except BaseException:
            release()
            raise
        timing.first = time.monotonic()
        chunks = _until(chunks, deadline, res.read_timeout_seconds)
        if req.stream and resp.status == 200:
            return StreamingResponse(
                _relay(state, pod, req, resp, chunks, first, timing, release),
                status_code=resp.status,
                media_type=resp.headers.get("content-type", "text/event-stream"),
                headers={"x-request-id": request_id, "x-specgate-pod": pod.public_id},
            )
        headers = {"x-request-id": request_id, "x-specgate-pod": pod.public_id}
        media_type = resp.headers.get("content-type", "application/json")
        parts, size, whole = [first], len(first), True
        try:
            async for chunk in chunks:
                parts.append(chunk)
                size += len(chunk)
                if size > MAX_BUFFERED_ANSWER_BYTES:
                    whole = False
                    break
        except _AnswerTooLong:
            resp.release()
            release()
            state.metrics.requests.labels(req.traffic_class, pod.name, "504").inc()
            raise AnswerTimeout(_too_long(state)) from None
        except RETRYABLE as exc:
            resp.release()
            release()
            pod.breaker.on_failure(state.clock(), res)
            last_error = f"{pod.name}: body cut: {exc}"
            if attempt + 1 < res.max_attempts:
                state.metrics.retries.labels("body").inc()
            continue
        except BaseException:
            resp.release()
            release()
            raise
        if not whole:
            # Too large to hold: what is read goes out, the rest follows as it comes (no
            # retry past this point, as for a stream).
            return StreamingResponse(
                _pass_through(state, pod, req, resp, chunks, parts, timing, release),
                status_code=resp.status,
                media_type=media_type,
                headers=headers,
            )
        resp.release()
        release()
        body = b"".join(parts)
        pod.breaker.on_success()
        _account(state, req, pod, resp.status, timing, _tokens_of(body), streamed=False)
        if 400 <= resp.status < 500:
            body, media_type = openai_error(body, resp.status), "application/json"
        return Response(body, status_code=resp.status, media_type=media_type, headers=headers)
    state.metrics.requests.labels(req.traffic_class, "", "502").inc()
    # Which pods failed and how goes to the log, not to clients: pod addresses are internal.
    log.warning(
        "request failed on %d pods; last: %s",
        len(tried),
        last_error,
        extra={"request_id": request_id},
    )
    raise UpstreamFailed(
        f"the engine pods failed {len(tried)} attempts before answering; retry shortly",
        retry_after=res.retry_after_seconds,
    )


async def _relay(
    state: RouterState,
    pod: PodState,
    req: RoutedRequest,
    resp: aiohttp.ClientResponse,
    chunks: AsyncIterator[bytes],
    first: bytes,
    timing: Timing,
    release: object,
) -> AsyncIterator[bytes]:
    tap = SseTap(drop_usage=not req.client_wants_usage)
    status = "200"
    state.streams.add(resp)
    try:
        out = tap.feed(first)
        if out:
            yield out
        async for chunk in chunks:
            timing.last = time.monotonic()
            out = tap.feed(chunk)
            if out:
                yield out
        if state.ending_streams is not None and not tap.done:
            raise aiohttp.ClientConnectionError("ended by the router")
        rest = tap.flush()
        if rest:
            yield rest
        pod.breaker.on_success()
    except _AnswerTooLong:
        status = "answer_timeout"
        error = {"error": {"message": _too_long(state), "type": "timeout", "code": 504}}
        yield b"data: " + json.dumps(error).encode() + b"\n\n"
        yield b"data: [DONE]\n\n"
    except RETRYABLE as exc:
        if state.ending_streams is not None:  # the router's own doing, not the pod's
            status = "router_stopping"
            error = {"error": {"message": state.ending_streams, "type": "server_error",
                               "code": 503}}  # fmt: skip
            yield b"data: " + json.dumps(error).encode() + b"\n\n"
            yield b"data: [DONE]\n\n"
            return
        status = "stream_error"
        pod.breaker.on_failure(state.clock(), state.settings.resilience)
        state.metrics.stream_errors.labels(pod.name).inc()
        log.warning("stream from %s broke after the first byte: %s", pod.name, exc)
        message = f"an engine pod failed mid-stream ({type(exc).__name__}): retry the request"
        error = {"error": {"message": message, "type": "upstream_error", "code": 502}}
        yield b"data: " + json.dumps(error).encode() + b"\n\n"
        yield b"data: [DONE]\n\n"
    finally:
        state.streams.discard(resp)
        resp.release()  # back to the pool when the body was read to its end, else closed
        release()  # type: ignore[operator]
        _account(state, req, pod, status, timing, tap.tokens, streamed=True)


async def _pass_through(
    state: RouterState,
    pod: PodState,
    req: RoutedRequest,
    resp: aiohttp.ClientResponse,
    chunks: AsyncIterator[bytes],
    head: list[bytes],
    timing: Timing,
    release: object,
) -> AsyncIterator[bytes]:
    """A non-streamed answer too large to hold, relayed as it arrives; its token count is read
    from its tail, where the usage object is."""
    status: int | str = resp.status
    tail = b""
    try:
        for part in head:
            tail = (tail + part)[-TAIL_BYTES:]
            yield part
        async for chunk in chunks:
            tail = (tail + chunk)[-TAIL_BYTES:]
            yield chunk
        pod.breaker.on_success()
    except _AnswerTooLong:
        status = "answer_timeout"  # the client sees a cut body, as for any cut connection
    except RETRYABLE as exc:
        status = "body_cut"
        pod.breaker.on_failure(state.clock(), state.settings.resilience)
        log.warning("large answer from %s broke mid-body: %s", pod.name, exc)
    finally:
        resp.release()
        release()  # type: ignore[operator]
        _account(state, req, pod, status, timing, _tokens_of(tail), streamed=False)


def openai_error(body: bytes, status: int) -> bytes:
    """An engine's error answer in OpenAI's shape ({"error": {message, type, param, code}}),
    the one every error from the router has: SGLang answers {"object": "error", "message":
    ...} and some paths plain text."""
    try:
        data = json.loads(body)
    except (ValueError, RecursionError):
        data = None
    if isinstance(data, dict) and isinstance(data.get("error"), dict):
        return body  # already OpenAI's
    message = (
        data.get("message") or data.get("detail")
        if isinstance(data, dict)
        else body.decode(errors="replace").strip()
    )
    error = {
        "message": str(message or f"the engine answered HTTP {status}")[:2000],
        "type": "invalid_request_error",
        "param": data.get("param") if isinstance(data, dict) else None,
        "code": status,
    }
    return json.dumps({"error": error}).encode()


def _tokens_of(body: bytes) -> int:
    found = _TOKENS.findall(body)
    return int(found[-1]) if found else 0


def _account(
    state: RouterState,
    req: RoutedRequest,
    pod: PodState,
    status: int | str,
    timing: Timing,
    tokens: int,
    *,
    streamed: bool,
) -> None:
    m, cls = state.metrics, req.traffic_class
    m.requests.labels(cls, pod.name, str(status)).inc()
    if tokens:
        m.output_tokens.labels(cls).inc(tokens)
    if streamed and timing.first is not None:
        m.ttft.labels(cls).observe(timing.first - timing.started)
        if timing.last is not None and tokens > 1:
            m.tpot.labels(cls).observe((timing.last - timing.first) / (tokens - 1))
