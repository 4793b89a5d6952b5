"""The server's front door as plain ASGI: the API key, the draining state, the in-flight count.

Plain ASGI rather than ``@app.middleware("http")``: Starlette's BaseHTTPMiddleware runs the
route behind a wrapped ``receive``, and there ``Request.is_disconnected()`` never saw a client
leave, so a non-streaming request whose client had gone kept its KV slot to the last token
(measured: 4 × 900 tokens generated for nobody; tests/test_server.py now counts the aborts).
"""
from __future__ import annotations

import hmac

from starlette.datastructures import Headers

from .protocol import ApiError


class Gate:
    def __init__(self, app, state, error_response, open_routes: tuple[str, ...]):
        self.app, self.state, self.error_response, self.open_routes = app, state, error_response, open_routes

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        state, path = self.state, scope["path"]
        if path not in self.open_routes and state.api_key is not None:
            if not _authorized(Headers(scope=scope).get("authorization", ""), state.api_key):
                await self.error_response(ApiError(401, "invalid or missing API key (Authorization: Bearer KEY)",
                                                   kind="authentication_error", code="invalid_api_key"))(scope, receive, send)
                return
        if state.draining and path.startswith("/v1/"):
            await self.error_response(ApiError(503, "the server is shutting down", kind="server_error",
                                               code="draining"))(scope, receive, send)
            return
        state.inflight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            state.inflight -= 1


def _authorized(header: str, api_key: str) -> bool:
    """``Bearer KEY``: the scheme is case-insensitive (RFC 9110 §11.1), the key compared in constant time."""
    scheme, _, credentials = header.strip().partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(credentials.strip().encode(), api_key.encode())
