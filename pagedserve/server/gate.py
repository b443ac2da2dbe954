"""The gate every HTTP request passes before the app sees it: the API key, then the size.

Order matters: a request without the key gets 401 whatever its body holds (a malformed body
must not tell an unauthenticated caller anything, nor cost the server a parse), and a body
over the limit gets 413 before it is parsed or tokenized, so a giant prompt costs neither
latency for others nor memory that outlives it. Bodies are read up to the limit and
replayed to the app; the connection's later messages (a disconnect) pass through.
"""
from __future__ import annotations

import json
import secrets

GUARDED_PREFIXES = ("/v1/", "/tokenize", "/detokenize")


def _error(status: int, message: str, type_: str, param: str | None = None) -> bytes:
    return json.dumps({"error": {"message": message, "type": type_, "param": param, "code": status}}).encode()


class Gate:
    def __init__(self, app, api_key: str | None, max_request_bytes: int | None) -> None:
        self.app = app
        self.api_key = api_key
        self.max_request_bytes = max_request_bytes

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope.get("path", "")
        if self.api_key is not None and path.startswith(GUARDED_PREFIXES) and not self._authorized(scope):
            return await self._reply(send, 401, _error(401, "Incorrect or missing API key: send 'Authorization: "
                                                            "Bearer <key>'.", "AuthenticationError"))
        limit = self.max_request_bytes
        if limit is None or scope.get("method") in ("GET", "HEAD"):
            return await self.app(scope, receive, send)
        declared = self._content_length(scope)
        if declared is not None and declared > limit:
            return await self._too_large(send, declared)
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client left before sending the body
                return
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > limit:
                return await self._too_large(send, size)
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    def _authorized(self, scope) -> bool:
        given = next((v.decode("latin-1") for k, v in scope.get("headers", ()) if k == b"authorization"), "")
        scheme, _, token = given.partition(" ")
        return scheme.lower() == "bearer" and secrets.compare_digest(token.strip().encode(), self.api_key.encode())

    @staticmethod
    def _content_length(scope) -> int | None:
        for k, v in scope.get("headers", ()):
            if k == b"content-length":
                try:
                    return int(v)
                except ValueError:
                    return None
        return None

    async def _too_large(self, send, size: int) -> None:
        await self._reply(send, 413, _error(
            413, f"body: the request is {size} bytes or more, over this server's limit of {self.max_request_bytes} "
                 f"bytes (--max-request-bytes)", "RequestTooLargeError", "body"))

    @staticmethod
    async def _reply(send, status: int, body: bytes) -> None:
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})
