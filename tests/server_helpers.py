"""Run the real server (uvicorn on a loopback port) inside the test process, in a thread, so tests
can reach both the HTTP API and the engine behind it (e.g. to check KV blocks are all free)."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from contextlib import contextmanager
from typing import Any, Iterator, Optional

import httpx
import uvicorn

from llmctl.engine import AsyncLLMEngine, EngineArgs, SamplingParams
from llmctl.engine.errors import EngineDeadError
from llmctl.server.app import ServerSettings, build_app
from llmctl.server.runner import uvicorn_config


def rss_mib() -> float:
    """This process's resident memory (the test server runs in it)."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024.0
    raise RuntimeError("no VmRSS in /proc/self/status")


def raw_exchange(port: int, chunks: list[bytes], *, pause_s: float = 0.0, timeout_s: float = 10.0) -> bytes:
    """Send `chunks` on one raw TCP connection (optionally pausing between them), then read until the
    server closes it or `timeout_s` passes. For attacks an HTTP client would normalise away."""
    received = b""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout_s) as sock:
        try:
            for chunk in chunks:
                sock.sendall(chunk)
                if pause_s:
                    time.sleep(pause_s)
        except OSError:  # the server may close before we finish sending: that is often the point
            pass
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                data = sock.recv(65536)
            except socket.timeout:
                break
            except ConnectionResetError:  # closed with our unread bytes pending: the kernel resets
                return received + b"<closed>"
            if not data:
                return received + b"<closed>"
            received += data
    return received


def responses_in(raw: bytes) -> list[int]:
    """The status codes of the HTTP responses in `raw`, in order."""
    import re

    return [int(code) for code in re.findall(rb"HTTP/1\.1 (\d{3}) ", raw)]


def json_body_of(raw: bytes) -> dict:
    import json

    head, _, rest = raw.partition(b"\r\n\r\n")
    return json.loads(rest[:rest.index(b"}}") + 2])


def wait_for(predicate: Any, timeout_s: float = 60.0, what: str = "a condition") -> None:
    """Poll `predicate` until it holds; fail naming `what` after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.02)
    raise AssertionError(f"timed out after {timeout_s:g} s waiting for {what}")


def post_json(server: "RunningServer", path: str, body: dict, timeout_s: float = 60.0) -> httpx.Response:
    return httpx.post(server.base_url + path, json=body, timeout=timeout_s)


def openai_client(server: "RunningServer", api_key: str = "none"):
    import openai

    return openai.OpenAI(base_url=server.base_url + "/v1", api_key=api_key, max_retries=0)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class RunningServer:
    def __init__(self, engine: AsyncLLMEngine, settings: ServerSettings,
                 fallback_engine: Optional[AsyncLLMEngine] = None):
        self.engine = engine
        self.fallback_engine = fallback_engine
        self.settings = settings
        self.base_url = f"http://127.0.0.1:{settings.port}"
        app = build_app(engine, settings, fallback_engine=fallback_engine)
        self.server = uvicorn.Server(uvicorn_config(app, settings, log_level="warning"))
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

    @property
    def port(self) -> int:
        return self.settings.port

    def assert_recovered(self, rss_before_mib: float, rss_bound_mib: float = 256.0) -> None:
        """After an attack: /health 200, every KV block free, and RSS back within `rss_bound_mib`."""
        assert httpx.get(self.base_url + "/health", timeout=10).status_code == 200
        self.wait_idle()
        import gc

        gc.collect()
        grown = rss_mib() - rss_before_mib
        print(f"RSS growth after the attack: {grown:.0f} MiB (bound {rss_bound_mib:.0f} MiB)")
        assert grown < rss_bound_mib, f"RSS grew by {grown:.0f} MiB (bound {rss_bound_mib:.0f} MiB)"

    def wait_idle(self, timeout: float = 20.0) -> dict[str, float]:
        """Wait until the engine (and the fallback's) holds no request and every KV block is free again."""
        deadline = time.monotonic() + timeout
        engines = [self.engine] + ([self.fallback_engine] if self.fallback_engine is not None else [])
        stats = [engine.get_stats() for engine in engines]
        while time.monotonic() < deadline:
            stats = [engine.get_stats() for engine in engines]
            if all(s.get("num_requests") == 0 and s.get("num_pending") == 0
                   and s.get("num_free_blocks") == s.get("num_total_blocks") for s in stats):
                return stats[0]
            time.sleep(0.05)
        raise AssertionError(f"engine not idle: {stats}")


@contextmanager
def running_server(model: Optional[str] = None, *, engine_options: Optional[dict[str, Any]] = None,
                   max_waiting_requests: Optional[int] = None, request_timeout_s: Optional[float] = None,
                   fallback: Optional[Any] = None, **settings: Any) -> Iterator[RunningServer]:
    """`fallback`: a `llmctl.server.runner.FallbackModel` served beside the model (loaded as `serve` does)."""
    from llmctl.server.runner import load_engines

    args = EngineArgs.from_dict({"model": None if model is None else str(model), "device": "cpu",
                                 **(engine_options or {})})
    engine, fallback_engine = load_engines(args, fallback, max_waiting_requests=max_waiting_requests,
                                           request_timeout_s=request_timeout_s)
    server = RunningServer(engine, ServerSettings(port=free_port(), **settings), fallback_engine).start()
    try:
        yield server
    finally:
        server.stop()


@contextmanager
def injected_step_latency(engine: AsyncLLMEngine, seconds: float) -> Iterator[None]:
    """Every step of `engine` takes `seconds` longer (a slower model, or a busier device), so a
    test's long request outlasts what it checks meanwhile on any machine."""
    executor = engine.engine.executor
    execute = executor.execute

    def slow_execute(*args: Any, **kwargs: Any) -> Any:
        time.sleep(seconds)
        return execute(*args, **kwargs)

    executor.execute = slow_execute
    try:
        yield
    finally:
        executor.execute = execute


def kill_engine(server: RunningServer) -> None:
    """Make the engine die as it does on a fatal CUDA error in a step, and return once it has."""
    def fatal_step(*_args: Any) -> None:
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    server.engine.engine.executor.runner.execute = fatal_step

    async def run_one() -> None:
        stream = await server.engine.add_request("kill-engine", "x", SamplingParams(max_tokens=2))
        try:
            async for _ in stream:
                pass
        except EngineDeadError:
            return
        raise AssertionError("the engine survived a fatal step failure")

    asyncio.run(run_one())


def shrink_server_send_buffer(srv: "RunningServer", client: tuple) -> None:
    """Loopback autotunes the server's send buffer to ~1 MB, which would hold a whole small stream;
    a 4 KiB one (on the real accepted socket of `client`) makes the server's writes wait as soon as
    the client stops reading."""
    deadline = time.monotonic() + 10
    while True:
        mine = [c for c in list(srv.server.server_state.connections) if c.client == client[:2]]
        if mine:
            break
        assert time.monotonic() < deadline, "the server never accepted the connection"
        time.sleep(0.01)
    mine[0].transport.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
