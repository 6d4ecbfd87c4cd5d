"""Every body and Server-Sent Event the completions and chat endpoints send, shaped from engine outputs.

Owns the OpenAI layouts: whole bodies (from each prompt's final output), stream chunks (one per
choice of each engine delta, chat's opening role chunks, the closing usage chunk), `usage`, the
logprobs structures (OpenAI's completions and chat ones, vLLM's `prompt_logprobs`), echo, finish
and stop reasons, and the SSE framing. It reads the translated request (`EngineParams`), the
prompts and the outputs; counting what was sent and talking to the engine are the serving layer's.
"""

from __future__ import annotations

import json
import time
from abc import ABC, abstractmethod
from functools import lru_cache
from typing import Any, Callable, Mapping, Optional, Sequence

from llmctl.engine.outputs import CompletionOutput, RequestOutput
from llmctl.engine.tokenizer import IncrementalDetokenizer
from llmctl.server.chat_output import ChatOutput
from llmctl.server.protocol import EngineParams, Prompt

SSE_DONE = "data: [DONE]\n\n"
Choice = tuple[int, int]  # (prompt index, completion index)
LogprobEntry = dict[int, float]  # token id -> logprob: the engine's candidates at one position


def sse(event: dict[str, Any]) -> str:
    """One Server-Sent Event carrying `event` as JSON."""
    return f"data: {json.dumps(event, ensure_ascii=False)}\n\n"


def token_usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


class TokenTexts:
    """Token ids as the texts responses show (one served model's tokenizer; cached, as the same
    tokens recur in every logprobs entry)."""

    def __init__(self, tokenizer: Any, cache_size: int = 65536):
        self.tokenizer = tokenizer
        self.text = lru_cache(maxsize=cache_size)(self._decode_one)

    def _decode_one(self, token_id: int) -> str:
        if self.tokenizer is None:
            return f"<{token_id}>"
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def prompt_text(self, prompt: Prompt) -> str:
        """The text `echo` puts before a completion: as sent, or decoded from the ids sent."""
        if prompt.text is not None:
            return prompt.text
        return self.tokenizer.decode(prompt.token_ids) if self.tokenizer is not None else ""

    def prompt_offsets(self, token_ids: list[int]) -> list[int]:
        """Where each prompt token's text starts in the echoed text (a token that ends inside a
        multi-byte character starts where that character does)."""
        if self.tokenizer is None:
            return [0] * len(token_ids)
        detokenizer = IncrementalDetokenizer(self.tokenizer, [], skip_special_tokens=True)
        offsets = []
        for token_id in token_ids:
            offsets.append(len(detokenizer.text))
            detokenizer.add(token_id)
        return offsets


class ResponseShapes(ABC):
    """The shapes of one API request's responses, completions or chat (`shapes_for` picks)."""
    body_object = chunk_object = ""
    id_prefix = ""

    def __init__(self, texts: TokenTexts, params: EngineParams, prompts: Sequence[Prompt], base_id: str,
                 model: str):
        self.texts = texts
        self.params = params
        self.prompts = prompts
        self.response_id = self.id_prefix + base_id
        self.model = model
        self.created = int(time.time())

    def head(self, object_name: str) -> dict[str, Any]:
        return {"id": self.response_id, "object": object_name, "created": self.created, "model": self.model,
                "system_fingerprint": None}

    def opening_chunks(self) -> list[dict[str, Any]]:
        """Chunks a stream starts with, before any output."""
        return []

    @abstractmethod
    def chunk(self, p_index: int, completion: CompletionOutput, first: bool,
              prompt_logprobs: Optional[list[Optional[LogprobEntry]]]) -> dict[str, Any]:
        """The chunk of one choice's delta (`first`: the choice's first; `prompt_logprobs`: its prompt's)."""

    @abstractmethod
    def body(self, finals: Mapping[int, RequestOutput], usage: dict[str, int]) -> dict[str, Any]:
        """The whole response from each prompt's final output."""

    def stream_event(self, event: dict[str, Any], usage_so_far: Callable[[], dict[str, int]]) -> str:
        """`event` as SSE, with the `usage` field stream_options asks for (null but in the last chunk,
        or the usage so far with continuous_usage_stats)."""
        if self.params.include_usage:
            event["usage"] = usage_so_far() if self.params.continuous_usage else None
        return sse(event)

    def usage_event(self, usage: dict[str, int]) -> Optional[str]:
        """The stream's closing usage chunk, when stream_options.include_usage asks for it."""
        if not self.params.include_usage:
            return None
        return sse({**self.head(self.chunk_object), "choices": [], "usage": usage})


class CompletionShapes(ResponseShapes):
    body_object = chunk_object = "text_completion"
    id_prefix = "cmpl-"

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._text_offsets: dict[Choice, int] = {}  # each streamed choice's next token's text_offset

    def chunk(self, p_index: int, completion: CompletionOutput, first: bool,
              prompt_logprobs: Optional[list[Optional[LogprobEntry]]]) -> dict[str, Any]:
        params, prompt = self.params, self.prompts[p_index]
        echo = params.echo and first
        prefix = self.texts.prompt_text(prompt) if echo else ""
        logprobs = None
        if params.logprobs is not None:
            # text_offset counts from the start of the choice's text by token texts, as in the whole
            # body (a delta's text can hold back the bytes of a partial character)
            key = (p_index, completion.index)
            offset = self._text_offsets.get(key, len(prefix))
            self._text_offsets[key] = offset + sum(len(self.texts.text(t)) for t in completion.token_ids)
            logprobs = self._logprobs(prompt, prompt_logprobs, completion, echo, offset)
        reason = completion.finish_reason
        choice = {"index": p_index * params.n + completion.index, "text": prefix + completion.text,
                  "logprobs": logprobs, "finish_reason": reason,
                  "stop_reason": completion.stop_reason if reason else None}
        return {**self.head(self.chunk_object), "choices": [choice]}

    def body(self, finals: Mapping[int, RequestOutput], usage: dict[str, int]) -> dict[str, Any]:
        params = self.params
        choices = []
        for p_index, prompt in enumerate(self.prompts):
            final = finals[p_index]
            for completion in final.outputs:
                prefix = self.texts.prompt_text(prompt) if params.echo else ""
                choice = {
                    "index": p_index * params.n + completion.index, "text": prefix + completion.text,
                    "logprobs": (None if params.logprobs is None else
                                 self._logprobs(prompt, final.prompt_logprobs, completion, params.echo, len(prefix))),
                    "finish_reason": completion.finish_reason, "stop_reason": completion.stop_reason,
                }
                if params.prompt_logprobs is not None:
                    choice["prompt_logprobs"] = vllm_prompt_logprobs(self.texts, prompt, final.prompt_logprobs,
                                                                     params.prompt_logprobs,
                                                                     params.prompt_logprobs_width)
                choices.append(choice)
        return {**self.head(self.body_object), "choices": choices, "usage": usage}

    def _logprobs(self, prompt: Prompt, prompt_logprobs: Optional[list[Optional[LogprobEntry]]],
                  completion: CompletionOutput, echo: bool, offset: int) -> dict[str, list]:
        """A choice's `logprobs`: the echoed prompt's tokens first (the first `null`, as OpenAI and
        vLLM send them), then the generated ones; `text_offset`s index the choice's text."""
        generated = completion_logprobs(self.texts, completion.token_ids, completion.logprobs, offset)
        if not echo:
            return generated
        echoed = echo_logprobs(self.texts, prompt, prompt_logprobs, self.params.logprobs or 0)
        return {key: echoed[key] + generated[key] for key in generated}


class ChatShapes(ResponseShapes):
    body_object, chunk_object = "chat.completion", "chat.completion.chunk"
    id_prefix = "chatcmpl-"

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.output = ChatOutput(self.params.chat_output)  # reasoning and tool calls read from the text

    def opening_chunks(self) -> list[dict[str, Any]]:
        """One per choice, naming the role (as OpenAI's streams begin)."""
        return [self._chunk(index, {"role": "assistant", "content": "", "refusal": None}, None, None)
                for index in range(self.params.n)]

    def chunk(self, p_index: int, completion: CompletionOutput, first: bool,
              prompt_logprobs: Optional[list[Optional[LogprobEntry]]]) -> dict[str, Any]:
        delta, reason = self.output.delta(completion.index, completion.text, bool(completion.token_ids),
                                          completion.finish_reason)
        return self._chunk(completion.index, delta, self._logprobs(completion), reason)

    def _chunk(self, index: int, delta: dict, logprobs: Optional[dict], reason: Optional[str]) -> dict[str, Any]:
        return {**self.head(self.chunk_object),
                "choices": [{"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": reason}]}

    def body(self, finals: Mapping[int, RequestOutput], usage: dict[str, int]) -> dict[str, Any]:
        params, final = self.params, finals[0]
        choices = []
        for completion in final.outputs:
            message, reason = self.output.message(completion.text, completion.finish_reason)
            choices.append({"index": completion.index, "message": {"role": "assistant", **message, "refusal": None},
                            "logprobs": self._logprobs(completion), "finish_reason": reason,
                            "stop_reason": completion.stop_reason})
        response = {**self.head(self.body_object), "choices": choices, "usage": usage}
        if params.prompt_logprobs is not None:  # vLLM puts them beside the choices in chat
            response["prompt_logprobs"] = vllm_prompt_logprobs(self.texts, self.prompts[0], final.prompt_logprobs,
                                                               params.prompt_logprobs, params.prompt_logprobs_width)
        return response

    def _logprobs(self, completion: CompletionOutput) -> Optional[dict[str, list]]:
        if self.params.logprobs is None:
            return None
        return {"content": chat_logprobs(self.texts, completion.token_ids, completion.logprobs, self.params.logprobs)}


def shapes_for(params: EngineParams, texts: TokenTexts, prompts: Sequence[Prompt], base_id: str,
               model: str) -> ResponseShapes:
    """The shapes of a request's responses: chat's or completions'."""
    kind = ChatShapes if params.chat else CompletionShapes
    return kind(texts, params, prompts, base_id, model)


# ---- logprobs layouts ---------------------------------------------------------------------------------
def completion_logprobs(texts: TokenTexts, token_ids: list[int], entries: Optional[list[LogprobEntry]],
                        offset: int) -> dict[str, list]:
    """OpenAI's completions layout: parallel lists of tokens, their logprobs, all candidates, text offsets."""
    tokens, token_logprobs, top, offsets = [], [], [], []
    for token_id, entry in zip(token_ids, entries or []):
        text = texts.text(token_id)
        tokens.append(text)
        token_logprobs.append(entry.get(token_id))
        top.append({texts.text(t): lp for t, lp in sorted(entry.items(), key=lambda kv: -kv[1])})
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top, "text_offset": offsets}


def echo_logprobs(texts: TokenTexts, prompt: Prompt, entries: Optional[list[Optional[LogprobEntry]]],
                  top_n: int) -> dict[str, list]:
    """The completions layout for an echoed prompt: its top `top_n` candidates plus its own token
    (a position the engine did not score, the first, is `null`)."""
    tokens, token_logprobs, top = [], [], []
    for token_id, entry in zip(prompt.token_ids, entries or [None] * len(prompt.token_ids)):
        tokens.append(texts.text(token_id))
        token_logprobs.append(None if entry is None else entry[token_id])
        top.append(None if entry is None else {texts.text(t): lp for t, lp in _top(entry, token_id, top_n)})
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top,
            "text_offset": texts.prompt_offsets(prompt.token_ids)}


def chat_logprobs(texts: TokenTexts, token_ids: list[int], entries: Optional[list[LogprobEntry]],
                  k: int) -> list[dict[str, Any]]:
    """Chat's `logprobs.content`: per token its text, logprob and UTF-8 bytes, and its top `k` candidates."""
    content = []
    for token_id, entry in zip(token_ids, entries or []):
        ranked = sorted(entry.items(), key=lambda kv: -kv[1])[:k]
        content.append({**_token_logprob(texts, token_id, entry.get(token_id)),
                        "top_logprobs": [_token_logprob(texts, t, lp) for t, lp in ranked]})
    return content


def _token_logprob(texts: TokenTexts, token_id: int, logprob: Optional[float]) -> dict[str, Any]:
    text = texts.text(token_id)
    return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}


def vllm_prompt_logprobs(texts: TokenTexts, prompt: Prompt, entries: Optional[list[Optional[LogprobEntry]]],
                         top_n: int, width: int) -> list[Optional[dict]]:
    """vLLM's `prompt_logprobs`: per prompt token, {token id: {logprob, rank, decoded_token}} for
    the top `top_n` and the prompt's own token. The engine scored the top `width` candidates, so
    their ranks are exact; a prompt token outside them has `rank: null` (the rest is not ranked)."""
    result: list[Optional[dict]] = []
    for token_id, entry in zip(prompt.token_ids, entries or [None] * len(prompt.token_ids)):
        if entry is None:
            result.append(None)
            continue
        in_top = len(entry) <= width  # the entry is the top `width`, plus the prompt token when outside
        ranked = sorted(((t, lp) for t, lp in entry.items() if in_top or t != token_id), key=lambda kv: -kv[1])
        ranks = {t: i + 1 for i, (t, _) in enumerate(ranked)}
        kept = {**dict(ranked[:top_n]), token_id: entry[token_id]}
        result.append({str(t): {"logprob": lp, "rank": ranks.get(t), "decoded_token": texts.text(t)}
                       for t, lp in kept.items()})
    return result


def _top(entry: LogprobEntry, keep: int, n: int) -> list[tuple[int, float]]:
    """The `n` most likely candidates of a logprob entry, plus the token `keep` if it is not among them."""
    ranked = sorted(entry.items(), key=lambda kv: -kv[1])[:n]
    if all(token != keep for token, _ in ranked):
        ranked.append((keep, entry[keep]))
    return ranked
