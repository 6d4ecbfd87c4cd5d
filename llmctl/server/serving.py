"""The OpenAI completions and chat endpoints on top of `AsyncLLMEngine`.

Owns turning a validated request into engine requests (one per prompt, `n` samples each), and the
engine's outputs back into OpenAI responses: whole JSON bodies (from each request's one final
output), or Server-Sent Events (one chunk per choice of each engine delta), ending in `data: [DONE]`. A client that disconnects aborts its requests, so
their KV blocks are freed at the next step.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from dataclasses import dataclass, field, replace
from functools import lru_cache
from typing import Any, AsyncIterator, Optional, Union

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from llmctl.engine.async_engine import AsyncLLMEngine, RequestStream
from llmctl.engine.errors import EngineError
from llmctl.engine.outputs import CompletionOutput, RequestOutput
from llmctl.engine.tokenizer import IncrementalDetokenizer
from llmctl.server.errors import APIError, StreamStalledError, from_exception
from llmctl.server.metrics import ServerMetrics
from llmctl.server.middleware import AUDIT_KEY
from llmctl.server.text_filter import OutputFilter, RequestFilter
from llmctl.server.protocol import (ChatCompletionRequest, CompletionRequest, check_unsupported,
                                    prompt_logprobs_width, resolve_max_tokens, sampling_params)

MAX_PROMPTS_PER_REQUEST = 256
AnyRequest = Union[CompletionRequest, ChatCompletionRequest]


@dataclass
class _Prompt:
    text: Optional[str]
    token_ids: list[int]


Choice = tuple[int, int]  # (prompt index, completion index)


@dataclass
class _Job:
    """One API request: its engine streams (one per prompt) and what they brought so far."""
    response_id: str
    body: AnyRequest
    prompts: list[_Prompt]
    streams: list[RequestStream]
    created: int = field(default_factory=lambda: int(time.time()))
    sent_tokens: dict[Choice, int] = field(default_factory=dict)  # completion tokens put in chunks or the body
    text_offsets: dict[Choice, int] = field(default_factory=dict)  # next token's text_offset
    generated: dict[Choice, int] = field(default_factory=dict)  # tokens the engine made (with a scoring one)
    finish_reasons: dict[Choice, str] = field(default_factory=dict)
    prompt_logprobs: dict[int, list] = field(default_factory=dict)  # per prompt, from its first delta
    finals: dict[int, RequestOutput] = field(default_factory=dict)  # per prompt: its final output
    text_filter: Optional[RequestFilter] = None  # --output-filter: every output passes it first

    def cancel(self) -> None:
        for stream in self.streams:
            stream.cancel()

    def send(self, choice: Choice, num_tokens: int) -> bool:
        """Count tokens going to the client; True the first time this choice sends."""
        first = choice not in self.sent_tokens
        self.sent_tokens[choice] = self.sent_tokens.get(choice, 0) + num_tokens
        return first

    def cut_off_tokens(self) -> int:
        """Tokens sent for prompts whose request never finished (the client left)."""
        return sum(n for (p_index, _), n in self.sent_tokens.items() if p_index not in self.finals)

    def usage(self) -> dict[str, int]:
        """Token counts so far: the whole job's once every request finished."""
        prompt = sum(len(p.token_ids) for p in self.prompts)
        completion = sum(self.sent_tokens.values())
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


class OpenAIServing:
    def __init__(self, engine: AsyncLLMEngine, model_name: str, max_output_tokens: int, metrics: ServerMetrics,
                 max_sequences_per_request: int = 256, stream_write_timeout_s: float = 60.0,
                 output_filter: Optional[OutputFilter] = None):
        self.engine = engine
        self.output_filter = output_filter
        self.stream_write_timeout_s = stream_write_timeout_s
        self.max_sequences_per_request = max_sequences_per_request
        self.model_name = model_name
        self.max_output_tokens = max_output_tokens
        self.metrics = metrics
        self.model_info = engine.model_info
        self.tokenizer = self.model_info.tokenizer
        self.max_model_len = self.model_info.max_model_len
        self._token_text = lru_cache(maxsize=65536)(self._decode_one)

    # ---- entry points -----------------------------------------------------------------------------
    async def completions(self, body: CompletionRequest, request: Request):
        self.check_model(body.model)
        check_unsupported(body)
        return await self._serve(body, request, await self.tokenize(body), chat=False)

    async def chat(self, body: ChatCompletionRequest, request: Request):
        self.check_model(body.model)
        check_unsupported(body)
        return await self._serve(body, request, await self.tokenize(body), chat=True)

    async def _serve(self, body: AnyRequest, request: Request, prompts: list[_Prompt], chat: bool):
        audit = request.scope.get(AUDIT_KEY, {})
        audit.update(model=self.model_name, user=body.user, stream=body.stream,
                     prompt_tokens=sum(len(p.token_ids) for p in prompts),
                     prompt=[p.text for p in prompts] if not chat else body.plain_messages())
        self._check_fan_out(body, prompts)
        # The engine id is always ours: a client's X-Request-Id is for logs and may repeat across clients.
        job = await self._submit(body, prompts, uuid.uuid4().hex, chat)
        if self.output_filter is not None:
            job.text_filter = self.output_filter.for_request(audit, choices=body.n, cumulative=False)  # deltas
        if body.stream:
            events = self._chat_events(job) if chat else self._completion_events(job)
            return _StallBoundedStream(self._sse(job, events, audit), self.stream_write_timeout_s,
                                       media_type="text/event-stream",
                                       headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        audit["completion_tokens"] = 0  # stays 0 if the client leaves before the body is sent
        await self._collect(job, request)
        audit["completion_tokens"] = job.usage()["completion_tokens"]
        return JSONResponse(self._chat_body(job) if chat else self._completion_body(job))

    def _check_fan_out(self, body: AnyRequest, prompts: list[_Prompt]) -> None:
        sequences = len(prompts) * body.n
        if sequences > self.max_sequences_per_request:
            raise APIError(400, f"the request asks for {sequences} sequences ({len(prompts)} prompts x n={body.n}); "
                                f"this server allows at most {self.max_sequences_per_request} per request "
                                "(--max-seqs-per-request)", param="n", code="too_many_sequences")

    def check_model(self, model: Optional[str]) -> None:
        """404 (OpenAI's `model_not_found`) unless `model` is None or the served name."""
        if model is not None and model != self.model_name:
            raise APIError(404, f"the model '{model}' does not exist; this server serves '{self.model_name}'",
                           param="model", code="model_not_found")

    # ---- prompts ----------------------------------------------------------------------------------
    async def tokenize(self, body: AnyRequest) -> list[_Prompt]:
        """The request's prompts as token ids: the one tokenisation step. Text that cannot fit the
        context is refused by its length before any tokenising (a 7 MB prompt used to take seconds
        and 2 GB to refuse), and the tokenising itself runs in a worker thread (it releases the GIL),
        so the event loop keeps serving other requests meanwhile."""
        self._check_text_length(body)
        if isinstance(body, ChatCompletionRequest):
            return [await asyncio.to_thread(self._chat_prompt, body)]
        return await asyncio.to_thread(self._completion_prompts, body)

    def _check_text_length(self, body: AnyRequest) -> None:
        if self.tokenizer is None:
            return
        limit = self.max_model_len * self.tokenizer.max_chars_per_token
        if isinstance(body, ChatCompletionRequest):
            texts, param = ["".join(m["content"] + m.get("name", "") for m in body.plain_messages())], "messages"
        else:
            prompt = body.prompt
            texts, param = [prompt] if isinstance(prompt, str) else [p for p in prompt or [] if isinstance(p, str)], "prompt"
        longest = max((len(t) for t in texts), default=0)
        if longest > limit:
            raise APIError(400, f"the {'messages have' if param == 'messages' else 'prompt has'} {longest} characters, "
                                f"more than fit this model's context of {self.max_model_len} tokens (at most "
                                f"{limit} characters)", param=param, code="context_length_exceeded")
    def _completion_prompts(self, body: CompletionRequest) -> list[_Prompt]:
        prompt = body.prompt
        if prompt is None:
            return [self._document_start()]
        if isinstance(prompt, str):
            items: list[Union[str, list[int]]] = [prompt]
        elif prompt and all(isinstance(t, int) for t in prompt):
            items = [prompt]  # one prompt of token ids
        else:
            items = list(prompt)
        if not items:
            raise APIError(400, "prompt must not be empty", param="prompt")
        if len(items) > MAX_PROMPTS_PER_REQUEST:
            raise APIError(400, f"at most {MAX_PROMPTS_PER_REQUEST} prompts per request", param="prompt")
        return [self._prompt(item, body.add_special_tokens) for item in items]

    def _document_start(self) -> _Prompt:
        """`prompt: null`: OpenAI generates "as if from the beginning of a new document", i.e. from BOS."""
        bos = self.model_info.bos_token_id
        if bos is None:
            raise APIError(400, "prompt is null (start of a document), but this model's tokenizer has no BOS "
                                "token to start from: send a prompt", param="prompt")
        return _Prompt("", [bos])

    def _prompt(self, item: Union[str, list[int]], add_special_tokens: bool = True) -> _Prompt:
        if isinstance(item, str):
            if self.tokenizer is None:
                raise APIError(400, "this server has no tokenizer: send prompts as token ids", param="prompt")
            return _Prompt(item, self.tokenizer.encode(item, add_special_tokens=add_special_tokens))
        return _Prompt(None, list(item))  # empty prompts and ids outside the vocabulary: the engine refuses them

    def _chat_prompt(self, body: ChatCompletionRequest) -> _Prompt:
        if self.tokenizer is None:
            raise APIError(400, "this server has no tokenizer, so it cannot render chat messages", param="messages")
        messages = body.plain_messages()
        ids = self.tokenizer.encode_chat(messages, body.add_generation_prompt, **(body.chat_template_kwargs or {}))
        return _Prompt(None, ids)

    # ---- submission -------------------------------------------------------------------------------
    async def _submit(self, body: AnyRequest, prompts: list[_Prompt], base_id: str, chat: bool) -> _Job:
        params = []
        for prompt in prompts:
            max_tokens = resolve_max_tokens(body, len(prompt.token_ids), self.max_model_len, self.max_output_tokens)
            params.append(sampling_params(body, max_tokens, self.model_info.vocab_size))
        job = _Job(("chatcmpl-" if chat else "cmpl-") + base_id, body, prompts, [])
        try:
            for index, (prompt, sp) in enumerate(zip(prompts, params)):
                request_id = f"{base_id}-{index}" if len(prompts) > 1 else base_id
                job.streams.append(await self.engine.add_request(request_id, prompt.token_ids, sp,
                                                                 priority=body.priority))
        except BaseException:
            job.cancel()
            raise
        return job

    async def _outputs(self, job: _Job) -> AsyncIterator[tuple[int, RequestOutput]]:
        """(prompt index, output) from every stream of the job, as they come: deltas when streaming,
        else each request's one final output."""
        if len(job.streams) == 1:
            async for output in job.streams[0]:
                yield 0, self._note(job, 0, output)
            return
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(index: int, stream: RequestStream) -> None:
            try:
                async for output in stream:
                    queue.put_nowait((index, output, None))
            except Exception as exc:  # noqa: BLE001 - re-raised in the consumer
                queue.put_nowait((index, None, exc))
            queue.put_nowait((index, None, None))

        tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(job.streams)]
        try:
            remaining = len(tasks)
            while remaining:
                index, output, error = await queue.get()
                if error is not None:
                    raise error
                if output is None:
                    remaining -= 1
                    continue
                yield index, self._note(job, index, output)
        finally:
            for task in tasks:
                task.cancel()

    def _note(self, job: _Job, index: int, output: RequestOutput) -> RequestOutput:
        """Keep what later outputs do not repeat: token counts and finish reasons for the metrics,
        the prompt logprobs (a stream's first delta has them), the final output."""
        for completion in output.outputs:
            choice = (index, completion.index)
            job.generated[choice] = job.generated.get(choice, 0) + len(completion.token_ids)
        if job.text_filter is not None:  # the one place outputs are filtered: streamed or not
            output = job.text_filter.apply(index, output, job.streams[index].cancel)
        for completion in output.outputs:
            if completion.finish_reason is not None:
                job.finish_reasons[(index, completion.index)] = completion.finish_reason
        if output.prompt_logprobs is not None:
            job.prompt_logprobs.setdefault(index, output.prompt_logprobs)
        if output.finished:
            choices = [(index, c_index) for c_index in range(job.body.n)]
            self.metrics.observe_finished(output, [job.generated.get(c, 0) for c in choices],
                                          [job.finish_reasons.get(c) for c in choices])
        if isinstance(job.body, CompletionRequest) and job.body.scores_prompt_only:
            output = _without_generation(output)
        if output.finished:
            job.finals[index] = output
        return output

    async def _collect(self, job: _Job, request: Request) -> None:
        """Wait for every output, aborting the job if the client goes away first."""
        async def drain() -> None:
            async for index, output in self._outputs(job):  # one final output per prompt (FINAL_ONLY)
                for completion in output.outputs:
                    job.send((index, completion.index), len(completion.token_ids))

        work = asyncio.create_task(drain())
        watch = asyncio.create_task(_wait_for_disconnect(request))
        try:
            done, _ = await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
            if work not in done:
                raise asyncio.CancelledError("client disconnected")
            work.result()
        finally:
            watch.cancel()
            work.cancel()
            job.cancel()

    # ---- non-streaming bodies ---------------------------------------------------------------------
    def _completion_body(self, job: _Job) -> dict[str, Any]:
        body: CompletionRequest = job.body  # type: ignore[assignment]
        choices = []
        for p_index, prompt in enumerate(job.prompts):
            final = job.finals[p_index]
            for completion in final.outputs:
                prefix = self._echo_text(prompt) if body.echo else ""
                choice = {
                    "index": p_index * body.n + completion.index, "text": prefix + completion.text,
                    "logprobs": self._choice_logprobs(body, prompt, final.prompt_logprobs, completion.token_ids,
                                                      completion.logprobs, body.echo, len(prefix)),
                    "finish_reason": completion.finish_reason, "stop_reason": completion.stop_reason,
                }
                if body.prompt_logprobs is not None:
                    choice["prompt_logprobs"] = self._vllm_prompt_logprobs(prompt, final, body.prompt_logprobs,
                                                                           prompt_logprobs_width(body))
                choices.append(choice)
        return {"id": job.response_id, "object": "text_completion", "created": job.created,
                "model": self.model_name, "system_fingerprint": None, "choices": choices, "usage": job.usage()}

    def _chat_body(self, job: _Job) -> dict[str, Any]:
        body: ChatCompletionRequest = job.body  # type: ignore[assignment]
        choices = []
        for completion in job.finals[0].outputs:
            choices.append({
                "index": completion.index,
                "message": {"role": "assistant", "content": completion.text, "refusal": None},
                "logprobs": {"content": self._chat_logprobs(completion.token_ids, completion.logprobs,
                                                            body.top_logprobs or 0)} if body.logprobs else None,
                "finish_reason": completion.finish_reason, "stop_reason": completion.stop_reason,
            })
        response = {"id": job.response_id, "object": "chat.completion", "created": job.created,
                    "model": self.model_name, "system_fingerprint": None, "choices": choices, "usage": job.usage()}
        if body.prompt_logprobs is not None:  # vLLM puts them beside the choices in chat
            response["prompt_logprobs"] = self._vllm_prompt_logprobs(job.prompts[0], job.finals[0],
                                                                     body.prompt_logprobs, prompt_logprobs_width(body))
        return response

    # ---- streaming --------------------------------------------------------------------------------
    async def _sse(self, job: _Job, events: AsyncIterator[dict[str, Any]], audit: dict[str, Any]) -> AsyncIterator[str]:
        options = job.body.stream_options
        include_usage = bool(options and options.include_usage)
        continuous = include_usage and bool(options.continuous_usage_stats)  # vLLM: usage in every chunk
        try:
            async for event in events:
                if include_usage:
                    event["usage"] = job.usage() if continuous else None
                yield _data(event)
            if include_usage:
                yield _data({"id": job.response_id, "object": _chunk_object(job), "created": job.created,
                             "model": self.model_name, "system_fingerprint": None, "choices": [],
                             "usage": job.usage()})
        except EngineError as exc:
            yield _data(from_exception(exc).body())
        finally:
            job.cancel()
            # Count what reached the client, also when it went away mid-stream.
            audit["completion_tokens"] = job.usage()["completion_tokens"]
            self.metrics.observe_cut_off(job.cut_off_tokens())
        yield "data: [DONE]\n\n"

    async def _completion_events(self, job: _Job) -> AsyncIterator[dict[str, Any]]:
        async for p_index, output in self._outputs(job):
            for completion in output.outputs:  # a delta: only the choices with something new
                choice = self._completion_chunk_choice(job, p_index, completion)
                reason = completion.finish_reason
                choice.update(finish_reason=reason, stop_reason=completion.stop_reason if reason else None)
                yield {"id": job.response_id, "object": "text_completion", "created": job.created,
                       "model": self.model_name, "system_fingerprint": None, "choices": [choice]}

    def _completion_chunk_choice(self, job: _Job, p_index: int, completion: CompletionOutput) -> dict:
        body: CompletionRequest = job.body  # type: ignore[assignment]
        prompt = job.prompts[p_index]
        ids = completion.token_ids
        first = job.send((p_index, completion.index), len(ids))
        echo = self._echo_text(prompt) if body.echo and first else ""
        # text_offset counts from the start of the choice's text, by token texts as in the
        # non-streamed body (a delta can hold back bytes of a partial character)
        key = (p_index, completion.index)
        offset = job.text_offsets.get(key, len(echo))
        job.text_offsets[key] = offset + sum(len(self._token_text(t)) for t in ids)
        logprobs = self._choice_logprobs(body, prompt, job.prompt_logprobs.get(p_index), ids, completion.logprobs,
                                         body.echo and first, offset)
        return {"index": p_index * body.n + completion.index, "text": echo + completion.text, "logprobs": logprobs}

    async def _chat_events(self, job: _Job) -> AsyncIterator[dict[str, Any]]:
        body: ChatCompletionRequest = job.body  # type: ignore[assignment]
        for index in range(body.n):
            yield self._chat_chunk(job, index, {"role": "assistant", "content": "", "refusal": None}, None, None)
        async for _, output in self._outputs(job):
            for completion in output.outputs:  # a delta: only the choices with something new
                ids, text = completion.token_ids, completion.text
                job.send((0, completion.index), len(ids))
                logprobs = ({"content": self._chat_logprobs(ids, completion.logprobs, body.top_logprobs or 0)}
                            if body.logprobs else None)
                yield self._chat_chunk(job, completion.index, {"content": text} if text or ids else {}, logprobs,
                                       completion.finish_reason)

    def _chat_chunk(self, job: _Job, index: int, delta: dict, logprobs: Optional[dict], reason: Optional[str]) -> dict:
        return {"id": job.response_id, "object": "chat.completion.chunk", "created": job.created,
                "model": self.model_name, "system_fingerprint": None,
                "choices": [{"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": reason}]}

    # ---- logprobs ---------------------------------------------------------------------------------
    def _decode_one(self, token_id: int) -> str:
        if self.tokenizer is None:
            return f"<{token_id}>"
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def _echo_text(self, prompt: _Prompt) -> str:
        if prompt.text is not None:
            return prompt.text
        return self.tokenizer.decode(prompt.token_ids) if self.tokenizer is not None else ""

    def _choice_logprobs(self, body: CompletionRequest, prompt: _Prompt,
                         prompt_logprobs: Optional[list[Optional[dict[int, float]]]], token_ids: list[int],
                         entries: Optional[list[dict[int, float]]], echo: bool, offset: int) -> Optional[dict]:
        """A completion choice's `logprobs`: the echoed prompt's tokens first (the first `null`, as
        OpenAI and vLLM send them), then the generated ones; `text_offset`s index the choice's text."""
        if body.logprobs is None:
            return None
        generated = self._completion_logprobs(token_ids, entries, offset)
        if not echo:
            return generated
        echoed = self._echo_logprobs(prompt, prompt_logprobs, body.logprobs)
        return {key: echoed[key] + generated[key] for key in generated}

    def _echo_logprobs(self, prompt: _Prompt, entries: Optional[list[Optional[dict[int, float]]]],
                       top_n: int) -> dict[str, list]:
        tokens, token_logprobs, top = [], [], []
        for token_id, entry in zip(prompt.token_ids, entries or [None] * len(prompt.token_ids)):
            tokens.append(self._token_text(token_id))
            token_logprobs.append(None if entry is None else entry[token_id])
            top.append(None if entry is None else {self._token_text(t): lp for t, lp in _top(entry, token_id, top_n)})
        return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top,
                "text_offset": self._prompt_offsets(prompt.token_ids)}

    def _prompt_offsets(self, token_ids: list[int]) -> list[int]:
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

    def _vllm_prompt_logprobs(self, prompt: _Prompt, output: RequestOutput, top_n: int,
                              width: int) -> list[Optional[dict]]:
        """vLLM's `prompt_logprobs`: per prompt token, {token id: {logprob, rank, decoded_token}} for
        the top `top_n` and the prompt's own token. The engine scored the top `width` candidates, so
        their ranks are exact; a prompt token outside them has `rank: null` (the rest is not ranked)."""
        result: list[Optional[dict]] = []
        for token_id, entry in zip(prompt.token_ids, output.prompt_logprobs or [None] * len(prompt.token_ids)):
            if entry is None:
                result.append(None)
                continue
            in_top = len(entry) <= width  # the entry is the top `width`, plus the prompt token when outside
            ranked = sorted(((t, lp) for t, lp in entry.items() if in_top or t != token_id), key=lambda kv: -kv[1])
            ranks = {t: i + 1 for i, (t, _) in enumerate(ranked)}
            kept = {**dict(ranked[:top_n]), token_id: entry[token_id]}
            result.append({str(t): {"logprob": lp, "rank": ranks.get(t), "decoded_token": self._token_text(t)}
                           for t, lp in kept.items()})
        return result

    def _completion_logprobs(self, token_ids: list[int], entries: Optional[list[dict[int, float]]],
                             offset: int) -> dict[str, Any]:
        tokens, token_logprobs, top, offsets = [], [], [], []
        for token_id, entry in zip(token_ids, entries or []):
            text = self._token_text(token_id)
            tokens.append(text)
            token_logprobs.append(entry.get(token_id))
            top.append({self._token_text(t): lp for t, lp in sorted(entry.items(), key=lambda kv: -kv[1])})
            offsets.append(offset)
            offset += len(text)
        return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top, "text_offset": offsets}

    def _chat_logprobs(self, token_ids: list[int], entries: Optional[list[dict[int, float]]], k: int) -> list[dict]:
        content = []
        for token_id, entry in zip(token_ids, entries or []):
            ranked = sorted(entry.items(), key=lambda kv: -kv[1])[:k]
            content.append({**self._token_logprob(token_id, entry.get(token_id)),
                            "top_logprobs": [self._token_logprob(t, lp) for t, lp in ranked]})
        return content

    def _token_logprob(self, token_id: int, logprob: Optional[float]) -> dict[str, Any]:
        text = self._token_text(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}


def _top(entry: dict[int, float], keep: int, n: int) -> list[tuple[int, float]]:
    """The `n` most likely candidates of a logprob entry, plus the token `keep` if it is not among them."""
    ranked = sorted(entry.items(), key=lambda kv: -kv[1])[:n]
    if all(token != keep for token, _ in ranked):
        ranked.append((keep, entry[keep]))
    return ranked


def _without_generation(output: RequestOutput) -> RequestOutput:
    """The output of a scoring-only request (`echo` + `max_tokens: 0`): the one token the engine had
    to sample is dropped, as vLLM does."""
    hidden = [replace(c, text="", token_ids=[], logprobs=None if c.logprobs is None else [],
                      cumulative_logprob=None if c.cumulative_logprob is None else 0.0) for c in output.outputs]
    return replace(output, outputs=hidden)


class _StallBoundedStream(StreamingResponse):
    """SSE whose every write may wait at most `stall_s` for the client to read: a reader that
    stopped reading has its stream cancelled and its requests aborted (their KV blocks freed),
    instead of holding them for as long as it keeps the connection open."""

    def __init__(self, content: AsyncIterator[str], stall_s: float, **kwargs: Any):
        super().__init__(content, **kwargs)
        self.stall_s = stall_s

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        async def bounded_send(message: dict) -> None:
            try:
                await asyncio.wait_for(send(message), self.stall_s)
            except asyncio.TimeoutError:
                raise StreamStalledError(f"the client read nothing for {self.stall_s:g} s") from None

        try:
            await super().__call__(scope, receive, bounded_send)
        except StreamStalledError:
            await self.body_iterator.aclose()  # its cleanup now, not at garbage collection: abort, audit
            raise


async def _wait_for_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


def _chunk_object(job: _Job) -> str:
    return "chat.completion.chunk" if isinstance(job.body, ChatCompletionRequest) else "text_completion"


def _data(event: dict[str, Any]) -> str:
    return f"data: {json.dumps(event, ensure_ascii=False)}\n\n"
