"""Request body limit, enforced while the body streams in (pure ASGI, no buffering).

A declared Content-Length over the limit is refused before a byte is read. Otherwise the bytes
are counted as the server hands them over, so a chunked body without Content-Length is stopped
at the limit too; a body longer than its Content-Length is a 400. Either way at most
``max_bytes`` (+ one chunk) is ever held.
"""

from __future__ import annotations

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from service.errors import PayloadTooLarge, RequestError
from service.problems import problem_response


class BodyLimit:
    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    def _too_large(self, size: str) -> PayloadTooLarge:
        return PayloadTooLarge(
            f"the request body is {size}; the limit is {self.max_bytes} bytes",
            limit_bytes=self.max_bytes,
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared: int | None = None
        for name, value in scope["headers"]:
            if name == b"content-length":
                try:
                    declared = int(value)
                except ValueError:
                    declared = -1
                break
        error: RequestError | None = None
        if declared is not None and declared < 0:
            error = RequestError("Content-Length is not a non-negative integer")
        elif declared is not None and declared > self.max_bytes:
            error = self._too_large(f"{declared} bytes (Content-Length)")
        if error is not None:
            response = problem_response(error, scope.get("path"), {"Connection": "close"})
            await response(scope, receive, send)
            return

        received = 0

        async def limited_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    raise self._too_large(f"over {self.max_bytes} bytes")
                if declared is not None and received > declared:
                    raise RequestError(
                        f"the body is longer than its Content-Length ({declared} bytes)"
                    )
            return message

        await self.app(scope, limited_receive, send)
