"""The gateway's HTTP connections: uvicorn's h11 protocol with two guards, so that a slow client costs a bounded share
of the gateway (issue 60: 2,100 connections that sent a header line every 2 s held every slot).

- **A header timeout**: a request whose headers have not all arrived ``header_timeout_s`` after its connection opened
  (or after the previous response on a kept-alive connection) is closed with a 408. The body has its own timeout
  (:class:`rlens.service.gateway.middleware.BodyLimit`), an idle kept-alive connection uvicorn's.
- **A per-address cap**: an address that holds ``per_address`` connections already gets a 503 on a new one, which is
  closed at once.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

log = logging.getLogger("rlens.gateway")


def _refusal(status: int, reason: str, text: str) -> bytes:
    body = text.encode()
    return (
        f"HTTP/1.1 {status} {reason}\r\ncontent-type: text/plain; charset=utf-8\r\nconnection: close\r\n"
        f"content-length: {len(body)}\r\n\r\n"
    ).encode() + body


class GuardedH11Protocol(H11Protocol):
    """h11 with a header timeout and a per-address connection cap (:func:`guarded_protocol` sets both)."""

    header_timeout_s: float = 10.0
    per_address: int = 256
    open_by_address: Counter[str] = Counter()

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._address = ""
        self._counted = False
        self._header_timer: asyncio.TimerHandle | None = None
        self._timed_cycle: object = None  # the cycle in progress when the header timer was armed

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._address = self.client[0] if self.client else ""
        cls = type(self)
        if cls.open_by_address[self._address] >= cls.per_address:
            transport.write(_refusal(503, "Service Unavailable", "too many connections from this address"))
            transport.close()
            return
        cls.open_by_address[self._address] += 1
        self._counted = True
        self._arm_header_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_header_timer()
        if self._counted:
            cls = type(self)
            cls.open_by_address[self._address] -= 1
            if cls.open_by_address[self._address] <= 0:
                del cls.open_by_address[self._address]
            self._counted = False
        super().connection_lost(exc)

    def handle_events(self) -> None:
        super().handle_events()
        if self._header_timer is not None and self.cycle is not self._timed_cycle:
            self._cancel_header_timer()  # a new request's headers arrived whole

    def on_response_complete(self) -> None:
        # the next request on this kept-alive connection: armed first, since uvicorn goes on to a pipelined request
        # already read (its handle_events then sees the new request and disarms it)
        if not self.transport.is_closing():
            self._arm_header_timer()
        super().on_response_complete()
        if self.transport.is_closing():
            self._cancel_header_timer()

    def _arm_header_timer(self) -> None:
        self._cancel_header_timer()
        self._timed_cycle = self.cycle
        self._header_timer = self.loop.call_later(self.header_timeout_s, self._headers_late)

    def _cancel_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _headers_late(self) -> None:
        self._header_timer = None
        # h11 leaves IDLE once a request's headers are whole: a request in progress is the body timeout's
        if self.transport.is_closing() or self.cycle is not self._timed_cycle or self.conn.their_state is not h11.IDLE:
            return
        if self.conn.their_state is h11.IDLE and not self.conn.trailing_data[0]:
            self.transport.close()  # nothing sent at all: no answer
            return
        self.transport.write(_refusal(408, "Request Timeout", "the request headers did not arrive in time"))
        self.transport.close()


def guarded_protocol(header_timeout_s: float, per_address: int) -> type[GuardedH11Protocol]:
    """The protocol class uvicorn runs (``http=``), with these limits and counts of its own."""
    return type(
        "GatewayH11Protocol",
        (GuardedH11Protocol,),
        {"header_timeout_s": header_timeout_s, "per_address": per_address, "open_by_address": Counter()},
    )
