"""The FastAPI application: routes, middleware stack and lifecycle for one served model.

Owns `ServerSettings` (validated in one place) and `build_app()`, which wires the engine, the
OpenAI handlers, metrics, the audit log, auth, limits and (when asked) the profiling endpoints.
The engine warms up in the background after the socket opens: `/health` answers 503 "starting"
until it is ready, so a load balancer only routes to a warm server.
"""

from __future__ import annotations

import asyncio
import logging
import platform
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional, Sequence, Union

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from llmctl.__about__ import __version__
from llmctl.engine.async_engine import AsyncLLMEngine
from llmctl.server.access import RequestPolicy, check_model_access, key_of
from llmctl.server.api_keys import KeyRing, load_key_file
from llmctl.server.concurrency import ConcurrencyLimit, ConcurrencyLimiter, ConcurrencySettings, controller_for
from llmctl.server.errors import APIError, install_error_handlers
from llmctl.server.json_body import ARRAY_LIMIT_KEY, StrictJSONRoute
from llmctl.server.metrics import ModelMetrics, ServerMetrics, endpoint_label
from llmctl.server.middleware import (AuditLog, BearerAuth, BodyGuard, DrainCutoff, InternalErrors, RateLimit, RateLimiter, RequestContext,
                                      audit_line, is_protected)
from llmctl.server.openapi import METRICS_CONTENT_TYPE, ServedFacts, install_openapi
from llmctl.server.profiler import TorchProfilerSession
from llmctl.server.protocol import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest, EmbeddingRequest,
                                    TokenizeChatRequest, TokenizeCompletionRequest)
from llmctl.server.replicas import ReplicaBalancer, replica_failure
from llmctl.server.routing import DEFAULT_FALLBACK_AT, DEFAULT_HYSTERESIS, FallbackPolicy, ModelRouter, Route, load_signal
from llmctl.server.serving import MAX_PROMPTS_PER_REQUEST, OpenAIServing
from llmctl.server.policy_files import PolicyFileError
from llmctl.server.text_filter import FilterCounters, OutputFilter, RuleSet, load_rules
from llmctl.server.tool_calling import ChatFeatures

logger = logging.getLogger(__name__)


@dataclass
class ServerSettings:
    served_model_name: str = "llmctl-default"
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: Optional[str] = None
    max_output_tokens: int = 1024
    max_body_bytes: int = 8 * 1024 * 1024
    rate_limit: Optional[str] = None
    allowed_origins: list[str] = field(default_factory=list)
    audit_log: Optional[Path] = None
    audit_log_prompts: bool = False
    shutdown_timeout_s: float = 30.0
    profile_dir: Optional[Path] = None
    # Failed authentications per client, on top of --rate-limit (key guessing is throttled even without it).
    auth_failure_limit: str = "10/minute"
    # Proxy addresses whose X-Forwarded-For / -Proto are believed; None: no forwarded header is.
    forwarded_allow_ips: Optional[str] = None
    timeout_headers_s: float = 10.0
    timeout_body_s: float = 60.0
    timeout_keep_alive_s: float = 5.0
    timeout_stream_write_s: float = 60.0
    limit_concurrency: Optional[int] = 1024
    # prompts x n per request: one request could otherwise fan out to 256 x 16 = 4,096 sequences.
    max_sequences_per_request: int = 256
    # Access and filtering (docs/serve.md): YAML files, loaded and checked by validate().
    api_keys: Optional[Path] = None
    output_filter: Optional[Path] = None
    input_filter: Optional[Path] = None
    key_ring: Optional[KeyRing] = field(default=None, init=False, repr=False)
    output_rules: Optional[RuleSet] = field(default=None, init=False, repr=False)
    input_rules: Optional[RuleSet] = field(default=None, init=False, repr=False)
    # --- fallback model and adaptive concurrency (docs/serve.md "Serving under load") ---
    fallback_served_model_name: Optional[str] = None  # set when a fallback engine is served
    fallback_at: float = DEFAULT_FALLBACK_AT
    fallback_hysteresis: float = DEFAULT_HYSTERESIS
    concurrency: Optional[ConcurrencySettings] = None  # None: no admission limit beyond the engine's queue
    # --- tool calling and reasoning (docs/serve.md "Tool calling and reasoning"; vLLM's flags) ---
    enable_auto_tool_choice: bool = False
    tool_call_parser: Optional[str] = None
    reasoning_parser: Optional[str] = None
    exclude_tools_when_tool_choice_none: bool = False

    @property
    def chat_features(self) -> ChatFeatures:
        return ChatFeatures(self.enable_auto_tool_choice, self.tool_call_parser, self.reasoning_parser,
                            self.exclude_tools_when_tool_choice_none)

    def validate(self) -> None:
        checks = [
            (bool(self.served_model_name.strip()), "--served-model-name must not be empty"),
            (0 <= self.port <= 65535, f"--port must be in [0, 65535], got {self.port}"),
            (self.max_output_tokens >= 1, "--max-output-tokens must be >= 1"),
            (self.max_body_bytes >= 1024, "--max-body-size must be at least 1024 bytes"),
            (self.shutdown_timeout_s >= 0, "--shutdown-timeout must be >= 0"),
            (self.api_key is None or len(self.api_key) >= 1, "--api-key must not be empty"),
            (self.timeout_headers_s > 0, "--timeout-headers must be > 0"),
            (self.timeout_body_s > 0, "--timeout-body must be > 0"),
            (self.timeout_keep_alive_s > 0, "--timeout-keep-alive must be > 0"),
            (self.timeout_stream_write_s > 0, "--timeout-stream-write must be > 0"),
            (self.limit_concurrency is None or self.limit_concurrency >= 1, "--limit-concurrency must be >= 1"),
            (self.max_sequences_per_request >= 1, "--max-seqs-per-request must be >= 1"),
            (self.forwarded_allow_ips is None or bool(self.forwarded_allow_ips.strip()),
             "--forwarded-allow-ips must not be empty"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)
        if self.rate_limit:
            RateLimit.parse(self.rate_limit)
        RateLimit.parse(self.auth_failure_limit)
        if self.audit_log_prompts and self.audit_log is None:
            raise ValueError("--audit-log-prompts needs --audit-log FILE")
        FallbackPolicy(self.fallback_at, self.fallback_hysteresis)
        if self.fallback_served_model_name is not None and (
                self.fallback_served_model_name.strip() in ("", self.served_model_name)):
            raise ValueError("the fallback model needs its own, non-empty served name "
                             "(--fallback-served-model-name differs from --served-model-name)")
        if self.concurrency is not None:
            self.concurrency.validate()
        self.chat_features.validate()
        self._load_access_files()

    def _load_access_files(self) -> None:
        if self.api_key and self.api_keys is not None:
            raise ValueError("pass --api-key (or --api-key-file) or --api-keys FILE, not both")
        try:
            self.key_ring = (load_key_file(self.api_keys) if self.api_keys is not None
                             else KeyRing.single(self.api_key) if self.api_key else None)
            self.output_rules = (load_rules(self.output_filter, "--output-filter", with_actions=True)
                                 if self.output_filter is not None else None)
            self.input_rules = (load_rules(self.input_filter, "--input-filter", with_actions=False)
                                if self.input_filter is not None else None)
        except PolicyFileError as exc:
            raise ValueError(str(exc)) from None


KNOWN_ENDPOINTS = {"/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics", "/version",
                   "/start_profile", "/stop_profile", "/tokenize", "/detokenize", "/v1/embeddings"}


def _load_of(engine: AsyncLLMEngine):
    return lambda stats, unseen=0: load_signal(stats, engine.max_waiting_requests, unseen)


@dataclass
class _Served:
    """One served model: its engine, its metrics view, its OpenAI handlers and its request policy."""
    engine: AsyncLLMEngine
    view: ModelMetrics
    serving: OpenAIServing
    policy: RequestPolicy


def _served(engine: AsyncLLMEngine, view: ModelMetrics, settings: ServerSettings,
            counters: FilterCounters) -> _Served:
    engine.add_step_listener(view.observe_step)
    output_filter = OutputFilter(settings.output_rules, counters) if settings.output_rules else None
    serving = OpenAIServing(engine, view.model_name, settings.max_output_tokens, view,  # type: ignore[arg-type]
                            settings.max_sequences_per_request, settings.timeout_stream_write_s,
                            output_filter=output_filter, chat_features=settings.chat_features)
    policy = RequestPolicy(view.model_name, tokenizer=serving.tokenizer, input_rules=settings.input_rules,
                           output_filtered=settings.output_rules is not None, counters=counters)
    return _Served(engine, view, serving, policy)


def _views(metrics: ServerMetrics, name: str, engines: list[AsyncLLMEngine],
           first_registered: bool) -> list[ModelMetrics]:
    """One metrics view per replica of the model `name` (replica 0's snapshot may be registered already)."""
    return [metrics.for_model(name) if index == 0 and first_registered
            else metrics.add_engine(name, engine.get_stats, lambda e=engine: e.is_healthy, _load_of(engine), index)
            for index, engine in enumerate(engines)]


def _models(replicas: list[AsyncLLMEngine], fallback_engine: Optional[AsyncLLMEngine], settings: ServerSettings,
            metrics: ServerMetrics) -> tuple[list[_Served], ModelRouter[ReplicaBalancer[_Served]]]:
    """The served engines (the primary's replicas first) and the router choosing between the models, each
    model a balancer over its replicas (the fallback: one)."""
    counters = FilterCounters.on(metrics.registry, settings.served_model_name)
    views = _views(metrics, settings.served_model_name, replicas, first_registered=True)
    primary = ReplicaBalancer(replicas, [_served(e, view, settings, counters) for e, view in zip(replicas, views)])
    served = list(primary.targets)
    fallback = None
    if fallback_engine is not None:
        view = _views(metrics, settings.fallback_served_model_name, [fallback_engine], first_registered=False)[0]
        served.append(_served(fallback_engine, view, settings, counters))
        fallback = (view.model_name, ReplicaBalancer([fallback_engine], served[-1:]))
    router = ModelRouter((settings.served_model_name, primary), primary.lowest_load,
                         fallback, FallbackPolicy(settings.fallback_at, settings.fallback_hysteresis))
    for replica in replicas:  # a request the primary's engine took stops counting as unseen load
        replica.add_submission_listener(router.handed_over)
    return served, router


def build_app(engine: Union[AsyncLLMEngine, Sequence[AsyncLLMEngine]], settings: ServerSettings, *,
              start_engine: bool = True, fallback_engine: Optional[AsyncLLMEngine] = None) -> FastAPI:
    """The ASGI app serving `engine` (a sequence: data-parallel replicas of it) and `fallback_engine`
    under load; engines warm up on startup unless already started."""
    settings.validate()
    if (fallback_engine is None) != (settings.fallback_served_model_name is None):
        raise ValueError("a fallback engine and settings.fallback_served_model_name go together")
    replicas = [engine] if isinstance(engine, AsyncLLMEngine) else list(engine)
    if len(replicas) > 1 and settings.profile_dir is not None:
        raise ValueError("--profile-dir with --data-parallel-size > 1 is not supported (a profile is of one engine)")
    engine = replicas[0]
    metrics = ServerMetrics(settings.served_model_name, engine.get_stats, lambda: engine.is_healthy, _load_of(engine),
                            engine_labelled=len(replicas) > 1)
    served, router = _models(replicas, fallback_engine, settings, metrics)
    engines = [model.engine for model in served]
    degraded = (metrics.track_fallback(router.primary_name, router.fallback_name, lambda: router.degraded)
                if router.fallback is not None else None)
    limiter = _limiter(settings.concurrency, metrics, served)
    audit = AuditLog(settings.audit_log, settings.audit_log_prompts) if settings.audit_log else None

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        warmups = [asyncio.create_task(asyncio.to_thread(e.start)) for e in engines] if start_engine else []
        try:
            yield
        finally:
            for warmup in warmups:
                if not warmup.done():
                    warmup.cancel()
            for served_engine in engines:
                await asyncio.to_thread(served_engine.shutdown)
            if audit is not None:
                audit.close()

    # No trailing-slash redirects: Starlette builds their Location from the client's Host header.
    app = FastAPI(title="llmctl", version=__version__, lifespan=lifespan, docs_url=None, redoc_url=None,
                  openapi_url="/openapi.json", redirect_slashes=False)
    app.router.route_class = StrictJSONRoute
    # A token prompt holds at most max_model_len ids, logit_bias at most a vocabulary's keys.
    limits = [MAX_PROMPTS_PER_REQUEST] + [n for e in engines for n in (e.model_info.max_model_len, e.model_info.vocab_size)]
    setattr(app.state, ARRAY_LIMIT_KEY, max(limits))
    install_error_handlers(app)
    primary = engines[0].model_info
    install_openapi(app, ServedFacts(
        settings.max_output_tokens, primary.vocab_size, primary.scheduling_policy == "priority",
        primary.tokenizer.chat_template_variables if primary.tokenizer is not None else None, primary.pooler_config,
        settings.max_sequences_per_request))
    _add_routes(app, replicas, engines, router, degraded, metrics, settings)

    def on_finished(record: dict[str, Any]) -> None:
        metrics.observe_http(endpoint_label(record["path"], KNOWN_ENDPOINTS), record["status"])
        if audit is not None and is_protected(record["path"]):
            audit.write(audit_line(record, settings.audit_log_prompts))

    # Added innermost first: a request passes RequestContext, CORS, the drain cut-off, the rate
    # limit, auth, the body guard, the concurrency limit (when set), then the catch of real bugs.
    # Nothing reads the body before the caller is counted and authenticated, and every refusal
    # passes back through CORS, so a browser can read why it failed.
    app.add_middleware(InternalErrors)
    if limiter is not None:  # inside the body guard and auth: slow uploads and refused callers hold no slot
        app.add_middleware(ConcurrencyLimit, limiter=limiter)
    app.add_middleware(BodyGuard, max_bytes=settings.max_body_bytes, timeout_s=settings.timeout_body_s)
    if settings.key_ring is not None:
        app.add_middleware(BearerAuth, keys=settings.key_ring, failure_limit=RateLimit.parse(settings.auth_failure_limit))
    if settings.rate_limit:
        app.add_middleware(RateLimiter, limit=RateLimit.parse(settings.rate_limit))
    app.add_middleware(DrainCutoff)
    if settings.allowed_origins:
        from fastapi.middleware.cors import CORSMiddleware

        app.add_middleware(CORSMiddleware, allow_origins=settings.allowed_origins, allow_methods=["GET", "POST"],
                           allow_headers=["Authorization", "Content-Type", "X-Request-Id"])
    app.add_middleware(RequestContext, on_finished=on_finished)
    return app


def _limiter(settings: Optional[ConcurrencySettings], metrics: ServerMetrics,
             served: list[_Served]) -> Optional[ConcurrencyLimiter]:
    """The admission limiter (None without --max-concurrency), fed each finished request's time to
    first token and its engine's load signal then."""
    if settings is None:
        return None
    limiter = ConcurrencyLimiter(controller_for(settings), settings.queue_size, settings.queue_timeout_s)
    limiter.on_rejected = metrics.track_concurrency(lambda: limiter.limit, lambda: limiter.in_flight,
                                                    lambda: limiter.queued).inc
    for model in served:
        def sample(output, engine=model.engine) -> None:
            if output.metrics.time_to_first_token is not None:
                limiter.controller.observe(output.metrics.time_to_first_token, _load_of(engine)(engine.get_stats()))
                limiter.wake()  # the limit may have risen
        model.view.finished_listeners.append(sample)
    return limiter


def _add_routes(app: FastAPI, replicas: list[AsyncLLMEngine], engines: list[AsyncLLMEngine],
                router: ModelRouter[ReplicaBalancer[_Served]], degraded, metrics: ServerMetrics,
                settings: ServerSettings) -> None:
    _add_completion_routes(app, router, degraded)
    _add_tokenize_routes(app, router)
    _add_embedding_routes(app, router)
    _add_model_routes(app, router)
    _add_status_routes(app, replicas, engines, metrics)
    if settings.profile_dir is not None:
        _add_profile_routes(app, engines[0], settings.profile_dir)


async def _on_route(route: Route[ReplicaBalancer[_Served]], body, request: Request,
                    endpoint: Callable[[OpenAIServing], Callable]):
    """`endpoint` of a replica of the routed model, on the body renamed to that model; the route released after."""
    try:
        serving = route.target.pick().serving
        return await endpoint(serving)(body.model_copy(update={"model": route.model}), request)
    finally:
        route.release()


def _add_completion_routes(app: FastAPI, router: ModelRouter[ReplicaBalancer[_Served]], degraded) -> None:
    async def routed(body, request: Request) -> Route[ReplicaBalancer[_Served]]:
        """Admit `body` by the policy of the model it names (an API key's permission is for that model),
        then route it once, before tokenising. Token-id prompts stay on the model they name: ids mean
        something in one vocabulary only."""
        named = router.fallback if body.model is not None and body.model == router.fallback_name else router.primary
        await named.targets[0].policy.admit(body, request)
        route = router.route(body.model, may_degrade=not _has_token_prompt(body))
        if route.degraded:
            degraded.inc()
        return route

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        return await _on_route(await routed(body, request), body, request, lambda serving: serving.completions)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        return await _on_route(await routed(body, request), body, request, lambda serving: serving.chat)


def _add_tokenize_routes(app: FastAPI, router: ModelRouter[ReplicaBalancer[_Served]]) -> None:
    def tokenizing(model: Optional[str], request: Request) -> OpenAIServing:
        """The serving whose tokenizer a /tokenize or /detokenize body names (ids mean something in one vocabulary)."""
        balancer = router.fallback if router.fallback is not None and model == router.fallback_name else router.primary
        served = balancer.targets[0]  # every replica of a model has its tokenizer
        served.serving.check_model(model)
        check_model_access(key_of(request), served.serving.model_name)
        return served.serving

    @app.post("/tokenize")
    async def tokenize(body: Union[TokenizeChatRequest, TokenizeCompletionRequest], request: Request):
        return await tokenizing(body.model, request).tokenize_endpoint(body)

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest, request: Request):
        return await tokenizing(body.model, request).detokenize_endpoint(body)


def _add_embedding_routes(app: FastAPI, router: ModelRouter[ReplicaBalancer[_Served]]) -> None:
    @app.post("/v1/embeddings")
    async def embeddings(body: EmbeddingRequest, request: Request):
        check_model_access(key_of(request), body.model or router.primary_name)
        route = router.route(body.model, may_degrade=False)  # another model's vectors live in another space
        return await _on_route(route, body, request, lambda serving: serving.embeddings)


def _add_model_routes(app: FastAPI, router: ModelRouter[ReplicaBalancer[_Served]]) -> None:
    created = int(time.time())
    servings = [balancer.targets[0].serving for balancer in (router.primary, router.fallback) if balancer is not None]
    model_cards = {serving.model_name: {"id": serving.model_name, "object": "model", "created": created,
                                        "owned_by": "llmctl", "max_model_len": serving.max_model_len}
                   for serving in servings}

    @app.get("/v1/models")
    async def models(request: Request):  # an API key sees the models it may use
        key = key_of(request)
        return {"object": "list", "data": [card for name, card in model_cards.items()
                                           if key is None or key.may_use(name)]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str, request: Request):
        router.check_model(model_id)
        check_model_access(key_of(request), model_id)
        return model_cards[model_id]


def _add_status_routes(app: FastAPI, replicas: list[AsyncLLMEngine], engines: list[AsyncLLMEngine],
                       metrics: ServerMetrics) -> None:
    @app.api_route("/health", methods=["GET", "HEAD"])
    async def health():
        failure = replica_failure(replicas) if len(replicas) > 1 else None
        if failure is not None:  # a replica lost is the server failing, not a smaller server
            return JSONResponse({"status": "unhealthy", "error": failure}, status_code=503)
        for engine in engines:
            if engine.dead_error is not None or not engine.is_healthy:
                return JSONResponse({"status": "unhealthy",
                                     "error": str(engine.dead_error or "engine thread stopped")}, status_code=503)
        if not all(engine.is_ready for engine in engines):
            return JSONResponse({"status": "starting"}, status_code=503, headers={"Retry-After": "2"})
        return {"status": "ok"}

    @app.get("/metrics")
    async def prometheus_metrics():
        return Response(metrics.render(), media_type=METRICS_CONTENT_TYPE)

    @app.get("/version")
    async def version():
        import torch

        return {"version": __version__, "python": platform.python_version(), "torch": torch.__version__}


def _has_token_prompt(body: Any) -> bool:
    prompt = getattr(body, "prompt", None)
    return isinstance(prompt, list) and any(not isinstance(item, str) for item in prompt)


def _add_profile_routes(app: FastAPI, engine: AsyncLLMEngine, folder: Path) -> None:
    session = TorchProfilerSession(folder)

    @app.post("/start_profile")
    async def start_profile():
        if session.active:
            raise APIError(409, "a profile is already being recorded; POST /stop_profile first", code="conflict")
        await engine.call_in_engine_thread(lambda _engine: session.start())
        return {"status": "started", "profile_dir": str(folder)}

    @app.post("/stop_profile")
    async def stop_profile():
        if not session.active:
            raise APIError(409, "no profile is being recorded; POST /start_profile first", code="conflict")
        path = await engine.call_in_engine_thread(lambda _engine: session.stop())
        return {"status": "stopped", "files": [str(path)]}
