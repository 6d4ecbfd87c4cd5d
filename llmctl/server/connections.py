"""Connection-level limits uvicorn does not have: a deadline for request headers and a connection cap.

uvicorn closes a connection only when it has been idle for `timeout_keep_alive` *after* a response;
a client that connects and sends nothing, or sends its headers a byte at a time (slowloris), holds a
connection forever. `GuardedH11Protocol` closes a connection whose request headers are not complete
`header_timeout_s` after the connection opened (or after its previous response), and answers every
request on a connection opened past `max_connections` with an OpenAI-shaped 503. (uvicorn's own
`limit_concurrency` answers text/plain and only counts once headers arrive.)
"""

from __future__ import annotations

import asyncio
import functools
import logging
from dataclasses import dataclass
from typing import Any, Callable, Optional

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from llmctl.server.errors import APIError
from llmctl.server.middleware import send_error

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ConnectionLimits:
    header_timeout_s: float
    max_connections: Optional[int]


def guarded_protocol(limits: ConnectionLimits) -> Callable[..., H11Protocol]:
    """The `http=` protocol factory for `uvicorn.Config`."""
    return functools.partial(GuardedH11Protocol, limits=limits)


class GuardedH11Protocol(H11Protocol):
    def __init__(self, *args: Any, limits: ConnectionLimits, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.limits = limits
        self._header_timer: Optional[asyncio.TimerHandle] = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        cap = self.limits.max_connections
        if cap is not None and len(self.connections) > cap:
            # Answered once its request is parsed (closing now could reset the client's socket
            # before it read the answer); the header deadline still bounds how long that may take.
            logger.warning("connection refused: %d open connections (--limit-concurrency %d)",
                           len(self.connections), cap)
            self.app = functools.partial(_refuse_over_capacity, cap=cap)
        self._arm_header_timer()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self.conn.their_state is h11.IDLE:  # still reading a request's headers
            if self._header_timer is None:
                self._arm_header_timer()
        else:
            self._cancel_header_timer()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._cancel_header_timer()  # idle from here on is uvicorn's keep-alive timeout

    def connection_lost(self, exc: Optional[Exception]) -> None:
        self._cancel_header_timer()
        super().connection_lost(exc)

    def _arm_header_timer(self) -> None:
        self._cancel_header_timer()
        self._header_timer = self.loop.call_later(self.limits.header_timeout_s, self._on_header_timeout)

    def _cancel_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _on_header_timeout(self) -> None:
        self._header_timer = None
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            logger.info("closing a connection whose request headers did not arrive within %g s (--timeout-headers)",
                        self.limits.header_timeout_s)
            self.transport.close()


async def _refuse_over_capacity(scope: dict, receive: Callable, send: Callable, *, cap: int) -> None:
    await send_error(send, APIError(503, f"the server has too many open connections (--limit-concurrency {cap}); "
                                         "retry shortly", code="too_many_connections", headers={"Retry-After": "1"}),
                     close=True)
