"""uvicorn's h11 protocol with a header-read timeout.

uvicorn closes a connection idle between requests (``timeout_keep_alive``) but arms nothing on a
new connection: one that sends no request, or half a request head, stays open for ever (measured:
a socket sending ``GET / HTTP/1.1\\r\\n`` and then nothing was still open after minutes). Here a
connection must complete each request head within ``seconds`` of connecting, or of its previous
response, or it is closed.
"""
from __future__ import annotations

import asyncio

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol


def with_header_timeout(seconds: float) -> type[H11Protocol]:
    class HeaderTimeoutProtocol(H11Protocol):
        _header_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._arm()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._arm()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _arm(self) -> None:
            self._disarm()
            if not self.transport.is_closing():
                self._header_timer = self.loop.call_later(seconds, self._expired)

        def _disarm(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _expired(self) -> None:
            self._header_timer = None
            if self.conn.their_state is h11.IDLE and not self.transport.is_closing():  # no complete request head
                self.transport.close()

    return HeaderTimeoutProtocol
