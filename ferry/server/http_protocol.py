"""uvicorn's HTTP/1.1 protocol (h11), with its own 400s in OpenAI's JSON shape.

A request too malformed for the app to see (a bad request line, broken headers) is answered by the
protocol itself, in plain text; ferry's clients parse errors as `{"error": {...}}` everywhere, so
this one is JSON too. Everything else is uvicorn's.
"""

from __future__ import annotations

import json

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol


class JsonErrorsH11Protocol(H11Protocol):
    def send_400_response(self, msg: str) -> None:
        body = json.dumps({"error": {"message": msg, "type": "invalid_request_error", "param": None,
                                     "code": "malformed_http"}}).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                   (b"connection", b"close")]
        for event in (h11.Response(status_code=400, headers=headers, reason=b"Bad Request"), h11.Data(data=body),
                      h11.EndOfMessage()):
            self.transport.write(self.conn.send(event))
        self.transport.close()
