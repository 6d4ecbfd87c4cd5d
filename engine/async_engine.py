"""`AsyncLLMEngine`: an `LLMEngine` stepping in its own thread, driven from asyncio.

Owns the engine thread and the hand-off between it and the event loop. Submissions, aborts and
calls go in through a lock-guarded inbox and are applied between steps (so requests join the
running batch: continuous batching); outputs come back through each request's `RequestStream`.
On top of `LLMEngine` it adds warm-up, admission control (a bounded waiting queue), per-request
deadlines and fault isolation: a step that raises fails only the requests it ran, and only a fatal
failure stops the engine (then every pending request fails at once). Only the engine thread
touches the `LLMEngine`.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable, Optional, Union

from llmctl.engine.args import EngineArgs
from llmctl.engine.errors import (EngineDeadError, EngineOverloadedError, InvalidRequestError,
                                  RequestTimeoutError, StepFailedError, StreamBacklogError, is_out_of_memory)
from llmctl.engine.executor.abstract import Executor
from llmctl.engine.executor.lockstep import LockstepMember
from llmctl.engine.llm_engine import LLMEngine, ModelInfo, StepInfo
from llmctl.engine.model_runner import RunnerConfig
from llmctl.engine.outputs import RequestOutput
from llmctl.engine.pooling import PoolingParams
from llmctl.engine.sampling_params import RequestOutputKind, SamplingParams

logger = logging.getLogger(__name__)

Prompt = Union[str, list[int]]
StepListener = Callable[[StepInfo, dict[str, float]], None]
SubmissionListener = Callable[[], None]
MAX_CONSECUTIVE_STEP_FAILURES = 3
# An idle engine thread wakes this often to ask the model side whether it can still step (a
# tensor-parallel rank that died between requests turns the server unhealthy within this much).
HEALTH_CHECK_INTERVAL_S = 1.0
# Unread streamed output per request (tokens plus logprob alternatives): a few MiB, far past what
# a reader that keeps reading ever leaves behind.
DEFAULT_MAX_STREAM_BACKLOG_TOKENS = 65536
_FATAL_MARKERS = ("CUDA error", "device-side assert", "illegal memory access", "NCCL error")


def _call_soon(loop: asyncio.AbstractEventLoop, fn: Callable, *args: Any) -> None:
    """Schedule `fn` on a caller's event loop from the engine thread; a closed loop has nobody
    waiting any more, so the hand-off is dropped rather than failing the engine thread."""
    try:
        loop.call_soon_threadsafe(fn, *args)
    except RuntimeError:
        if not loop.is_closed():
            raise


def _settle(future: asyncio.Future, error: Optional[BaseException] = None, value: Any = None) -> None:
    """Complete a future from the event loop unless its waiter has given up (cancelled)."""
    if future.done():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(value)


class RequestStream:
    """One request's outputs in order (`async for`); raises the request's error if it fails.

    A reader that stops reading (a stalled SSE client) holds one output, not one per step (it used
    to be one per step: n=16 with logprobs grew the server by 241 MiB for one such reader): a newer
    cumulative output replaces the one not taken yet, and a newer delta (`aggregate`, for
    `RequestOutputKind.DELTA`) is appended to it, so the reader still gets every token once. The
    appended deltas are bounded too: past `max_backlog` unread tokens (each logprob alternative
    counts as one) the request is aborted, its unread output dropped, and the reader gets
    `StreamBacklogError`.
    """

    def __init__(self, request_id: str, loop: asyncio.AbstractEventLoop, on_cancel: Callable[[str], None],
                 aggregate: bool = False, max_backlog: Optional[int] = None):
        self.request_id = request_id
        self.finished = False
        self._aggregate = aggregate
        self._max_backlog = max_backlog if aggregate else None
        self._loop = loop
        self._pending: deque[Union[RequestOutput, BaseException]] = deque()
        self._unread: deque[int] = deque()  # the size of each pending item (tokens and logprob alternatives)
        self._overflowed = False
        self._arrived = asyncio.Event()
        self._on_cancel = on_cancel

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        return self._loop

    @property
    def backlog(self) -> int:
        """Items waiting for the reader: at most one output, plus a final output or an error."""
        return len(self._pending)

    def push(self, item: Union[RequestOutput, BaseException]) -> None:
        """Called from the engine thread."""
        _call_soon(self._loop, self.put_now, item)

    @property
    def unread_tokens(self) -> int:
        """Tokens (and logprob alternatives) delivered and not yet taken by the reader."""
        return sum(self._unread)

    def put_now(self, item: Union[RequestOutput, BaseException]) -> None:
        """Called on the stream's event loop."""
        if self._overflowed:
            return  # aborted for its backlog: the reader gets that error, nothing after it
        last = self._pending[-1] if self._pending else None
        size = _output_size(item) if isinstance(item, RequestOutput) else 0
        if isinstance(last, RequestOutput) and not last.finished:
            if not self._aggregate:
                self._pending.pop()
                self._unread.pop()
            elif isinstance(item, RequestOutput):
                last.add(item, aggregate=True)  # the pending output is the stream's own: the engine made it
                self._unread[-1] += size
                self._arrived.set()
                self._bound_backlog()
                return
        self._pending.append(item)
        self._unread.append(size)
        self._arrived.set()
        self._bound_backlog()

    def _bound_backlog(self) -> None:
        unread = self.unread_tokens
        if self._max_backlog is None or unread <= self._max_backlog:
            return
        self._overflowed = True
        self._pending.clear()  # the memory goes now, not when the stalled reader's connection is cut
        self._unread.clear()
        logger.warning("request %s aborted: its reader left %d tokens of output unread (limit %d, "
                       "--max-stream-backlog-tokens)", self.request_id, unread, self._max_backlog)
        self._pending.append(StreamBacklogError(
            f"the client read too slowly: {unread} tokens of output were waiting to be sent "
            f"(limit {self._max_backlog}); the request was aborted"))
        self._unread.append(0)
        self._on_cancel(self.request_id)

    def __aiter__(self) -> "RequestStream":
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        while not self._pending:
            self._arrived.clear()
            await self._arrived.wait()
        item = self._pending.popleft()
        self._unread.popleft()
        if isinstance(item, BaseException):
            self.finished = True
            raise item
        self.finished = item.finished
        return item

    def cancel(self) -> None:
        """Abort the request (frees its KV blocks at the next step) unless it already finished."""
        if not self.finished:
            self.finished = True
            self._on_cancel(self.request_id)


def _output_size(output: RequestOutput) -> int:
    """What an output holds, in tokens: each generated token and each of its logprob alternatives."""
    return sum(len(c.token_ids) + sum(len(alternatives) for alternatives in c.logprobs or ())
               for c in output.outputs)


@dataclass
class _Submission:
    request_id: str
    prompt: Prompt
    params: Union[SamplingParams, PoolingParams]
    priority: int
    deadline: Optional[float]
    stream: RequestStream
    accepted: asyncio.Future
    arrival_time: float = field(default_factory=time.monotonic)


class AsyncLLMEngine:
    """`AsyncLLMEngine.from_engine_args(args)`, then `start()`; `async for out in engine.generate(...)`."""

    def __init__(self, engine: Optional[LLMEngine], *, max_waiting_requests: Optional[int] = None,
                 request_timeout_s: Optional[float] = None, step_listener: Optional[StepListener] = None,
                 max_stream_backlog_tokens: Optional[int] = DEFAULT_MAX_STREAM_BACKLOG_TOKENS,
                 lockstep: Optional[LockstepMember] = None):
        """`lockstep`: this replica's side of the data-parallel replicas' rounds (experts dealt over them):
        the engine thread then runs an idle step for each round the others open, even with nothing to do."""
        if max_waiting_requests is not None and max_waiting_requests < 0:
            raise ValueError("max_waiting_requests must be >= 0")
        if request_timeout_s is not None and request_timeout_s <= 0:
            raise ValueError("request_timeout_s must be > 0")
        if max_stream_backlog_tokens is not None and max_stream_backlog_tokens < 1:
            raise ValueError("max_stream_backlog_tokens must be >= 1")
        self.engine = engine
        self.max_waiting_requests = max_waiting_requests
        self.max_stream_backlog_tokens = max_stream_backlog_tokens
        self.request_timeout_s = request_timeout_s
        self._lockstep = lockstep
        self._step_listeners: list[StepListener] = [step_listener] if step_listener else []
        self._submission_listeners: list[SubmissionListener] = []
        self._lock = threading.Lock()
        self._wakeup = threading.Condition(self._lock)
        self._inbox: deque = deque()
        self._streams: dict[str, RequestStream] = {}
        self._deadlines: dict[str, float] = {}
        self._pending = 0  # submitted, and in no published snapshot yet (queued in the inbox or just added)
        self._num_waiting = 0
        self._stopping = False
        self._ready = threading.Event()
        self._start_requested = threading.Event()
        self._warm = True
        self._thread: Optional[threading.Thread] = None
        self._consecutive_failures = 0
        self._stats: dict[str, float] = {}
        self._stats_version = 0
        self.dead_error: Optional[EngineDeadError] = None

    @classmethod
    def from_engine_args(cls, args: EngineArgs, executor_class: Optional[Callable[[RunnerConfig], Executor]] = None,
                         **options: Any) -> "AsyncLLMEngine":
        """Load the model on the engine thread itself (returns once loaded; load errors raise here);
        `executor_class`: LLMEngine's (None: its default).

        The thread that builds the weights should be the one that steps: with the weights built
        on another thread, the same CPU decode step measured 15-20% slower.
        """
        async_engine = cls(None, **options)
        async_engine._launch(lambda: LLMEngine(args, executor_class))
        return async_engine

    @property
    def model_info(self) -> ModelInfo:
        """The served model's facts (name, context length, vocabulary, tokenizer, EOS ids): what
        callers on the event loop read instead of the `LLMEngine`, which belongs to the engine thread."""
        if self.engine is None:
            raise EngineDeadError("the engine is not loaded")
        return self.engine.model_info

    # ---- lifecycle ----------------------------------------------------------------------------
    def _launch(self, build: Callable[[], LLMEngine]) -> None:
        loaded = threading.Event()
        failure: list[BaseException] = []
        self._thread = threading.Thread(target=self._thread_main, args=(build, loaded, failure),
                                        name="llmctl-engine", daemon=True)
        self._thread.start()
        loaded.wait()
        if failure:
            self._thread.join()
            self._thread = None
            raise failure[0]

    def _thread_main(self, build: Callable[[], LLMEngine], loaded: threading.Event,
                     failure: list[BaseException]) -> None:
        try:
            self.engine = build()
        except BaseException as exc:  # noqa: BLE001 - handed to the caller of from_engine_args
            failure.append(exc)
            return
        finally:
            loaded.set()
        self._start_requested.wait()
        try:
            self._serve()
        finally:
            self.engine.shutdown()  # the other ranks (tensor parallel) stop with the engine thread

    def _serve(self) -> None:
        try:
            if self._warm and not self._stopping:
                self._warm_up()
            self._stats = self.engine.get_stats()
        except BaseException as exc:  # noqa: BLE001 - a failed warm-up is a dead engine
            self._die(exc)
            self._ready.set()
            return
        self._ready.set()
        self._run()

    def start(self, warm_up: bool = True) -> None:
        """Warm up on the engine thread, then serve; blocks until ready (`is_ready` turns true)."""
        if self._thread is None:
            engine = self.engine
            self._launch(lambda: engine)
        self._warm = warm_up
        self._start_requested.set()
        self._ready.wait()
        if self.dead_error is not None:
            raise self.dead_error

    def _warm_up(self) -> None:
        """One small prefill and decode, so the first real request does not pay one-time costs."""
        prompt = list(range(min(8, self.engine.vocab_size)))
        self.engine.add_request("llmctl-warmup", prompt, SamplingParams(max_tokens=2, temperature=0.0,
                                                                       ignore_eos=True))
        while self.engine.has_unfinished_requests():
            self.engine.step()

    @property
    def is_ready(self) -> bool:
        return self._ready.is_set() and self.is_healthy

    @property
    def is_healthy(self) -> bool:
        alive = self._thread is None or self._thread.is_alive() or self._stopping
        return self.dead_error is None and alive

    def shutdown(self, timeout_s: float = 10.0) -> None:
        """Stop the engine thread; requests still in flight fail with `EngineDeadError`."""
        with self._lock:
            self._stopping = True
            self._notify()
        self._start_requested.set()  # a thread still waiting for start() exits
        if self._thread is not None:
            self._thread.join(timeout_s)

    # ---- requests (event loop side) -----------------------------------------------------------
    async def add_request(self, request_id: str, prompt: Prompt, params: Union[SamplingParams, PoolingParams], *,
                          priority: int = 0, timeout_s: Optional[float] = None) -> RequestStream:
        """Submit a request (with `PoolingParams`: an embedding, one output); returns once the engine accepted it
        (validation errors raise here)."""
        loop = asyncio.get_running_loop()
        if getattr(params, "structured_outputs", None) is not None and self.engine is not None:
            # compiled on a worker thread (cached by spec): neither this loop nor the step loop waits on it
            await asyncio.to_thread(self.engine.structured_output.compile, params.structured_outputs)
        stream = RequestStream(request_id, loop, self.abort, aggregate=params.output_kind is RequestOutputKind.DELTA,
                               max_backlog=self.max_stream_backlog_tokens)
        timeout_s = timeout_s if timeout_s is not None else self.request_timeout_s
        submission = _Submission(request_id, prompt, params, priority,
                                 time.monotonic() + timeout_s if timeout_s else None, stream, loop.create_future())
        with self._lock:
            self._admit(request_id)
            self._streams[request_id] = stream
            self._pending += 1
            self._inbox.append(("add", submission))
            self._notify()
        for listener in self._submission_listeners:
            listener()
        try:
            await submission.accepted
        except asyncio.CancelledError:
            self.abort(request_id)
            raise
        return stream

    def _admit(self, request_id: str) -> None:
        if self.dead_error is not None:
            raise self.dead_error
        if self._stopping:
            raise EngineDeadError("the server is shutting down")
        if not self._ready.is_set():
            raise EngineOverloadedError("the engine is still warming up", retry_after_s=5)
        if request_id in self._streams:
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        limit = self.max_waiting_requests
        if limit is not None and self._pending + self._num_waiting >= limit:
            raise EngineOverloadedError(f"the server is over capacity: {limit} requests are already waiting")

    async def generate(self, prompt: Prompt, params: SamplingParams, request_id: str, *,
                       priority: int = 0, timeout_s: Optional[float] = None) -> AsyncIterator[RequestOutput]:
        """Stream a request's outputs; leaving the loop early (or being cancelled) aborts it."""
        stream = await self.add_request(request_id, prompt, params, priority=priority, timeout_s=timeout_s)
        try:
            async for output in stream:
                yield output
        finally:
            stream.cancel()

    def abort(self, request_id: str) -> None:
        """Abort a request from any thread; its blocks are freed before the next step."""
        with self._lock:
            self._inbox.append(("abort", request_id))
            self._notify()

    async def call_in_engine_thread(self, fn: Callable[[LLMEngine], Any]) -> Any:
        """Run `fn(engine)` on the engine thread between steps (e.g. to start a profiler there)."""
        if self.dead_error is not None:
            raise self.dead_error
        future = asyncio.get_running_loop().create_future()
        with self._lock:
            self._inbox.append(("call", (fn, future)))
            self._notify()
        return await future

    def add_submission_listener(self, listener: SubmissionListener) -> None:
        """Call `listener()` on the submitting task right after a request is queued for the engine
        (from then on `get_stats()` counts it: in `num_pending` until a snapshot shows it)."""
        self._submission_listeners.append(listener)

    def add_step_listener(self, listener: StepListener) -> None:
        """Call `listener(step_info, stats)` on the engine thread after every step that ran (e.g. metrics)."""
        self._step_listeners.append(listener)

    def get_stats(self) -> dict[str, float]:
        """The latest scheduler/KV snapshot (published by the engine thread after each step)."""
        with self._lock:
            pending = self._pending
        return {**self._stats, "num_pending": pending}

    @property
    def stats_version(self) -> int:
        """How many snapshots the engine thread has published (a balancer's tally of the requests it
        sent since the last one restarts when this moves)."""
        with self._lock:
            return self._stats_version

    def _notify(self) -> None:
        """Under `_lock`: the engine thread has something to do (it waits on the lockstep's condition there)."""
        self._wakeup.notify()
        if self._lockstep is not None:
            self._lockstep.wake()

    # ---- engine thread ------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while self._loop_once():
                pass
        except BaseException as exc:  # noqa: BLE001 - a dead engine must fail its requests, not hang them
            self._leave_lockstep(f"failed ({type(exc).__name__}: {exc})")
            self._die(exc)
        else:
            self._leave_lockstep("stopped")
            self._fail_everything(EngineDeadError("the server is shutting down"))

    def _leave_lockstep(self, why: str) -> None:
        if self._lockstep is not None:
            self._lockstep.leave(why)

    def _loop_once(self) -> bool:
        if self._lockstep is not None and not self.engine.has_unfinished_requests():
            # idle: wait for a request or another replica's round (deque and bool reads need no lock)
            self._lockstep.wait(lambda: bool(self._inbox) or self._stopping, HEALTH_CHECK_INTERVAL_S)
        with self._lock:
            if self._lockstep is None and not self._inbox and not self.engine.has_unfinished_requests() \
                    and not self._stopping:
                self._wakeup.wait(HEALTH_CHECK_INTERVAL_S)
            commands = list(self._inbox)
            self._inbox.clear()
            stopping = self._stopping
        for kind, payload in commands:
            self._apply(kind, payload)
        added = sum(kind == "add" for kind, _ in commands)
        if stopping:
            return False
        self.engine.check_health()
        self._expire_deadlines()
        joined = self._lockstep.joined if self._lockstep is not None else 0
        step = self._step() if self.engine.has_unfinished_requests() else None
        if self._lockstep is not None and self._lockstep.joined == joined:
            self._catch_up()
        stats = self.engine.get_stats()  # one snapshot per iteration, for readers and listeners alike
        with self._lock:
            self._stats = stats
            self._stats_version += 1
            self._pending -= added  # the snapshot shows them now (as waiting or running, or gone)
            self._num_waiting = int(stats.get("num_waiting", 0))
        for listener in self._step_listeners if step is not None else ():
            listener(step, stats)
        return True

    def _catch_up(self) -> None:
        """No forward of its own this iteration: run an idle step for each round the other replicas opened (a
        replica that has work joins them with its next forward instead)."""
        while self._lockstep.behind:
            self.engine.idle_step()

    def _apply(self, kind: str, payload: Any) -> None:
        if kind == "add":
            self._add(payload)
        elif kind == "abort":
            self.engine.abort_request(payload)
            self._forget(payload)
        else:
            fn, future = payload
            try:
                result, error = fn(self.engine), None
            except Exception as exc:  # noqa: BLE001 - handed back to the caller
                result, error = None, exc
            _call_soon(future.get_loop(), _settle, future, error, result)

    def _add(self, sub: _Submission) -> None:
        error: Optional[BaseException] = None
        try:
            self.engine.add_request(sub.request_id, sub.prompt, sub.params, arrival_time=sub.arrival_time,
                                    priority=sub.priority)
        except Exception as exc:  # noqa: BLE001 - invalid requests go back to their caller
            error = exc
        if error is not None:
            with self._lock:
                self._streams.pop(sub.request_id, None)
        if error is None and sub.deadline is not None:
            self._deadlines[sub.request_id] = sub.deadline
        _call_soon(sub.accepted.get_loop(), _settle, sub.accepted, error)

    def _expire_deadlines(self) -> None:
        now = time.monotonic()
        for request_id, deadline in list(self._deadlines.items()):
            if now >= deadline:
                self.engine.abort_request(request_id)
                self._finish(request_id, RequestTimeoutError(
                    f"the request ran past its {self.request_timeout_s or 0:g} s timeout and was aborted"))

    def _step(self) -> Optional[StepInfo]:
        """One engine step; returns what it ran (None when it failed or scheduled nothing)."""
        try:
            step = self.engine.step()
        except Exception as exc:  # noqa: BLE001 - isolate the failure to this step's requests
            self._recover(exc)
            return None
        self._consecutive_failures = 0
        deliveries: dict[asyncio.AbstractEventLoop, list] = {}
        for output in step.outputs:
            if output.error is not None:  # finished by the engine: it does not fit in memory even alone
                self._finish(output.request_id, output.error)
                continue
            stream = self._stream(output.request_id)
            if stream is not None:
                deliveries.setdefault(stream.loop, []).append((stream, output))
            if output.finished:
                self._forget(output.request_id)
        for loop, batch in deliveries.items():  # one wake-up of the event loop per step, not per request
            _call_soon(loop, _deliver, batch)
        if not step.ran:  # nothing was scheduled (e.g. dynamic batching holds a small batch)
            with self._lock:
                self._wakeup.wait(0.002)
            return None
        return step

    def _recover(self, exc: Exception) -> None:
        if isinstance(exc, EngineDeadError) or any(marker in str(exc) for marker in _FATAL_MARKERS):
            raise exc
        self._consecutive_failures += 1
        if self._consecutive_failures >= MAX_CONSECUTIVE_STEP_FAILURES:
            raise EngineDeadError(f"{self._consecutive_failures} engine steps failed in a row; "
                                  f"last: {type(exc).__name__}: {exc}") from exc
        logger.error("engine step failed; failing its requests: %s: %s", type(exc).__name__, exc,
                     exc_info=not is_out_of_memory(exc))
        for request_id in self.engine.fail_last_step():
            self._finish(request_id, StepFailedError(f"the engine step running this request failed "
                                                     f"({type(exc).__name__}: {exc}); other requests continue"))

    def _die(self, exc: BaseException) -> None:
        error = exc if isinstance(exc, EngineDeadError) else EngineDeadError(f"engine failed: {type(exc).__name__}: {exc}")
        self.dead_error = error
        logger.critical("the engine died; failing every pending request", exc_info=exc)
        self._fail_everything(error)

    def _fail_everything(self, error: EngineDeadError) -> None:
        with self._lock:
            commands = list(self._inbox)
            self._inbox.clear()
            streams = list(self._streams.values())
            self._streams.clear()
            self._pending = 0
        for kind, payload in commands:
            future = payload.accepted if kind == "add" else payload[1] if kind == "call" else None
            if future is not None:
                _call_soon(future.get_loop(), _settle, future, error)
        for stream in streams:
            stream.push(error)
        self._deadlines.clear()

    def _stream(self, request_id: str) -> Optional[RequestStream]:
        with self._lock:
            return self._streams.get(request_id)

    def _forget(self, request_id: str) -> Optional[RequestStream]:
        self._deadlines.pop(request_id, None)
        with self._lock:
            return self._streams.pop(request_id, None)

    def _finish(self, request_id: str, error: BaseException) -> None:
        stream = self._forget(request_id)
        if stream is not None:
            stream.push(error)


def _deliver(batch: list[tuple[RequestStream, RequestOutput]]) -> None:
    for stream, output in batch:
        stream.put_now(output)

