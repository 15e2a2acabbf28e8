"""The router's errors, mapped to HTTP once, at the edge (OpenAI's error shape).

RouterError                 500 server_error
├── BadRequest              400 invalid_request_error   (malformed body, bad field/header)
│   └── PayloadTooLarge     413 invalid_request_error
├── ModelNotFound           404 invalid_request_error, code model_not_found
├── PodNotFound             404 invalid_request_error, code pod_not_found
├── Unauthorized            401 authentication_error + WWW-Authenticate (no or unknown key)
├── Forbidden               403 permission_error (a class the key may not send)
├── TooManyRequests         429 rate_limit_error + Retry-After (the key's limits)
├── NoCapacity              503 server_error + Retry-After (no pod can take the request)
├── UpstreamFailed          502 upstream_error (every attempt failed before the first byte)
├── UpstreamRejectedKey     502 upstream_error (engines refuse the router's API key)
└── AnswerTimeout           504 timeout (the answer ran past resilience.answerTimeoutSeconds)
"""

from __future__ import annotations

from typing import Any


class RouterError(Exception):
    status = 500
    error_type = "server_error"
    code: str | None = None

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.error_type,
                "param": self.param,
                "code": self.code or self.status,
            }
        }

    def headers(self) -> dict[str, str]:
        return {}


class BadRequest(RouterError):
    status = 400
    error_type = "invalid_request_error"


class PayloadTooLarge(BadRequest):
    status = 413


class ModelNotFound(RouterError):
    status = 404
    error_type = "invalid_request_error"
    code = "model_not_found"


class PodNotFound(RouterError):
    status = 404
    error_type = "invalid_request_error"
    code = "pod_not_found"


class Unauthorized(RouterError):
    status = 401
    error_type = "authentication_error"

    def headers(self) -> dict[str, str]:
        return {"WWW-Authenticate": 'Bearer realm="specgate"'}


class Forbidden(RouterError):
    status = 403
    error_type = "permission_error"


class TooManyRequests(RouterError):
    status = 429
    error_type = "rate_limit_error"

    def __init__(self, message: str, *, retry_after: int) -> None:
        super().__init__(message)
        self.retry_after = retry_after

    def headers(self) -> dict[str, str]:
        return {"Retry-After": str(self.retry_after)}


class NoCapacity(RouterError):
    status = 503

    def __init__(self, message: str, *, retry_after: int) -> None:
        super().__init__(message)
        self.retry_after = retry_after

    def headers(self) -> dict[str, str]:
        return {"Retry-After": str(self.retry_after)}


class UpstreamFailed(RouterError):
    status = 502
    error_type = "upstream_error"

    def __init__(self, message: str, *, retry_after: int = 1) -> None:
        super().__init__(message)
        self.retry_after = retry_after

    def headers(self) -> dict[str, str]:
        return {"Retry-After": str(self.retry_after)}


class UpstreamRejectedKey(UpstreamFailed):
    pass


class AnswerTimeout(RouterError):
    status = 504
    error_type = "timeout"
    code = "answer_timeout"
