"""`llmctl serve`: an OpenAI-compatible HTTP server for one model (the embedded one by default)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from llmctl import engine_options as eo
from llmctl.config import ConfigOption

SERVER = "Server"
SECURITY = "Security and limits"
ACCESS = "Access and filtering"


def _o(*names: str, help: str, panel: str = SERVER, **kw):
    return typer.Option(*names, help=help, rich_help_panel=panel, **kw)


@eo.with_engine_flags()
def serve(
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
    engine_args: eo.EngineArgs = eo.FLAGS,
    config: Optional[Path] = ConfigOption,
) -> None:
    """Serve a model over the OpenAI API (/v1/completions, /v1/chat/completions, /metrics, /health)."""
    from llmctl.errors import UserError
    from llmctl.server.app import ServerSettings
    from llmctl.server.runner import run_server

    if max_waiting_requests is not None and max_waiting_requests < 0:
        raise UserError("--max-waiting-requests must be >= 0")
    if request_timeout is not None and request_timeout <= 0:
        raise UserError("--request-timeout must be > 0")
    if api_key_file is not None:
        if api_key is not None:
            raise UserError("pass --api-key (or LLMCTL_API_KEY) or --api-key-file, not both")
        api_key = _read_key_file(api_key_file)
    settings = ServerSettings(
        served_model_name=served_model_name or (Path(engine_args.model).resolve().name if engine_args.model else eo.EMBEDDED_MODEL_ID),
        host=host, port=port, api_key=api_key, max_output_tokens=max_output_tokens, max_body_bytes=max_body_size,
        rate_limit=rate_limit, allowed_origins=list(allowed_origins or []), audit_log=audit_log,
        audit_log_prompts=audit_log_prompts, shutdown_timeout_s=shutdown_timeout, profile_dir=profile_dir,
        auth_failure_limit=auth_failure_limit, forwarded_allow_ips=forwarded_allow_ips,
        limit_concurrency=limit_concurrency, timeout_headers_s=timeout_headers, timeout_body_s=timeout_body,
        timeout_keep_alive_s=timeout_keep_alive, max_sequences_per_request=max_seqs_per_request,
        timeout_stream_write_s=timeout_stream_write, api_keys=api_keys, output_filter=output_filter,
        input_filter=input_filter,
    )
    try:
        settings.validate()
    except ValueError as exc:
        raise UserError(str(exc)) from None
    _check_key_priorities(settings, engine_args.scheduling_policy)
    if (folder := eo.missing_tokenizer(engine_args)) is not None:
        raise UserError(f"no tokenizer.json in {folder}: the server turns text into tokens and back; pass --tokenizer "
                        "FOLDER (with --load-format dummy, any tokenizer whose ids fit the config's vocab_size)")
    raise typer.Exit(run_server(engine_args, settings, max_waiting_requests=max_waiting_requests,
                                request_timeout_s=request_timeout))


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
