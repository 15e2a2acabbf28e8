"""Parsing and classifying requests: pure functions on bytes and headers, no I/O.

The router validates only what routing needs (the model, `stream`, the output-token bound and
that the body is a JSON object with the fields the endpoint requires); everything else passes
to the engine untouched, which answers for its own fields.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from specgate import contract
from specgate_router import client_auth
from specgate_router.errors import BadRequest, ModelNotFound
from specgate_router.identity import Client
from specgate_router.settings import CLASSES, RouterSettings, TrafficClass

CLASS_HEADER = "x-specgate-class"
Kind = Literal["chat", "completion", "generate"]
PATHS: dict[str, Kind] = {
    "/v1/chat/completions": "chat",
    "/v1/completions": "completion",
    "/generate": "generate",
}


@dataclass(frozen=True)
class RoutedRequest:
    kind: Kind
    path: str
    body: bytes  # what goes upstream (may differ from what came in, see `parse`)
    stream: bool
    max_tokens: int | None
    traffic_class: TrafficClass
    client_wants_usage: bool
    trace: tuple[tuple[str, str], ...] = ()
    """The client's W3C trace context (traceparent, tracestate), passed on to the engine."""


def _positive_int(value: Any, field: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise BadRequest(f"{field} must be a positive integer, got {value!r}", param=field)
    return value


def classify(
    headers: Mapping[str, str],
    max_tokens: int | None,
    settings: RouterSettings,
    client: Client | None = None,
) -> TrafficClass:
    """Header first, then the configured rules (client API key, output length), then default;
    with an authenticated `client`, only within the classes its key may send."""
    given = headers.get(CLASS_HEADER)
    wanted: TrafficClass | None = None
    if given is not None:
        value = given.strip().lower()
        if value not in CLASSES:
            raise BadRequest(
                f"header {CLASS_HEADER} must be one of {', '.join(CLASSES)}, got {given!r}",
                param=CLASS_HEADER,
            )
        wanted = "latency" if value == "latency" else "throughput"
    if client is not None:
        return client_auth.allowed_class(client, wanted, _by_rules(headers, max_tokens, settings))
    if wanted is not None:
        return wanted
    return _by_rules(headers, max_tokens, settings)


def _by_rules(
    headers: Mapping[str, str], max_tokens: int | None, settings: RouterSettings
) -> TrafficClass:
    rules = settings.class_rules
    auth = headers.get("authorization", "")
    scheme, _, token = auth.partition(" ")
    if scheme.lower() == "bearer" and token in rules.api_keys:
        return rules.api_keys[token]
    bound = rules.throughput_above_max_tokens
    if bound is not None and max_tokens is not None and max_tokens > bound:
        return "throughput"
    return settings.default_class


ENGINE_ONLY_FIELDS = contract.ENGINE_ONLY_FIELDS

MAX_JSON_DEPTH = 64
"""Deeper bodies are refused before parsing: the parser recurses once a level."""


def _nesting(raw: bytes) -> int:
    """The deepest bracket nesting in `raw`, brackets inside strings not counted (a linear
    pass in Python: only bodies with many brackets take it)."""
    depth = deepest = 0
    in_string = escaped = False
    for byte in raw:
        if in_string:
            if escaped:
                escaped = False
            elif byte == 0x5C:  # backslash
                escaped = True
            elif byte == 0x22:  # quote
                in_string = False
        elif byte == 0x22:
            in_string = True
        elif byte in (0x5B, 0x7B):  # [ {
            depth += 1
            deepest = max(deepest, depth)
            if deepest > MAX_JSON_DEPTH:
                return deepest
        elif byte in (0x5D, 0x7D):
            depth -= 1
    return deepest


MAX_INT_DIGITS = 40
"""Longest integer a request body may hold (Python refuses to convert more than 4,300 digits,
and nothing an engine takes needs more than 20)."""


class _HugeInt(str):
    """An integer too long to convert, kept as its text so the error can name its field."""


def _int(text: str, huge: list[_HugeInt]) -> int | _HugeInt:
    if len(text.lstrip("-")) <= MAX_INT_DIGITS:
        return int(text)
    marker = _HugeInt(text)
    huge.append(marker)
    return marker


def _path_of(value: Any, target: object, prefix: str = "") -> str | None:
    """The dotted path of `target` in `value` (only walked for a body that holds one)."""
    if value is target:
        return prefix
    items = (
        value.items()
        if isinstance(value, dict)
        else enumerate(value)
        if isinstance(value, list)
        else ()
    )
    for key, child in items:
        where = (
            f"{prefix}[{key}]"
            if isinstance(key, int)
            else (f"{prefix}.{key}" if prefix else str(key))
        )
        found = _path_of(child, target, where)
        if found is not None:
            return found
    return None


def parse(
    path: str,
    raw: bytes,
    headers: Mapping[str, str],
    settings: RouterSettings,
    client: Client | None = None,
) -> RoutedRequest:
    kind = PATHS[path]
    # Counting brackets is C-fast; only a body with many walks them.
    brackets = raw.count(b"[") + raw.count(b"{")
    if brackets > MAX_JSON_DEPTH and _nesting(raw) > MAX_JSON_DEPTH:
        raise BadRequest(f"request body is nested deeper than {MAX_JSON_DEPTH} levels")
    huge: list[_HugeInt] = []
    try:
        body = json.loads(raw, parse_int=lambda text: _int(text, huge))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise BadRequest(f"request body is not valid JSON: {exc}") from exc
    except RecursionError as exc:
        raise BadRequest("request body is nested too deeply") from exc
    if huge:
        where = _path_of(body, huge[0]) or "the body"
        raise BadRequest(
            f"{where}: an integer of {len(huge[0])} digits; at most {MAX_INT_DIGITS}",
            param=where if where != "the body" else None,
        )
    if not isinstance(body, dict):
        raise BadRequest("request body must be a JSON object")
    params_in = body.get("sampling_params") if kind == "generate" else None
    engine_only = (ENGINE_ONLY_FIELDS - settings.allowed_engine_fields) & (
        body.keys() | (params_in.keys() if isinstance(params_in, dict) else set())
    )
    if engine_only:
        field = min(engine_only)
        raise BadRequest(
            f"{field} is an engine-internal field the router does not accept; remove it",
            param=field,
        )
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise BadRequest(f"stream must be true or false, got {stream!r}", param="stream")
    max_tokens: int | None = None
    rewritten = False
    if kind == "generate":
        if "text" not in body and "input_ids" not in body:
            raise BadRequest("either text or input_ids is required", param="text")
        params = body.get("sampling_params", {})
        if not isinstance(params, dict):
            raise BadRequest("sampling_params must be an object", param="sampling_params")
        if "max_new_tokens" in params:
            max_tokens = _positive_int(params["max_new_tokens"], "sampling_params.max_new_tokens")
    else:
        model = body.get("model")
        if model is not None and not isinstance(model, str):
            raise BadRequest(f"model must be a string, got {model!r}", param="model")
        if model and model != settings.model:
            raise ModelNotFound(
                f"The model {model!r} does not exist; this router serves {settings.model!r}",
                param="model",
            )
        if kind == "chat":
            messages = body.get("messages")
            if not isinstance(messages, list) or not messages:
                raise BadRequest("messages must be a non-empty list", param="messages")
        elif "prompt" not in body:
            raise BadRequest("prompt is required", param="prompt")
        for field in ("max_completion_tokens", "max_tokens"):
            if body.get(field) is not None:
                max_tokens = _positive_int(body[field], field)
                break
    wants_usage = True
    if stream and kind != "generate":
        options = body.get("stream_options") or {}
        if not isinstance(options, dict):
            raise BadRequest("stream_options must be an object", param="stream_options")
        wants_usage = bool(options.get("include_usage"))
        if not wants_usage:
            # Ask the engine for the usage chunk so TPOT counts tokens, not chunks (a
            # speculating step sends several tokens in one chunk); the router drops that chunk
            # again before it reaches a client that did not ask for it.
            body["stream_options"] = {**options, "include_usage": True}
            rewritten = True
    traffic_class = classify(headers, max_tokens, settings, client)
    upstream = json.dumps(body).encode() if rewritten else raw
    return RoutedRequest(
        kind, path, upstream, stream, max_tokens, traffic_class, wants_usage, trace_context(headers)
    )


TRACEPARENT = re.compile(r"^[0-9a-f]{2}-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2}$")
MAX_TRACESTATE = 512


def trace_context(headers: Mapping[str, str]) -> tuple[tuple[str, str], ...]:
    """traceparent (and tracestate with it) when well-formed per W3C Trace Context; anything
    else is dropped, not passed to the engine (and not an error: tracing is best effort)."""
    parent = (headers.get("traceparent") or "").strip().lower()
    if not TRACEPARENT.match(parent) or parent.startswith("ff-"):
        return ()
    _, trace_id, span_id, _ = parent.split("-")
    if trace_id == "0" * 32 or span_id == "0" * 16:
        return ()
    out = [("traceparent", parent)]
    state = (headers.get("tracestate") or "").strip()
    if state and len(state) <= MAX_TRACESTATE and state.isprintable() and state.isascii():
        out.append(("tracestate", state))
    return tuple(out)


# ---- documented request shapes (for the OpenAPI schema; validation is `parse`'s) ----


class _Open(BaseModel):
    model_config = ConfigDict(extra="allow")


class ChatCompletionRequest(_Open):
    model: str | None = None
    messages: list[dict[str, Any]] = Field(min_length=1)
    stream: bool = False
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)


class CompletionRequest(_Open):
    model: str | None = None
    prompt: str | list[int] | list[str]
    stream: bool = False
    max_tokens: int | None = Field(default=None, ge=1)


class GenerateRequest(_Open):
    text: str | None = None
    input_ids: list[int] | None = None
    sampling_params: dict[str, Any] = Field(default_factory=dict)
    stream: bool = False
