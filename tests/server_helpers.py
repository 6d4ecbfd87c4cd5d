"""Run the real server (uvicorn on a loopback port) inside the test process, in a thread, so tests
can reach both the HTTP API and the engine behind it (e.g. to check KV blocks are all free)."""

from __future__ import annotations

import socket
import threading
import time
from contextlib import contextmanager
from typing import Any, Iterator, Optional

import httpx
import uvicorn

from llmctl.engine import AsyncLLMEngine, EngineArgs
from llmctl.server.app import ServerSettings, build_app


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class RunningServer:
    def __init__(self, engine: AsyncLLMEngine, settings: ServerSettings):
        self.engine = engine
        self.settings = settings
        self.base_url = f"http://127.0.0.1:{settings.port}"
        config = uvicorn.Config(build_app(engine, settings), host="127.0.0.1", port=settings.port,
                                log_level="warning", timeout_graceful_shutdown=settings.shutdown_timeout_s)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def start(self) -> "RunningServer":
        self.thread.start()
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                if httpx.get(self.base_url + "/health", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
        raise RuntimeError("the test server did not become healthy")

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)

    def wait_idle(self, timeout: float = 20.0) -> dict[str, float]:
        """Wait until the engine holds no request and every KV block is free again."""
        deadline = time.monotonic() + timeout
        stats = self.engine.get_stats()
        while time.monotonic() < deadline:
            stats = self.engine.get_stats()
            if (stats.get("num_requests") == 0 and stats.get("num_pending") == 0
                    and stats.get("num_free_blocks") == stats.get("num_total_blocks")):
                return stats
            time.sleep(0.05)
        raise AssertionError(f"engine not idle: {stats}")


@contextmanager
def running_server(model: Optional[str] = None, *, engine_options: Optional[dict[str, Any]] = None,
                   max_waiting_requests: Optional[int] = None, request_timeout_s: Optional[float] = None,
                   **settings: Any) -> Iterator[RunningServer]:
    args = EngineArgs.from_dict({"model": None if model is None else str(model), "device": "cpu",
                                 **(engine_options or {})})
    engine = AsyncLLMEngine.from_engine_args(args, max_waiting_requests=max_waiting_requests,
                                             request_timeout_s=request_timeout_s)
    server = RunningServer(engine, ServerSettings(port=free_port(), **settings)).start()
    try:
        yield server
    finally:
        server.stop()
