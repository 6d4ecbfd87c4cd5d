"""`llmctl serve`: an OpenAI-compatible HTTP server for one model (the embedded one by default)."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Annotated, Optional

import typer

from llmctl import engine_options as eo
from llmctl.config import ConfigOption

SERVER = "Server"
SECURITY = "Security and limits"
ACCESS = "Access and filtering"
FALLBACK = "Fallback model"
CONCURRENCY = "Admission (concurrency limit)"
TOOLS = "Tool calling and reasoning"


def _o(*names: str, help: str, panel: str = SERVER, **kw):
    return typer.Option(*names, help=help, rich_help_panel=panel, **kw)


@eo.with_engine_flags()
def serve(
    model_tag: Annotated[Optional[str], typer.Argument(metavar="MODEL", show_default=False, help="The model (folder, .gguf file or cached ORG/NAME), as `vllm serve MODEL` takes it; same as -m/--model.")] = None,
    host: Annotated[str, _o("--host", help="Address to bind (127.0.0.1: this machine only; 0.0.0.0: all).")] = "127.0.0.1",
    port: Annotated[int, _o("--port", "-p", help="TCP port (0: pick a free one).")] = 8000,
    served_model_name: Annotated[Optional[str], _o("--served-model-name", help="Model id clients send (default: the model folder's name).")] = None,
    max_waiting_requests: Annotated[Optional[int], _o("--max-waiting-requests", help="Refuse new requests with 503 when this many are waiting (default: unbounded).")] = None,
    request_timeout: Annotated[Optional[float], _o("--request-timeout", help="Abort requests running longer than this many seconds.")] = None,
    shutdown_timeout: Annotated[float, _o("--shutdown-timeout", help="Seconds to let in-flight requests finish after SIGTERM/SIGINT.")] = 30.0,
    profile_dir: Annotated[Optional[Path], _o("--profile-dir", help="Enable POST /start_profile and /stop_profile, writing torch.profiler traces here.")] = None,
    api_key: Annotated[Optional[str], _o("--api-key", help="Require 'Authorization: Bearer KEY' on /v1 routes. Prefer LLMCTL_API_KEY or --api-key-file: a flag shows in ps.", panel=SECURITY)] = None,
    api_key_file: Annotated[Optional[Path], _o("--api-key-file", help="Read the API key from this file (first line).", panel=SECURITY)] = None,
    auth_failure_limit: Annotated[str, _o("--auth-failure-limit", help="Failed authentications allowed per client, e.g. 10/minute; then 429.", panel=SECURITY)] = "10/minute",
    forwarded_allow_ips: Annotated[Optional[str], _o("--forwarded-allow-ips", help="Comma-separated proxy IPs (or *) whose X-Forwarded-For/-Proto are trusted (default: none).", panel=SECURITY)] = None,
    limit_concurrency: Annotated[Optional[int], _o("--limit-concurrency", help="Most open connections; more get 503.", panel=SECURITY)] = 1024,
    max_seqs_per_request: Annotated[int, _o("--max-seqs-per-request", help="Most sequences (prompts x n) one request may ask for.", panel=SECURITY)] = 256,
    timeout_headers: Annotated[float, _o("--timeout-headers", help="Seconds a client has to send a request's headers.", panel=SECURITY)] = 10.0,
    timeout_body: Annotated[float, _o("--timeout-body", help="Seconds a client has to send a request's body (then 408).", panel=SECURITY)] = 60.0,
    timeout_stream_write: Annotated[float, _o("--timeout-stream-write", help="Seconds a stream may wait for its client to read; then it is cancelled and its request aborted.", panel=SECURITY)] = 60.0,
    max_stream_backlog_tokens: Annotated[int, _o("--max-stream-backlog-tokens", help="Streamed output (tokens, each logprob alternative counting as one) a request may hold that its client has not read; past it the request is aborted and its output dropped.", panel=SECURITY)] = 65536,
    timeout_keep_alive: Annotated[float, _o("--timeout-keep-alive", help="Seconds an idle keep-alive connection stays open.", panel=SECURITY)] = 5.0,
    max_output_tokens: Annotated[int, _o("--max-output-tokens", help="Largest max_tokens a request may ask for.", panel=SECURITY)] = 1024,
    rate_limit: Annotated[Optional[str], _o("--rate-limit", help="Per-client request rate, e.g. 100/minute (default: off).", panel=SECURITY)] = None,
    max_body_size: Annotated[int, _o("--max-body-size", help="Largest request body in bytes.", panel=SECURITY)] = 8 * 1024 * 1024,
    allowed_origins: Annotated[Optional[list[str]], _o("--allowed-origins", help="Enable CORS for this origin (repeatable; default: CORS off).", panel=SECURITY)] = None,
    audit_log: Annotated[Optional[Path], _o("--audit-log", help="Append one JSON line per API request to this file.", panel=SECURITY)] = None,
    audit_log_prompts: Annotated[bool, _o("--audit-log-prompts", help="Also record prompt text in the audit log.", panel=SECURITY)] = False,
    api_keys: Annotated[Optional[Path], _o("--api-keys", help="YAML file of API keys with attributes: models, max_tokens cap, rate limits, priority, prompt auditing (chmod 600).", panel=ACCESS)] = None,
    output_filter: Annotated[Optional[Path], _o("--output-filter", help="YAML rules (bounded regexes, word lists) that redact or block generated text, streamed or not.", panel=ACCESS)] = None,
    input_filter: Annotated[Optional[Path], _o("--input-filter", help="YAML rules whose match in a prompt refuses the request (400 naming the rule).", panel=ACCESS)] = None,
    # --- fallback model and concurrency limit (llmctl/server/routing.py, concurrency.py) ---
    fallback_model: Annotated[Optional[str], _o("--fallback-model", help="Smaller model folder that answers new requests while the primary's load signal is at --fallback-at or above.", panel=FALLBACK)] = None,
    fallback_tokenizer: Annotated[Optional[str], _o("--fallback-tokenizer", help="The fallback's tokenizer folder (default: its model folder).", panel=FALLBACK)] = None,
    fallback_served_model_name: Annotated[Optional[str], _o("--fallback-served-model-name", help="Model id of the fallback (default: its folder's name); requests naming it always go there.", panel=FALLBACK)] = None,
    fallback_at: Annotated[float, _o("--fallback-at", help="Load signal (0..1) from which new requests go to the fallback.", panel=FALLBACK)] = 0.8,
    fallback_hysteresis: Annotated[float, _o("--fallback-hysteresis", help="New requests return to the primary once its load is below --fallback-at minus this.", panel=FALLBACK)] = 0.1,
    fallback_kv_cache_memory: Annotated[Optional[int], _o("--fallback-kv-cache-memory", help="The fallback's KV cache size in bytes (CPU; default: sized like the primary's).", panel=FALLBACK)] = None,
    fallback_num_kv_blocks: Annotated[Optional[int], _o("--fallback-num-kv-blocks", help="The fallback's KV pool in blocks (overrides its memory settings).", panel=FALLBACK)] = None,
    fallback_gpu_memory_utilization: Annotated[float, _o("--fallback-gpu-memory-utilization", help="CUDA: fraction of the device the fallback (loaded first) may use; the primary gets the rest of --gpu-memory-utilization.", panel=FALLBACK)] = 0.2,
    # bench serve's --max-concurrency is the client's (LLMCTL_MAX_CONCURRENCY); this one is the server's.
    max_concurrency: Annotated[Optional[str], _o("--max-concurrency", help="Completion requests admitted at once: a number, or auto (an AIMD controller on time to first token and load); more get 503 or wait in --concurrency-queue.", panel=CONCURRENCY, envvar="LLMCTL_SERVE_MAX_CONCURRENCY")] = None,
    concurrency_min: Annotated[int, _o("--concurrency-min", help="auto: the lowest limit.", panel=CONCURRENCY)] = 1,
    concurrency_max: Annotated[int, _o("--concurrency-max", help="auto: the highest limit.", panel=CONCURRENCY)] = 256,
    concurrency_initial: Annotated[int, _o("--concurrency-initial", help="auto: the limit at start.", panel=CONCURRENCY)] = 16,
    concurrency_target_ttft: Annotated[float, _o("--concurrency-target-ttft", help="auto: seconds of p50 time to first token above which the limit shrinks.", panel=CONCURRENCY)] = 1.0,
    concurrency_target_load: Annotated[float, _o("--concurrency-target-load", help="auto: p50 load signal (0..1) above which the limit shrinks.", panel=CONCURRENCY)] = 0.95,
    concurrency_window: Annotated[float, _o("--concurrency-window", help="auto: seconds of finished requests per decision.", panel=CONCURRENCY)] = 1.0,
    concurrency_backoff: Annotated[float, _o("--concurrency-backoff", help="auto: factor the limit is multiplied by when a target is missed.", panel=CONCURRENCY)] = 0.9,
    concurrency_queue: Annotated[int, _o("--concurrency-queue", help="Requests that may wait for a slot (0: refuse at once with 503).", panel=CONCURRENCY)] = 0,
    concurrency_queue_timeout: Annotated[float, _o("--concurrency-queue-timeout", help="Seconds a queued request waits for a slot before its 503.", panel=CONCURRENCY)] = 5.0,
    enable_auto_tool_choice: Annotated[bool, _o("--enable-auto-tool-choice", help="Let the model call tools on its own (tool_choice \"auto\", the default with tools); needs --tool-call-parser.", panel=TOOLS)] = False,
    tool_call_parser: Annotated[Optional[str], _o("--tool-call-parser", help="How the model writes tool calls: hermes (Qwen2.5/3, Hermes), llama3_json, mistral.", panel=TOOLS)] = None,
    reasoning_parser: Annotated[Optional[str], _o("--reasoning-parser", help="Split <think>...</think> into reasoning_content: deepseek_r1, qwen3.", panel=TOOLS)] = None,
    exclude_tools_when_tool_choice_none: Annotated[bool, _o("--exclude-tools-when-tool-choice-none", help="With tool_choice \"none\", leave the tools out of the prompt (default: rendered, not called).", panel=TOOLS)] = False,
    engine_args: eo.EngineArgs = eo.FLAGS,
    config: Optional[Path] = ConfigOption,
) -> None:
    """Serve a model over the OpenAI API (/v1/completions, /v1/chat/completions, /metrics, /health)."""
    from llmctl.server.runner import run_server

    options = locals()
    engine_args = _with_model_tag(engine_args, model_tag)
    settings = _server_settings(options, engine_args)
    fallback = _checked_models(options, engine_args)
    raise typer.Exit(run_server(engine_args, settings, max_waiting_requests=max_waiting_requests,
                                request_timeout_s=request_timeout, fallback=fallback,
                                max_stream_backlog_tokens=max_stream_backlog_tokens))


def _with_model_tag(engine_args: "eo.EngineArgs", model_tag: Optional[str]) -> "eo.EngineArgs":
    """`llmctl serve MODEL` as `vllm serve MODEL`: the positional model, or -m/--model, not two different ones."""
    from llmctl.errors import UserError

    if model_tag is None:
        return engine_args
    if engine_args.model is not None and engine_args.model != model_tag:
        raise UserError(f"two models given: {model_tag!r} and --model {engine_args.model!r}; pass one")
    return dataclasses.replace(engine_args, model=model_tag)


def _server_settings(o: dict, engine_args: "eo.EngineArgs"):
    """The validated `ServerSettings` from the parsed flags (every refusal one line)."""
    from llmctl.errors import UserError
    from llmctl.server.app import ServerSettings

    if o["max_waiting_requests"] is not None and o["max_waiting_requests"] < 0:
        raise UserError("--max-waiting-requests must be >= 0")
    if o["request_timeout"] is not None and o["request_timeout"] <= 0:
        raise UserError("--request-timeout must be > 0")
    if o["max_stream_backlog_tokens"] < 1:
        raise UserError("--max-stream-backlog-tokens must be >= 1")
    api_key = o["api_key"]
    if o["api_key_file"] is not None:
        if api_key is not None:
            raise UserError("pass --api-key (or LLMCTL_API_KEY) or --api-key-file, not both")
        api_key = _read_key_file(o["api_key_file"])
    settings = ServerSettings(
        served_model_name=o["served_model_name"] or eo.default_model_name(engine_args.model),
        host=o["host"], port=o["port"], api_key=api_key, max_output_tokens=o["max_output_tokens"],
        max_body_bytes=o["max_body_size"], rate_limit=o["rate_limit"], allowed_origins=list(o["allowed_origins"] or []),
        audit_log=o["audit_log"], audit_log_prompts=o["audit_log_prompts"], shutdown_timeout_s=o["shutdown_timeout"],
        profile_dir=o["profile_dir"], auth_failure_limit=o["auth_failure_limit"],
        forwarded_allow_ips=o["forwarded_allow_ips"], limit_concurrency=o["limit_concurrency"],
        timeout_headers_s=o["timeout_headers"], timeout_body_s=o["timeout_body"],
        timeout_keep_alive_s=o["timeout_keep_alive"], max_sequences_per_request=o["max_seqs_per_request"],
        timeout_stream_write_s=o["timeout_stream_write"], api_keys=o["api_keys"], output_filter=o["output_filter"],
        input_filter=o["input_filter"], enable_auto_tool_choice=o["enable_auto_tool_choice"],
        tool_call_parser=o["tool_call_parser"], reasoning_parser=o["reasoning_parser"],
        exclude_tools_when_tool_choice_none=o["exclude_tools_when_tool_choice_none"], **_policy_settings(o),
    )
    try:
        settings.validate()
    except ValueError as exc:
        raise UserError(str(exc)) from None
    _check_key_priorities(settings, engine_args.scheduling_policy)
    return settings


def _checked_models(o: dict, engine_args: "eo.EngineArgs"):
    """The fallback model (or None), once the primary's and the fallback's tokenizers are known to exist."""
    from llmctl.errors import UserError

    if (folder := eo.missing_tokenizer(engine_args)) is not None:
        raise UserError(f"no tokenizer.json in {folder}: the server turns text into tokens and back; pass --tokenizer "
                        "FOLDER (with --load-format dummy, any tokenizer whose ids fit the config's vocab_size)")
    fallback = _fallback(o)
    if fallback is not None and (folder := eo.missing_tokenizer(fallback)) is not None:
        raise UserError(f"no tokenizer.json in {folder}: pass --fallback-tokenizer FOLDER")
    return fallback


def _policy_settings(options: dict) -> dict:
    """The fallback routing and concurrency-limit fields of `ServerSettings`, from the parsed flags."""
    from llmctl.server.concurrency import ConcurrencySettings

    concurrency = None
    if options["max_concurrency"] is not None:
        concurrency = ConcurrencySettings(
            max_concurrency=options["max_concurrency"].strip().lower(), min_limit=options["concurrency_min"],
            max_limit=options["concurrency_max"], initial_limit=options["concurrency_initial"],
            target_ttft_s=options["concurrency_target_ttft"], target_load=options["concurrency_target_load"],
            window_s=options["concurrency_window"], backoff=options["concurrency_backoff"],
            queue_size=options["concurrency_queue"], queue_timeout_s=options["concurrency_queue_timeout"])
    name = options["fallback_served_model_name"]
    if options["fallback_model"] is not None and name is None:
        name = Path(options["fallback_model"]).resolve().name
    elif options["fallback_model"] is None and name is not None:
        from llmctl.errors import UserError

        raise UserError("--fallback-served-model-name needs --fallback-model")
    return dict(fallback_served_model_name=name, fallback_at=options["fallback_at"],
                fallback_hysteresis=options["fallback_hysteresis"], concurrency=concurrency)


def _fallback(options: dict):
    from llmctl.errors import UserError
    from llmctl.server.runner import FallbackModel

    if options["fallback_model"] is None:
        given = [flag for flag in ("tokenizer", "kv_cache_memory", "num_kv_blocks")
                 if options[f"fallback_{flag}"] is not None]
        if given:
            raise UserError(f"--fallback-{given[0].replace('_', '-')} needs --fallback-model")
        return None
    return FallbackModel(options["fallback_model"], options["fallback_tokenizer"], options["fallback_kv_cache_memory"],
                         options["fallback_num_kv_blocks"], options["fallback_gpu_memory_utilization"])


def _read_key_file(path: Path) -> str:
    from llmctl.errors import UserError
    from llmctl.server.api_keys import KeyFileError, read_key_file

    try:
        return read_key_file(path)
    except KeyFileError as exc:
        raise UserError(str(exc)) from None


def _check_key_priorities(settings, policy: str) -> None:
    from llmctl.errors import UserError
    from llmctl.server.api_keys import KeyFileError

    try:
        if settings.key_ring is not None:
            settings.key_ring.check_scheduling_policy(policy)
    except KeyFileError as exc:
        raise UserError(str(exc)) from None
