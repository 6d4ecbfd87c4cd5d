"""Run the server: load the engine (errors surface before the port opens), then uvicorn.

Owns process-level behaviour: signal handling for a graceful drain (stop accepting, let in-flight
requests finish within the shutdown timeout, exit 0), the line per loaded model with its weight and
KV-cache bytes, the "listening on" line, and, with tensor parallelism, the node roles: a node with
--node-rank > 0 runs model ranks only (no HTTP server) until rank 0 stops them, and a server whose engine
lost a rank reports unhealthy for a moment, then exits 1.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import logging
import signal
import socket
import sys
import threading
import time
from dataclasses import dataclass
from typing import Iterator, Optional

import uvicorn

from llmctl.engine.args import EngineArgs
from llmctl.engine.errors import EngineError, RankFailedError
from llmctl.errors import UserError
from llmctl.output import format_bytes
from llmctl.engine.async_engine import DEFAULT_MAX_STREAM_BACKLOG_TOKENS, AsyncLLMEngine, ModelInfo
from llmctl.server.app import ServerSettings, build_app
from llmctl.server.connections import ConnectionLimits, guarded_protocol
from llmctl.server.replicas import load_replicas, replica_failure

logger = logging.getLogger(__name__)

# After a tensor-parallel rank failed: /health answers 503 this long (so a load balancer or an operator
# sees why), then the server stops and exits 1 for its supervisor to restart it.
RANK_FAILURE_GRACE_S = 3.0


class _GracefulServer(uvicorn.Server):
    """uvicorn re-raises SIGTERM/SIGINT after its graceful shutdown, which would end the process
    with a signal status; a drained server should exit 0, so the signal is handled here instead."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        previous = {sig: signal.signal(sig, self._on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def _on_signal(self, sig: int, frame) -> None:
        if self.should_exit:  # a second signal: stop waiting for in-flight requests
            self.force_exit = True
            return
        logger.warning("received %s: no longer accepting requests; draining in-flight ones (up to %g s)",
                       signal.Signals(sig).name, self.config.timeout_graceful_shutdown or 0)
        self.should_exit = True

    async def startup(self, sockets=None) -> None:
        await super().startup(sockets)
        if self.started:
            host, port = self.servers[0].sockets[0].getsockname()[:2]
            sys.stderr.write(f"llmctl serve: listening on http://{host}:{port} (model warming up; GET /health)\n")
            sys.stderr.flush()


def memory_line(info: ModelInfo) -> str:
    """The start-up line that says what a loaded model holds: weights (quantised linears at their
    quantised size) and the KV pool."""
    return (f"llmctl serve: {info.model}: weights {format_bytes(info.weight_bytes)} "
            f"({info.quantization or info.dtype}), KV cache {format_bytes(info.kv_cache_bytes)} "
            f"({info.dtype}, {info.max_model_len} tokens max per sequence)"
            + (f"; {info.expert_placement_text()}" if info.expert_placement else ""))


def uvicorn_config(app, settings: ServerSettings, **overrides) -> uvicorn.Config:
    """uvicorn's settings for `app`: the one place connection-level limits are set (tests use it too)."""
    options = dict(
        host=settings.host, port=settings.port, timeout_graceful_shutdown=settings.shutdown_timeout_s,
        server_header=False, date_header=True, lifespan="on",
        # uvicorn believes X-Forwarded-For from 127.0.0.1 by default, so any local process could pick
        # its own client address (and rate-limit bucket); forwarded headers count only from named proxies.
        proxy_headers=settings.forwarded_allow_ips is not None, forwarded_allow_ips=settings.forwarded_allow_ips,
        timeout_keep_alive=settings.timeout_keep_alive_s,
        http=guarded_protocol(ConnectionLimits(settings.timeout_headers_s, settings.limit_concurrency)),
    )
    return uvicorn.Config(app, **{**options, **overrides})


def check_bindable(host: str, port: int) -> None:
    """Bind `host:port` once and let go, before the model loads: a bad address fails at once with its
    cause, instead of uvicorn's raw `ERROR: [Errno 98] ...` line after the load. (uvicorn then binds
    on its own: handing it this socket instead cut in-flight streams short on a graceful drain.)"""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                             flags=socket.AI_PASSIVE)[0]
    except socket.gaierror as exc:
        raise UserError(f"could not listen on {host}:{port}: --host {host} is not an address or a name this "
                        f"machine resolves ({exc.strerror}); 127.0.0.1 is this machine only, 0.0.0.0 all") from None
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
        try:
            probe.bind(address)
        except OSError as exc:
            raise UserError(f"could not listen on {host}:{port}: {_bind_cause(host, port, exc)}") from None


def _bind_cause(host: str, port: int, exc: OSError) -> str:
    if exc.errno == errno.EADDRINUSE:
        return f"port {port} is already in use (another server?); pick another --port, or --port 0 for a free one"
    if exc.errno == errno.EADDRNOTAVAIL:
        return f"--host {host} is not an address of this machine; 127.0.0.1 is this machine only, 0.0.0.0 all"
    if exc.errno == errno.EACCES:
        return f"binding port {port} is not permitted (below 1024 needs root); pick --port 1024 or above"
    return exc.strerror or str(exc)


@dataclass
class FallbackModel:
    """`--fallback-model` and its own KV budget; every other engine setting is the primary's."""
    model: str
    tokenizer: Optional[str] = None
    kv_cache_memory: Optional[int] = None
    num_kv_blocks: Optional[int] = None
    # CUDA: the fallback loads first and may fill this fraction of the device; the primary then fills
    # up to its --gpu-memory-utilization of the whole device, so it gets the difference.
    gpu_memory_utilization: float = 0.2


def fallback_engine_args(primary: EngineArgs, fallback: FallbackModel) -> EngineArgs:
    """The fallback engine's settings: the primary's (device, dtype, batch limits, scheduling, threads),
    with its own model, tokenizer, context length (the model's) and KV budget."""
    if fallback.gpu_memory_utilization >= primary.gpu_memory_utilization:
        raise UserError(f"--fallback-gpu-memory-utilization ({fallback.gpu_memory_utilization:g}) must be below "
                        f"--gpu-memory-utilization ({primary.gpu_memory_utilization:g}): the primary gets the "
                        "difference")
    return dataclasses.replace(primary, model=fallback.model, tokenizer=fallback.tokenizer, max_model_len=None,
                               kv_cache_memory=fallback.kv_cache_memory, num_kv_blocks=fallback.num_kv_blocks,
                               gpu_memory_utilization=fallback.gpu_memory_utilization)


def load_engines(engine_args: EngineArgs, fallback: Optional[FallbackModel], **options) -> tuple[
        AsyncLLMEngine, Optional[AsyncLLMEngine]]:
    """The primary engine and, with `fallback`, the fallback's: the fallback loads first (on CUDA it
    takes its share of the device before the primary sizes its KV pool from what is left). The
    process-wide settings (torch's thread count, glibc's malloc thresholds) come from the first load;
    the second passes no thread count, so nothing is set twice."""
    if fallback is None:
        return AsyncLLMEngine.from_engine_args(engine_args, **options), None
    try:
        fallback_engine = AsyncLLMEngine.from_engine_args(fallback_engine_args(engine_args, fallback), **options)
    except EngineError as exc:
        if not exc.user_error:
            raise
        # The engine names its own flags (--num-kv-blocks); here they are the --fallback-* ones.
        raise UserError(f"--fallback-model {fallback.model}: {exc} (for the fallback: --fallback-kv-cache-memory, "
                        "--fallback-num-kv-blocks, --fallback-gpu-memory-utilization)") from None
    try:
        primary = AsyncLLMEngine.from_engine_args(dataclasses.replace(engine_args, num_threads=None), **options)
    except BaseException:
        fallback_engine.shutdown()
        raise
    return primary, fallback_engine


def _stop_after_rank_failure(server: uvicorn.Server, engines: list[AsyncLLMEngine], failed: threading.Event,
                             replicas: list[AsyncLLMEngine]) -> None:
    """Watch the engines; the first one that died of a lost rank, or any data-parallel replica that
    died (`replicas`, 2 or more), stops the server (after the grace)."""
    while not server.should_exit:
        dead = next((e.dead_error for e in engines if isinstance(e.dead_error, RankFailedError)), None)
        dead = dead or (replica_failure(replicas) if len(replicas) > 1 else None)
        if dead is not None:
            logger.critical("%s; the server stops in %g s (exit 1)", dead, RANK_FAILURE_GRACE_S)
            time.sleep(RANK_FAILURE_GRACE_S)
            failed.set()
            server.should_exit = True
            return
        time.sleep(0.25)


def run_server(engine_args: EngineArgs, settings: ServerSettings, *, max_waiting_requests: int | None,
               request_timeout_s: float | None, fallback: Optional[FallbackModel] = None,
               max_stream_backlog_tokens: Optional[int] = DEFAULT_MAX_STREAM_BACKLOG_TOKENS) -> int:
    settings.validate()
    parallel = engine_args.parallel
    if not parallel.runs_engine:
        return _run_worker_node(engine_args)
    if fallback is not None and parallel.world_size > 1:
        raise UserError("--fallback-model with --tensor-parallel-size > 1 is not supported (one tensor-parallel "
                        "engine per server)")
    if fallback is not None and engine_args.data_parallel_size > 1:
        raise UserError("--fallback-model with --data-parallel-size > 1 is not supported yet")
    check_bindable(settings.host, settings.port)
    options = dict(max_waiting_requests=max_waiting_requests, request_timeout_s=request_timeout_s,
                   max_stream_backlog_tokens=max_stream_backlog_tokens)
    if engine_args.data_parallel_size > 1:
        replicas, fallback_engine = load_replicas(engine_args, **options), None
    else:
        engine, fallback_engine = load_engines(engine_args, fallback, **options)
        replicas = [engine]
    if fallback_engine is not None:
        sys.stderr.write(memory_line(fallback_engine.model_info) + "\n")
    for index, replica in enumerate(replicas):
        sys.stderr.write(memory_line(replica.model_info) + (f" [replica {index}]\n" if len(replicas) > 1 else "\n"))
    engine = replicas[0]
    app = build_app(replicas, settings, fallback_engine=fallback_engine)
    level = logging.getLogger("llmctl").getEffectiveLevel()
    server = _GracefulServer(uvicorn_config(app, settings, log_level=max(level, logging.INFO),
                                            access_log=level <= logging.INFO))
    rank_failed = threading.Event()
    threading.Thread(target=_stop_after_rank_failure, args=(server, [engine, fallback_engine][: 1 + bool(fallback_engine)],
                                                            rank_failed, replicas), name="llmctl-rank-failure",
                     daemon=True).start()
    try:
        server.run()
    except SystemExit:  # uvicorn exits when it cannot bind (taken since check_bindable)
        pass
    if not server.started:
        raise UserError(f"could not listen on {settings.host}:{settings.port} (port in use, or not permitted?)")
    return 1 if rank_failed.is_set() else 0


def _run_worker_node(engine_args: EngineArgs) -> int:
    """--node-rank > 0 (or a torchrun rank > 0): this machine's model ranks, no HTTP server."""
    from llmctl.engine.llm_engine import runner_config
    from llmctl.engine.executor.multiproc_executor import run_worker_node

    parallel = engine_args.parallel
    ranks = (f"rank {parallel.rank} (torchrun)" if parallel.torchrun
             else f"ranks {parallel.node_ranks.start}-{parallel.node_ranks.stop - 1}")
    sys.stderr.write(f"llmctl serve: node {parallel.node_rank} of {parallel.nnodes}: {ranks} joining "
                     f"{parallel.master_addr}:{parallel.master_port}\n")
    sys.stderr.flush()
    return run_worker_node(runner_config(engine_args), parallel, engine_args.num_threads)
