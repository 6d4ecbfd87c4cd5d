"""OpenAI request bodies (pydantic, strict types) and their one translation, `engine_params`.

Owns what a valid `/v1/completions` or `/v1/chat/completions` body is: OpenAI's fields, plus the
sampling extras vLLM accepts (`top_k`, `min_p`, `repetition_penalty`, `ignore_eos`, ...), and what
it means: `engine_params` turns a body and its tokenized prompts into one frozen `EngineParams`,
all the serving layer submits and the responses are shaped by.
As in OpenAI's API, `null` in an optional field means its default (the spec types them nullable
and SDKs send `None`), and a key the server does not know is refused ("Unrecognized request
argument"). Fields OpenAI or vLLM define but this server does not implement are declared, so
`null` passes, and any other value is refused with a 400 that names them (`check_unsupported`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from typing import Annotated, Any, Literal, Optional, Sequence, Union

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, field_validator, model_validator

from llmctl.engine.errors import InvalidRequestError
from llmctl.engine.sampling_params import RequestOutputKind, SamplingParams, StructuredOutputsParams
from llmctl.server.chat_output import ChatOutputSpec, needs_special_tokens
from llmctl.server.errors import APIError
from llmctl.server.tool_calling import tool_call_schema

MAX_N = 16
MAX_PROMPTS_PER_REQUEST = 256
MAX_STOP_SEQUENCES = 16


class _Body(BaseModel):
    # allow_inf_nan=False: 1e999 parses to inf, which no sampling field means.
    model_config = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False)

    @field_validator("*", mode="after")
    @classmethod
    def _whole_unicode(cls, value: Any) -> Any:
        """Refuse lone UTF-16 surrogates ("\\ud800" is legal JSON): no tokenizer, encoder or log accepts them."""
        if _has_lone_surrogate(value):
            raise ValueError("the text contains a lone UTF-16 surrogate, which is not valid Unicode")
        return value

    @model_validator(mode="before")
    @classmethod
    def _null_means_default(cls, data: Any) -> Any:
        """Drop explicit nulls of optional fields, so they take their defaults (OpenAI's nullable fields)."""
        if not isinstance(data, dict):
            return data
        return {key: value for key, value in data.items()
                if value is not None or key not in cls.model_fields or cls.model_fields[key].is_required()}


def _has_lone_surrogate(value: Any) -> bool:
    if isinstance(value, str):
        if value.isascii():
            return False
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return True
        return False
    if isinstance(value, dict):
        return any(_has_lone_surrogate(k) or _has_lone_surrogate(v) for k, v in value.items())
    if isinstance(value, (list, tuple)):
        return bool(value) and not isinstance(value[0], int) and any(_has_lone_surrogate(v) for v in value)
    return False  # numbers, and nested bodies (checked by their own validator)


class StreamOptions(_Body):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM: usage so far in every chunk (guidellm sends it)
    include_obfuscation: Optional[bool] = None


class JsonSchemaFormat(_Body):
    """OpenAI's response_format.json_schema (what `client.chat.completions.parse` sends for a pydantic model)."""
    name: str = Field(max_length=64)
    description: Optional[str] = None
    schema_: Union[dict[str, Any], bool, None] = Field(default=None, alias="schema")
    strict: Optional[bool] = None  # the schema is enforced either way


class ResponseFormat(_Body):
    type: str
    json_schema: Optional[JsonSchemaFormat] = None


class StructuredOutputsBody(_Body):
    """vLLM's `structured_outputs`: one of these constraints (engine's StructuredOutputsParams checks that)."""
    json_: Union[dict[str, Any], str, None] = Field(default=None, alias="json")
    regex: Optional[str] = None
    choice: Optional[list[str]] = None
    grammar: Optional[str] = None
    json_object: Optional[bool] = None


RESPONSE_FORMATS = ("text", "json_object", "json_schema")
# vLLM's older spellings of structured_outputs' fields
GUIDED_FIELDS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}


# Defined by OpenAI or vLLM, not implemented here: null or the value that means "off" passes
# (OpenAI's own default), anything else is refused naming the field. field -> (what it is, accepted values)
_UNSUPPORTED_COMMON = {
    "use_beam_search": ("beam search", (False,)),
    "length_penalty": ("beam search", (1.0, 1)),
    "allowed_token_ids": ("vLLM's allowed_token_ids", ()),
    "bad_words": ("vLLM's bad_words", ([],)),
    "truncate_prompt_tokens": ("vLLM's prompt truncation", ()),
    "spaces_between_special_tokens": ("vLLM's detokenizer option", (True,)),
    "guided_decoding_backend": ("vLLM's guided decoding (structured output)", ()),
    "guided_whitespace_pattern": ("vLLM's guided decoding (structured output)", ()),
    "structural_tag": ("vLLM's guided decoding (structured output)", ()),
    "logits_processors": ("vLLM's custom logits processors", ([],)),
    "return_tokens_as_token_ids": ("vLLM's token-id logprobs", (False,)),
    "return_token_ids": ("vLLM's token ids in responses", (False,)),
    "request_id": ("vLLM's client-chosen request id (send the X-Request-Id header)", ()),
    "cache_salt": ("vLLM's prefix-cache salt", ()),
    "kv_transfer_params": ("vLLM's disaggregated KV transfer", ()),
    "vllm_xargs": ("vLLM's extra arguments", ()),
    "mm_processor_kwargs": ("multimodal input", ()),
}
_UNSUPPORTED_COMPLETION = {
    **_UNSUPPORTED_COMMON,
    "prompt_embeds": ("vLLM's prompt embeddings", ()),
}
_UNSUPPORTED_CHAT = {
    **_UNSUPPORTED_COMMON,
    "audio": ("audio output", ()),
    "modalities": ("output modalities other than text", (["text"],)),
    "prediction": ("predicted outputs", ()),
    "moderation": ("moderation", ()),
    "web_search_options": ("web search", ()),
    "verbosity": ("verbosity", ()),
    "store": ("stored completions", (False,)),
    "service_tier": ("service tiers", ("auto", "default")),
    "prompt_cache_retention": ("prompt cache retention (the prefix cache is in memory only)", ("in_memory",)),
    "prompt_cache_options": ("prompt cache options", ()),
    "parallel_tool_calls": ("parallel_tool_calls false (every call the model writes is returned)", (True,)),
    "functions": ("function calling", ([],)),
    "function_call": ("function calling", ("none",)),
    "echo": ("vLLM's chat echo", (False,)),
    "continue_final_message": ("vLLM's continue_final_message", (False,)),
    "documents": ("vLLM's RAG documents", ()),
    "chat_template": ("a per-request chat template", ()),
    "add_special_tokens": ("vLLM's special tokens on top of the chat template", (False,)),
}


# Template variables a request's chat_template_kwargs may not override (and any `*_token`, which
# the tokenizer's config supplies).
_TEMPLATE_VARIABLES = {"messages", "add_generation_prompt", "tools", "documents"}



def unsupported_fields(request: type) -> dict[str, tuple[str, tuple]]:
    """For /openapi.json: the fields of a request body class this server refuses, each with what it
    is and the values that still pass (besides null)."""
    tables = {CompletionRequest: _UNSUPPORTED_COMPLETION, ChatCompletionRequest: _UNSUPPORTED_CHAT,
              TokenizeChatRequest: _UNSUPPORTED_TOKENIZE_CHAT}
    return dict(tables.get(request, {}))


class _SamplingFields(_Body):
    model: Optional[str] = None
    n: int = 1
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    stop: Union[str, list[str], None] = None
    seed: Optional[int] = None
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: Optional[dict[str, float]] = None
    user: Optional[str] = Field(default=None, max_length=256)
    # Identifiers and hints with no effect on the output (OpenAI's); accepted.
    metadata: Optional[dict[str, str]] = None
    safety_identifier: Optional[str] = Field(default=None, max_length=256)
    prompt_cache_key: Optional[str] = None
    # Extras accepted as vLLM does.
    top_k: Optional[int] = None
    min_p: Optional[float] = None
    repetition_penalty: Optional[float] = None
    ignore_eos: bool = False
    min_tokens: int = 0
    stop_token_ids: Optional[list[int]] = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    priority: int = 0  # vLLM's: lower is scheduled earlier (needs --scheduling-policy priority unless 0)
    # Structured outputs: at most one of response_format (json_object, json_schema), structured_outputs, guided_*.
    response_format: Optional[ResponseFormat] = None
    structured_outputs: Optional[StructuredOutputsBody] = None
    guided_json: Union[dict[str, Any], str, None] = None
    guided_regex: Optional[str] = None
    guided_choice: Optional[list[str]] = None
    guided_grammar: Optional[str] = None
    # Declared so null passes; any other value is refused (see _UNSUPPORTED_*).
    use_beam_search: Optional[Any] = None
    length_penalty: Optional[Any] = None
    allowed_token_ids: Optional[Any] = None
    bad_words: Optional[Any] = None
    truncate_prompt_tokens: Optional[Any] = None
    spaces_between_special_tokens: Optional[Any] = None
    guided_decoding_backend: Optional[Any] = None
    guided_whitespace_pattern: Optional[Any] = None
    structural_tag: Optional[Any] = None
    logits_processors: Optional[Any] = None
    return_tokens_as_token_ids: Optional[Any] = None
    return_token_ids: Optional[Any] = None
    request_id: Optional[Any] = None
    cache_salt: Optional[Any] = None
    kv_transfer_params: Optional[Any] = None
    vllm_xargs: Optional[Any] = None
    mm_processor_kwargs: Optional[Any] = None
    # The caller's API key caps max_tokens below the server's limit (set by `access.RequestPolicy`).
    _key_max_tokens: Optional[int] = PrivateAttr(default=None)

    def limit_max_tokens(self, cap: int) -> None:
        """Cap the tokens this request may generate (a default max_tokens resolves to at most `cap`)."""
        self._key_max_tokens = cap


class CompletionRequest(_SamplingFields):
    prompt: Union[str, list[int], list[Union[str, list[int]]], None]  # null: start a new document
    max_tokens: Optional[int] = 16
    logprobs: Optional[int] = None
    echo: bool = False
    best_of: Optional[int] = None
    suffix: Optional[str] = None
    prompt_embeds: Optional[Any] = None
    prompt_logprobs: Optional[int] = None  # vLLM: top-N log-probabilities of each prompt token
    add_special_tokens: bool = True  # vLLM: BOS (and friends) added to text prompts

    @property
    def scores_prompt_only(self) -> bool:
        """`echo` with `max_tokens: 0`: score the prompt, generate nothing (as vLLM accepts)."""
        return self.echo and self.max_tokens == 0


class TextPart(_Body):
    type: Literal["text"]
    text: str


class MediaPart(_Body):
    """A non-text content part: declared so it is refused by name (this server's models take text only)."""
    model_config = ConfigDict(strict=True, extra="allow")
    type: Literal["image_url", "input_image", "image", "input_audio", "audio_url", "video_url", "file",
                  "input_file"]


class ToolCallFunction(_Body):
    name: str
    arguments: str


class ToolCall(_Body):
    """A call of a replayed assistant message (OpenAI's shape; `index` as a stream's deltas carry it)."""
    id: Optional[str] = None
    type: Literal["function"] = "function"
    function: ToolCallFunction
    index: Optional[int] = None


class FunctionDefinition(_Body):
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.:-]+$")
    description: Optional[str] = None
    parameters: Optional[dict[str, Any]] = None
    strict: Optional[bool] = None


class ToolDefinition(_Body):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Body):
    name: str


class NamedToolChoice(_Body):
    type: Literal["function"]
    function: NamedFunction


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Union[str, list[Union[TextPart, MediaPart]], None] = None
    name: Optional[str] = None
    # What a client sends back when it replays an assistant message from a response.
    refusal: Optional[str] = None
    tool_calls: Optional[list[ToolCall]] = None
    function_call: Optional[Any] = None
    audio: Optional[Any] = None
    annotations: Optional[list[Any]] = None  # citations on a replayed response: no input to the model
    tool_call_id: Optional[str] = None


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: Optional[int] = None
    max_completion_tokens: Optional[int] = None
    logprobs: bool = False
    top_logprobs: Optional[int] = None
    tools: Optional[list[ToolDefinition]] = None
    add_generation_prompt: bool = True
    audio: Optional[Any] = None
    modalities: Optional[Any] = None
    prediction: Optional[Any] = None
    moderation: Optional[Any] = None
    web_search_options: Optional[Any] = None
    reasoning_effort: Optional[Literal["none", "minimal", "low", "medium", "high"]] = None
    verbosity: Optional[Any] = None
    store: Optional[Any] = None
    service_tier: Optional[Any] = None
    prompt_cache_retention: Optional[Any] = None
    prompt_cache_options: Optional[Any] = None
    tool_choice: Union[Literal["none", "auto", "required"], NamedToolChoice, None] = None
    parallel_tool_calls: Optional[Any] = None
    functions: Optional[Any] = None
    function_call: Optional[Any] = None
    echo: Optional[Any] = None
    continue_final_message: Optional[Any] = None
    documents: Optional[Any] = None
    chat_template: Optional[Any] = None
    chat_template_kwargs: Optional[dict[str, Any]] = None  # vLLM: extra template variables (enable_thinking)
    add_special_tokens: Optional[Any] = None
    prompt_logprobs: Optional[int] = None  # vLLM: top-N log-probabilities of each rendered prompt token

    def plain_messages(self) -> list[dict[str, Any]]:
        return template_messages(self.messages)


def template_messages(messages: Sequence[ChatMessage]) -> list[dict[str, Any]]:
    """Messages as chat templates read them (transformers' shape): role and text content, an
    assistant's `tool_calls` (arguments as objects), a tool result's `tool_call_id`."""
    from llmctl.server.tool_calling import template_tool_calls

    out = []
    for message in messages:
        content = message.content
        if isinstance(content, list):
            content = "".join(part.text for part in content if isinstance(part, TextPart))
        entry: dict[str, Any] = {"role": "system" if message.role == "developer" else message.role,
                                 "content": content or ""}
        if message.name:
            entry["name"] = message.name
        if message.tool_calls:
            entry["tool_calls"] = template_tool_calls(message.tool_calls)
        if message.tool_call_id is not None:
            entry["tool_call_id"] = message.tool_call_id
        out.append(entry)
    return out


def check_unsupported(body: Union[CompletionRequest, ChatCompletionRequest]) -> None:
    """Refuse features we do not implement instead of silently ignoring them."""
    if body.stream_options is not None and not body.stream:
        raise APIError(400, "stream_options is only allowed when stream is true", param="stream_options")
    if body.stream_options is not None and body.stream_options.include_obfuscation:
        raise APIError(400, "stream_options.include_obfuscation is not supported by this server",
                       param="stream_options")
    table = _UNSUPPORTED_COMPLETION if isinstance(body, CompletionRequest) else _UNSUPPORTED_CHAT
    refused = [name for name, (_, accepted) in table.items()
               if getattr(body, name) is not None and not _is_accepted(getattr(body, name), accepted)]
    if refused:
        what = "; ".join(f"{name} ({table[name][0]})" for name in refused)
        raise APIError(400, f"not supported by this server: {what}", param=refused[0], code="unsupported_parameter")
    if body.response_format is not None and body.response_format.type not in RESPONSE_FORMATS:
        raise APIError(400, f"response_format {body.response_format.type!r} is not supported "
                            f"({', '.join(RESPONSE_FORMATS)})", param="response_format")
    if isinstance(body, CompletionRequest):
        if body.suffix:
            raise APIError(400, "suffix (insertion) is not supported by this server", param="suffix")
        if body.best_of is not None and body.best_of != body.n:
            raise APIError(400, "best_of must equal n (beam search / best-of ranking is not supported)",
                           param="best_of")
    else:
        _check_messages(body.messages)
        check_template_kwargs(body.chat_template_kwargs)


def check_template_kwargs(kwargs: Optional[dict[str, Any]]) -> None:
    taken = sorted(k for k in kwargs or {} if k in _TEMPLATE_VARIABLES or k.endswith("_token"))
    if taken:
        raise APIError(400, f"chat_template_kwargs may not set {', '.join(taken)} (set by the request itself: "
                            "messages, tools, ...)", param="chat_template_kwargs")


def _check_messages(messages: Sequence[ChatMessage]) -> None:
    """Refuse message parts no model here reads: images, audio, files, and the deprecated function_call."""
    for index, message in enumerate(messages):
        if message.function_call is not None or message.audio is not None:
            raise APIError(400, "assistant messages with function_call (deprecated: send tool_calls) or audio are "
                                "not supported by this server", param=f"messages.{index}")
        for part in message.content if isinstance(message.content, list) else []:
            if isinstance(part, MediaPart):
                raise APIError(400, f"content parts of type {part.type!r} are not supported: this model takes text "
                                    "only", param=f"messages.{index}.content", code="unsupported_parameter")


def _is_accepted(value: Any, accepted: tuple) -> bool:
    """Whether `value` is one of the values that mean "off" (same type, so `1` is not `true`)."""
    return any(type(value) is type(option) and value == option for option in accepted)


@dataclass(frozen=True)
class Prompt:
    """One tokenized prompt: the ids the engine takes, and the text when the client sent text (echo)."""
    text: Optional[str]
    token_ids: list[int]


@dataclass(frozen=True)
class ServerLimits:
    """What a request is held to beyond its own fields: the model's and the server's limits."""
    max_model_len: int
    max_output_tokens: int  # --max-output-tokens
    vocab_size: int
    max_sequences_per_request: int  # --max-seqs-per-request: prompts x n


@dataclass(frozen=True)
class EngineParams:
    """A request translated once: what the serving layer submits, and what its responses show.
    A new request field is declared on the body and read in `engine_params`, into a field here."""
    chat: bool
    n: int
    priority: int
    sampling: tuple[SamplingParams, ...]  # one per prompt (max_tokens resolved against each prompt's length)
    stream: bool
    include_usage: bool  # stream_options.include_usage: a last chunk with the usage
    continuous_usage: bool  # vLLM's continuous_usage_stats: the usage so far in every chunk
    echo: bool  # completions: the prompt's text (and logprobs) before the generated ones
    scores_prompt_only: bool  # echo with max_tokens 0: the one sampled token is dropped
    logprobs: Optional[int]  # top-N candidates per generated token; None: no logprobs in the response
    prompt_logprobs: Optional[int]  # vLLM's prompt_logprobs: top-N per prompt token in the response
    prompt_logprobs_width: Optional[int]  # candidates the engine scores per prompt token (echo and prompt_logprobs)
    chat_output: Optional[ChatOutputSpec] = None  # chat: reasoning and tool calls read from the text (None: as is)


def engine_params(body: Union[CompletionRequest, ChatCompletionRequest], prompts: Sequence[Prompt],
                  limits: ServerLimits, chat_output: Optional[ChatOutputSpec] = None) -> EngineParams:
    """The request's `EngineParams`; a value the server refuses raises `APIError` or `InvalidRequestError`
    naming its field (the fan-out first, then per prompt its max_tokens and sampling values)."""
    check_fan_out(body.n, len(prompts), limits.max_sequences_per_request)
    sampling = tuple(_sampling_params(body, _resolve_max_tokens(body, len(prompt.token_ids), limits),
                                      limits.vocab_size) for prompt in prompts)
    sampling = _with_tool_grammar(body, sampling, chat_output)
    if needs_special_tokens(chat_output):  # the tool parser's marker is a special token (mistral's [TOOL_CALLS])
        sampling = tuple(replace(params, skip_special_tokens=False) for params in sampling)
    options = body.stream_options
    include_usage = options is not None and options.include_usage
    completion = isinstance(body, CompletionRequest)
    return EngineParams(
        chat=not completion, n=body.n, priority=body.priority, sampling=sampling, stream=body.stream,
        include_usage=include_usage, continuous_usage=include_usage and options.continuous_usage_stats,
        echo=completion and body.echo, scores_prompt_only=completion and body.scores_prompt_only,
        logprobs=_logprobs(body), prompt_logprobs=body.prompt_logprobs,
        prompt_logprobs_width=_prompt_logprobs_width(body), chat_output=chat_output,
    )


def check_fan_out(n: int, num_prompts: int, max_sequences: int, param: str = "n") -> None:
    """Refuse more than --max-seqs-per-request sequences (prompts, or embedding inputs, x n) in one request."""
    sequences = num_prompts * n
    if sequences > max_sequences:
        raise APIError(400, f"the request asks for {sequences} sequences ({num_prompts} prompts x n={n}); "
                            f"this server allows at most {max_sequences} per request "
                            "(--max-seqs-per-request)", param=param, code="too_many_sequences")


def requested_max_tokens(body: Union[CompletionRequest, ChatCompletionRequest]) -> Optional[int]:
    if isinstance(body, ChatCompletionRequest):
        return body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    return body.max_tokens


def _resolve_max_tokens(body: Union[CompletionRequest, ChatCompletionRequest], prompt_len: int,
                        limits: ServerLimits) -> int:
    """max_tokens after the server cap and the context length; errors name the limit hit."""
    asked = requested_max_tokens(body)
    max_model_len = limits.max_model_len
    cap = min(limits.max_output_tokens, body._key_max_tokens or limits.max_output_tokens)
    room = max_model_len - prompt_len
    chat_named = isinstance(body, ChatCompletionRequest) and body.max_completion_tokens is not None
    param = "max_completion_tokens" if chat_named else "max_tokens"
    if isinstance(body, CompletionRequest) and body.scores_prompt_only:
        return 0
    if asked is None:
        if room < 1:
            raise APIError(400, f"the prompt has {prompt_len} tokens, which leaves no room to generate in this "
                                f"model's context of {max_model_len} tokens", param="messages")
        return min(cap, room)
    if asked < 1:
        hint = " (0 only with echo: true, to score the prompt)" if asked == 0 and param == "max_tokens" else ""
        raise APIError(400, f"{param} must be at least 1, got {asked}{hint}", param=param)
    if asked > cap:
        raise APIError(400, f"{param} {asked} exceeds this server's limit of {cap} tokens per request "
                            f"(--max-output-tokens)", param=param)
    if prompt_len + asked > max_model_len:
        raise APIError(400, f"this model's maximum context length is {max_model_len} tokens, but the request "
                            f"asks for {prompt_len + asked} ({prompt_len} in the prompt, {asked} to generate); "
                            f"shorten the prompt or lower {param}", param=param)
    return asked


def _sampling_params(body: Union[CompletionRequest, ChatCompletionRequest], max_tokens: int,
                     vocab_size: int) -> SamplingParams:
    """The engine's `SamplingParams` for a request (value errors raise `InvalidRequestError`)."""
    if body.n > MAX_N:  # the server's cap; n >= 1 is SamplingParams' check
        raise APIError(400, f"n must be between 1 and {MAX_N}, got {body.n}", param="n")
    stops = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    if len(stops) > MAX_STOP_SEQUENCES:
        raise APIError(400, f"at most {MAX_STOP_SEQUENCES} stop sequences are allowed", param="stop")
    try:
        return _checked_sampling_params(body, max_tokens, vocab_size, stops)
    except InvalidRequestError as exc:  # SamplingParams checks the values; chat names logprobs otherwise
        if isinstance(body, ChatCompletionRequest) and exc.param == "logprobs":
            raise InvalidRequestError(f"top_logprobs {body.top_logprobs}: {exc}", param="top_logprobs") from None
        raise


def _checked_sampling_params(body: Union[CompletionRequest, ChatCompletionRequest], max_tokens: int,
                             vocab_size: int, stops: list[str]) -> SamplingParams:
    return SamplingParams(
        n=body.n,
        temperature=1.0 if body.temperature is None else body.temperature,
        top_p=1.0 if body.top_p is None else body.top_p,
        top_k=body.top_k or 0,
        min_p=body.min_p or 0.0,
        repetition_penalty=1.0 if body.repetition_penalty is None else body.repetition_penalty,
        presence_penalty=body.presence_penalty,
        frequency_penalty=body.frequency_penalty,
        seed=body.seed,
        max_tokens=max(max_tokens, 1),  # scoring only: one token is sampled and dropped, as in vLLM
        min_tokens=body.min_tokens,
        stop=stops,
        stop_token_ids=list(body.stop_token_ids or []),
        ignore_eos=body.ignore_eos,
        include_stop_str_in_output=body.include_stop_str_in_output,
        logprobs=_logprobs(body),
        prompt_logprobs=_prompt_logprobs_width(body),
        skip_special_tokens=body.skip_special_tokens,
        logits_processors=[_logit_bias(body.logit_bias, vocab_size)] if body.logit_bias else [],
        # A stream sends what is new each step; a body needs only the end.
        output_kind=RequestOutputKind.DELTA if body.stream else RequestOutputKind.FINAL_ONLY,
        structured_outputs=structured_outputs(body),
    )


def _with_tool_grammar(body: Union[CompletionRequest, ChatCompletionRequest], sampling: tuple[SamplingParams, ...],
                       chat_output: Optional[ChatOutputSpec]) -> tuple[SamplingParams, ...]:
    """tool_choice "required" or naming a function: the output held to `tool_call_schema` by the grammar engine."""
    if chat_output is None or not (chat_output.required_tool or chat_output.named_tool):
        return sampling
    if any(params.structured_outputs is not None for params in sampling):
        raise APIError(400, "tool_choice \"required\" or naming a function is already an output constraint: drop "
                            "response_format / structured_outputs / guided_*", param="tool_choice")
    tools = [tool.model_dump(exclude_none=True) for tool in body.tools]
    constraint = StructuredOutputsParams(json=tool_call_schema(tools, chat_output.named_tool))
    return tuple(replace(params, structured_outputs=constraint) for params in sampling)


def structured_outputs(body: Union[CompletionRequest, ChatCompletionRequest]) -> Optional[StructuredOutputsParams]:
    """The request's output constraint: response_format json_object / json_schema, structured_outputs, or the
    guided_* fields (at most one of these ways); errors name the field the request used."""
    given: list[tuple[str, dict[str, Any]]] = []
    response_format = body.response_format
    if response_format is not None and response_format.type != "text":
        given.append(("response_format", _response_format_spec(response_format)))
    if body.structured_outputs is not None:
        given.append(("structured_outputs", body.structured_outputs.model_dump(exclude_none=True, by_alias=True)))
    given.extend((name, {kind: getattr(body, name)}) for name, kind in GUIDED_FIELDS.items()
                 if getattr(body, name) is not None)
    if len(given) > 1:
        names = ", ".join(name for name, _ in given)
        raise APIError(400, f"give one output constraint, not several: {names}", param=given[1][0])
    if not given:
        return None
    param, spec = given[0]
    try:
        return StructuredOutputsParams(**spec)
    except InvalidRequestError as exc:
        message = str(exc) if str(exc).startswith(param) else f"{param}: {exc}"
        raise InvalidRequestError(message, param=param) from None


def _response_format_spec(response_format: ResponseFormat) -> dict[str, Any]:
    if response_format.type == "json_object":
        return {"json_object": True}
    schema = response_format.json_schema
    if schema is None or schema.schema_ is None:
        raise APIError(400, "response_format json_schema needs json_schema.schema (the JSON schema)",
                       param="response_format")
    if isinstance(schema.schema_, bool):  # true: any JSON value; false: nothing can match
        if not schema.schema_:
            raise APIError(400, "response_format json_schema.schema false admits no output", param="response_format")
        return {"json": {}}
    return {"json": schema.schema_}


def _logprobs(body: Union[CompletionRequest, ChatCompletionRequest]) -> Optional[int]:
    if isinstance(body, CompletionRequest):
        return body.logprobs
    if body.top_logprobs is not None and not body.logprobs:
        raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
    return (body.top_logprobs or 0) if body.logprobs else None


def _prompt_logprobs_width(body: Union[CompletionRequest, ChatCompletionRequest]) -> Optional[int]:
    """How many top candidates to score per prompt token: for `prompt_logprobs`, and for `echo` with
    `logprobs` (the echoed prompt's tokens get logprobs too, as in OpenAI's API)."""
    if body.prompt_logprobs is not None and body.stream:
        raise APIError(400, "prompt_logprobs are not available when stream is true (as in vLLM); "
                            "use echo with logprobs", param="prompt_logprobs")
    echoed = body.logprobs if isinstance(body, CompletionRequest) and body.echo else None
    wanted = [n for n in (body.prompt_logprobs, echoed) if n is not None]
    if not wanted:
        return None
    # The larger, so both are served; a negative one as it is, for SamplingParams to refuse.
    return min(wanted) if min(wanted) < 0 else max(wanted)


def _logit_bias(bias: dict[str, float], vocab_size: int):
    """A logits processor adding OpenAI's per-token bias (keys are token ids as strings)."""
    import torch

    ids, values = [], []
    for key, value in bias.items():
        # ASCII digits only: "--1" and "²" pass str.isdigit() after lstrip("-") but int() refuses them.
        if not re.fullmatch(r"[0-9]{1,12}", key) or not int(key) < vocab_size:
            raise APIError(400, f"logit_bias key {key!r} is not a token id in [0, {vocab_size})", param="logit_bias")
        if not -100.0 <= value <= 100.0:
            raise APIError(400, f"logit_bias values must be in [-100, 100], got {value}", param="logit_bias")
        ids.append(int(key))
        values.append(float(value))
    index, delta = torch.tensor(ids), torch.tensor(values)

    def apply(_output_ids: list[int], logits: "torch.Tensor") -> "torch.Tensor":
        return logits.index_add(0, index.to(logits.device), delta.to(logits.device, logits.dtype))

    return apply


# ---- vLLM's /tokenize and /detokenize ----------------------------------------------------------------
class TokenizeCompletionRequest(_Body):
    model: Optional[str] = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool = False


class TokenizeChatRequest(_Body):
    model: Optional[str] = None
    messages: list[ChatMessage] = Field(min_length=1)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    return_token_strs: bool = False
    tools: Optional[list[ToolDefinition]] = None
    chat_template: Optional[Any] = None
    chat_template_kwargs: Optional[dict[str, Any]] = None
    mm_processor_kwargs: Optional[Any] = None

    def check_unsupported(self) -> None:
        _check_messages(self.messages)
        for name, (_what, accepted) in _UNSUPPORTED_TOKENIZE_CHAT.items():
            value = getattr(self, name)
            if value is not None and not _is_accepted(value, accepted):
                raise APIError(400, f"{name} is not supported by this server", param=name,
                               code="unsupported_parameter")
        check_template_kwargs(self.chat_template_kwargs)


# vLLM's /tokenize fields for chat that this server refuses (field -> (what it is, accepted values)).
_UNSUPPORTED_TOKENIZE_CHAT = {
    "continue_final_message": ("vLLM's continue_final_message", (False,)),
    "add_special_tokens": ("vLLM's special tokens on top of the chat template", (False,)),
    "chat_template": ("a per-request chat template", ()),
    "mm_processor_kwargs": ("multimodal input", ()),
}


class DetokenizeRequest(_Body):
    model: Optional[str] = None
    tokens: list[int]


# ---- OpenAI's /v1/embeddings ------------------------------------------------------------------------------
_TokenIds = list[Annotated[int, Field(ge=0)]]


_Text = Annotated[str, Field(min_length=1)]  # an empty text has no token to embed (OpenAI refuses it too)


class EmbeddingRequest(_Body):
    """OpenAI's embeddings body, with vLLM's extras `normalize` and `add_special_tokens`; the bounds are in the
    schema so /openapi.json tells them."""
    model: Optional[str] = None
    input: Union[_Text, Annotated[list[_Text], Field(min_length=1, max_length=MAX_PROMPTS_PER_REQUEST)],
                 Annotated[_TokenIds, Field(min_length=1)],
                 Annotated[list[Annotated[_TokenIds, Field(min_length=1)]], Field(min_length=1,
                                                                                 max_length=MAX_PROMPTS_PER_REQUEST)]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Optional[Annotated[int, Field(ge=1)]] = None
    user: Optional[str] = None
    normalize: Optional[bool] = None
    add_special_tokens: bool = True

    def inputs(self) -> list[Union[str, list[int]]]:
        """One entry per embedding: a text or a list of token ids."""
        items = self.input
        if isinstance(items, str) or (items and all(isinstance(t, int) for t in items)):
            return [items]
        return list(items)
