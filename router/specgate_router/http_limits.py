"""Bounds on a request's head (request line and headers) at the HTTP parser.

uvicorn's httptools protocol has no limit: httptools buffers a header until it is complete, so
one 100 MiB header holds 100 MiB, and a few at once exhaust the router's memory. This
protocol feeds the parser at most `max_head_bytes` before the head completes and counts the
headers; past either bound the client gets 431 and the connection closes, before anything
reaches the application. A body is not counted here (the application bounds it:
resilience.maxBodyBytes).
"""

from __future__ import annotations

from typing import Any

import httptools
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

DEFAULT_MAX_HEAD_BYTES = 64 * 1024
DEFAULT_MAX_HEADERS = 100


class _HeadTooLarge(Exception):
    """Raised from a parser callback to stop parsing a head past its bounds."""


class BoundedHttpToolsProtocol(HttpToolsProtocol):
    """HttpToolsProtocol with the bounds above; `with_limits` makes one with other bounds."""

    max_head_bytes = DEFAULT_MAX_HEAD_BYTES
    max_headers = DEFAULT_MAX_HEADERS

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._in_head = True
        self._head_bytes = 0
        self._header_count = 0

    @classmethod
    def with_limits(cls, max_head_bytes: int, max_headers: int) -> type[BoundedHttpToolsProtocol]:
        return type(
            "BoundedHttpToolsProtocol",
            (cls,),
            {"max_head_bytes": max_head_bytes, "max_headers": max_headers},
        )

    def data_received(self, data: bytes) -> None:
        self._unset_keepalive_if_required()
        view = memoryview(data)
        try:
            while view:
                if self._in_head:
                    room = self.max_head_bytes - self._head_bytes
                    if room <= 0:
                        raise _HeadTooLarge
                    part, view = view[:room], view[room:]
                    self._head_bytes += len(part)
                else:
                    part, view = view, view[len(view) :]
                self.parser.feed_data(bytes(part))
                if self.transport.is_closing():
                    return
        except _HeadTooLarge:
            self._refuse_head()
        except httptools.HttpParserError as exc:
            if isinstance(exc.__context__, _HeadTooLarge):
                self._refuse_head()
                return
            msg = "Invalid HTTP request received."
            self.logger.warning(msg)
            self.send_400_response(msg)
        except httptools.HttpParserUpgrade:
            if self._should_upgrade():
                self.handle_websocket_upgrade()
            else:
                self._unsupported_upgrade_warning()

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._in_head = True
        self._head_bytes = 0
        self._header_count = 0

    def on_header(self, name: bytes, value: bytes) -> None:
        self._header_count += 1
        if self._header_count > self.max_headers:
            raise _HeadTooLarge
        super().on_header(name, value)

    def on_headers_complete(self) -> None:
        self._in_head = False
        super().on_headers_complete()

    def _refuse_head(self) -> None:
        msg = (
            f"request head over {self.max_head_bytes} bytes or {self.max_headers} headers: "
            "send fewer or smaller headers"
        )
        self.logger.warning("refused a request head: %s", msg)
        body = msg.encode()
        self.transport.write(
            b"HTTP/1.1 431 Request Header Fields Too Large\r\n"
            b"content-type: text/plain; charset=utf-8\r\n"
            b"content-length: " + str(len(body)).encode() + b"\r\n"
            b"connection: close\r\n\r\n" + body
        )
        self.transport.close()
