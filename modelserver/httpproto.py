"""The model server's HTTP protocol: uvicorn's httptools one, whose refusals are JSON errors like every
other answer, with the router's bounds on a request's head (``router.edge.connlimits``):

- a malformed request (a bad ``Content-Length``, a garbled request line or header) -> 400, where uvicorn
  sends a plain-text ``Invalid HTTP request received.``;
- more than :data:`MAX_HEADERS` headers, or a head over :data:`MAX_HEAD_BYTES` -> 431 (uvicorn buffered
  an 8 MB header and answered it).

Each refusal closes the connection. Imported only when the server starts (it imports uvicorn).
"""

from __future__ import annotations

import json

from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol

__all__ = ["MAX_HEADERS", "MAX_HEAD_BYTES", "JsonErrorsProtocol"]

MAX_HEAD_BYTES = 64 * 1024
MAX_HEADERS = 100

_MALFORMED = (400, "invalid HTTP request (a malformed request line, header or Content-Length); "
                   "send well-formed HTTP/1.1", "invalid_http_request")
_TOO_MANY = (431, f"request has more than {MAX_HEADERS} headers; send fewer", "request_header_fields_too_large")
_TOO_LARGE = (431, f"request head is larger than {MAX_HEAD_BYTES} bytes; send fewer or shorter headers",
              "request_header_fields_too_large")


class _Refused(Exception):
    """Raised in a parser callback: the parser stops, and :meth:`JsonErrorsProtocol.send_400_response` answers."""


class JsonErrorsProtocol(HttpToolsProtocol):
    _refusal: tuple[int, str, str] | None = None
    _in_head = False
    _head_bytes = 0

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self._in_head and not self.transport.is_closing():
            self._head_bytes += len(data)
            if self._head_bytes > MAX_HEAD_BYTES:
                self._refuse(_TOO_LARGE)

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._in_head, self._head_bytes = True, 0

    def on_header(self, name: bytes, value: bytes) -> None:
        if len(self.headers) >= MAX_HEADERS:
            self._refusal = _TOO_MANY
            raise _Refused
        super().on_header(name, value)

    def on_headers_complete(self) -> None:
        self._in_head = False
        super().on_headers_complete()

    def send_400_response(self, msg: str) -> None:
        """uvicorn's answer to a request its parser refused (``msg``, plain text there): the JSON error instead."""
        self._refuse(self._refusal or _MALFORMED)

    def _refuse(self, refusal: tuple[int, str, str]) -> None:
        status, message, code = refusal
        body = json.dumps({"error": {"message": message, "type": "invalid_request_error", "param": None,
                                     "code": code}}).encode()
        head = [STATUS_LINE[status]]
        for name, value in self.server_state.default_headers:
            head += [name, b": ", value, b"\r\n"]
        head += [b"content-type: application/json\r\ncontent-length: ", str(len(body)).encode(),
                 b"\r\nconnection: close\r\n\r\n", body]
        self.transport.write(b"".join(head))
        self.transport.close()
