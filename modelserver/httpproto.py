"""The model server's HTTP protocol: uvicorn's httptools one, whose refusal of a malformed request (a bad
``Content-Length``, a garbled request line or header) is a JSON error like every other answer, where uvicorn
sends a plain-text ``Invalid HTTP request received.``. Imported only when the server starts (it imports uvicorn).
"""

from __future__ import annotations

import json

from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol

__all__ = ["JsonErrorsProtocol"]

_BODY = json.dumps({"error": {
    "message": "invalid HTTP request (a malformed request line, header or Content-Length); send well-formed HTTP/1.1",
    "type": "invalid_request_error", "param": None, "code": "invalid_http_request"}}).encode()


class JsonErrorsProtocol(HttpToolsProtocol):
    def send_400_response(self, msg: str) -> None:
        head = [STATUS_LINE[400]]
        for name, value in self.server_state.default_headers:
            head += [name, b": ", value, b"\r\n"]
        head += [b"content-type: application/json\r\ncontent-length: ", str(len(_BODY)).encode(),
                 b"\r\nconnection: close\r\n\r\n", _BODY]
        self.transport.write(b"".join(head))
        self.transport.close()
