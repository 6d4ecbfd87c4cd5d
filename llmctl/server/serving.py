"""The OpenAI completions and chat endpoints on top of `AsyncLLMEngine`.

Owns a request's path through the engine: tokenize its prompts, translate it once (`protocol.engine_params`),
submit one engine request per prompt (`n` samples each), and hand the outputs to `responses` for their
shape: a whole body from each request's final output, or Server-Sent Events, one per choice of each
engine delta, ending in `data: [DONE]`. A client that disconnects aborts its requests, so their KV
blocks are freed at the next step.
"""

from __future__ import annotations

import asyncio
import uuid
from dataclasses import dataclass, field, replace
from typing import Any, AsyncIterator, Optional, Union

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from llmctl.engine.async_engine import AsyncLLMEngine, RequestStream
from llmctl.engine.errors import EngineError
from llmctl.engine.outputs import PoolingRequestOutput, RequestOutput
from llmctl.engine.pooling import PoolingParams
from llmctl.engine.sampling_params import SamplingParams
from llmctl.server.embeddings import embedding_body
from llmctl.server.errors import APIError, ClientDisconnectedError, StreamStalledError, from_exception
from llmctl.server.metrics import ServerMetrics
from llmctl.server.middleware import AUDIT_KEY
from llmctl.server.protocol import (MAX_PROMPTS_PER_REQUEST, ChatCompletionRequest, CompletionRequest,
                                    DetokenizeRequest, EmbeddingRequest, EngineParams, Prompt, ServerLimits,
                                    TokenizeChatRequest, TokenizeCompletionRequest, check_fan_out, check_unsupported,
                                    engine_params, template_messages)
from llmctl.server.tool_calling import ChatFeatures, chat_output_spec, check_tool_choice, template_variables
from llmctl.server.responses import SSE_DONE, Choice, ResponseShapes, TokenTexts, shapes_for, sse, token_usage
from llmctl.server.text_filter import OutputFilter, RequestFilter

AnyRequest = Union[CompletionRequest, ChatCompletionRequest]


@dataclass
class _Job:
    """One API request: its engine streams (one per prompt) and what they brought so far."""
    params: EngineParams
    prompts: list[Prompt]
    streams: list[RequestStream]
    shapes: ResponseShapes
    sent_tokens: dict[Choice, int] = field(default_factory=dict)  # completion tokens put in chunks or the body
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

    def unfinished_choices(self) -> int:
        """Choices of the prompts whose request never finished (aborted: the client left, or it failed)."""
        return self.params.n * sum(i not in self.finals for i in range(len(self.streams)))

    def completion_tokens(self) -> int:
        return sum(self.sent_tokens.values())

    def usage(self) -> dict[str, int]:
        """Token counts so far: the whole job's once every request finished."""
        return token_usage(sum(len(p.token_ids) for p in self.prompts), self.completion_tokens())


class OpenAIServing:
    def __init__(self, engine: AsyncLLMEngine, model_name: str, max_output_tokens: int, metrics: ServerMetrics,
                 max_sequences_per_request: int = 256, stream_write_timeout_s: float = 60.0,
                 output_filter: Optional[OutputFilter] = None, chat_features: ChatFeatures = ChatFeatures()):
        self.engine = engine
        self.chat_features = chat_features
        self.output_filter = output_filter
        self.stream_write_timeout_s = stream_write_timeout_s
        self.model_name = model_name
        self.metrics = metrics
        self.model_info = engine.model_info
        self.tokenizer = self.model_info.tokenizer
        self.max_model_len = self.model_info.max_model_len
        self.limits = ServerLimits(self.max_model_len, max_output_tokens, self.model_info.vocab_size,
                                   max_sequences_per_request)
        self.token_texts = TokenTexts(self.tokenizer)

    # ---- entry points -----------------------------------------------------------------------------
    async def completions(self, body: CompletionRequest, request: Request):
        return await self._serve(body, request)

    async def chat(self, body: ChatCompletionRequest, request: Request):
        return await self._serve(body, request)

    async def _serve(self, body: AnyRequest, request: Request):
        self.check_model(body.model)
        check_unsupported(body)
        chat = isinstance(body, ChatCompletionRequest)
        if chat:
            check_tool_choice(body, self.chat_features)
        prompts = await self.tokenize(body)
        audit = request.scope.get(AUDIT_KEY, {})
        audit.update(model=self.model_name, user=body.user, stream=body.stream,
                     prompt_tokens=sum(len(p.token_ids) for p in prompts),
                     prompt=body.plain_messages() if chat else [p.text for p in prompts])
        params = engine_params(body, prompts, self.limits,
                               chat_output_spec(body, self.chat_features) if chat else None)
        # The engine id is always ours: a client's X-Request-Id is for logs and may repeat across clients.
        base_id = uuid.uuid4().hex
        shapes = shapes_for(params, self.token_texts, prompts, base_id, self.model_name)
        job = _Job(params, prompts, await self._submit(prompts, params.sampling, base_id, params.priority), shapes)
        if self.output_filter is not None:
            job.text_filter = self.output_filter.for_request(audit, choices=params.n, cumulative=False)  # deltas
        if params.stream:
            return _StallBoundedStream(self._sse(job, audit), self.stream_write_timeout_s,
                                       media_type="text/event-stream",
                                       headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        audit["completion_tokens"] = 0  # stays 0 if the client leaves before the body is sent
        await self._collect(job, request)
        audit["completion_tokens"] = job.completion_tokens()
        return JSONResponse(job.shapes.body(job.finals, job.usage()))

    def check_model(self, model: Optional[str]) -> None:
        """404 (OpenAI's `model_not_found`) unless `model` is None or the served name."""
        if model is not None and model != self.model_name:
            raise APIError(404, f"the model '{model}' does not exist; this server serves '{self.model_name}'",
                           param="model", code="model_not_found")

    # ---- prompts ----------------------------------------------------------------------------------
    async def tokenize(self, body: AnyRequest) -> list[Prompt]:
        """The request's prompts as token ids: the one tokenisation step. Text that cannot fit the
        context is refused by its length before any tokenising (tokenising megabytes costs seconds
        and gigabytes), and the tokenising runs in a worker thread (it releases the GIL), so the
        event loop keeps serving other requests meanwhile."""
        self._check_text_length(body)
        if isinstance(body, ChatCompletionRequest):
            return [await asyncio.to_thread(self._chat_prompt, body)]
        return await asyncio.to_thread(self._completion_prompts, body)

    def _check_text_length(self, body: Union[AnyRequest, TokenizeChatRequest, TokenizeCompletionRequest,
                                             EmbeddingRequest]) -> None:
        if self.tokenizer is None:
            return
        limit = self.max_model_len * self.tokenizer.max_chars_per_token
        if isinstance(body, (ChatCompletionRequest, TokenizeChatRequest)):
            texts = ["".join(m["content"] + m.get("name", "") for m in template_messages(body.messages))]
            param = "messages"
        elif isinstance(body, EmbeddingRequest):
            texts, param = [item for item in body.inputs() if isinstance(item, str)], "input"
        else:
            prompt = body.prompt
            texts, param = [prompt] if isinstance(prompt, str) else [p for p in prompt or [] if isinstance(p, str)], "prompt"
        longest = max((len(t) for t in texts), default=0)
        if longest > limit:
            subject = "messages have" if param == "messages" else f"{param} has"
            raise APIError(400, f"the {subject} {longest} characters, more than fit this model's context of "
                                f"{self.max_model_len} tokens (max_model_len; at most {limit} characters)",
                           param=param, code="context_length_exceeded")

    def _completion_prompts(self, body: CompletionRequest) -> list[Prompt]:
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

    def _document_start(self) -> Prompt:
        """`prompt: null`: OpenAI generates "as if from the beginning of a new document", i.e. from BOS."""
        bos = self.model_info.bos_token_id
        if bos is None:
            raise APIError(400, "prompt is null (start of a document), but this model's tokenizer has no BOS "
                                "token to start from: send a prompt", param="prompt")
        return Prompt("", [bos])

    def _prompt(self, item: Union[str, list[int]], add_special_tokens: bool = True) -> Prompt:
        if isinstance(item, str):
            if self.tokenizer is None:
                raise APIError(400, "this server has no tokenizer: send prompts as token ids", param="prompt")
            return Prompt(item, self.tokenizer.encode(item, add_special_tokens=add_special_tokens))
        return Prompt(None, list(item))  # empty prompts and ids outside the vocabulary: the engine refuses them

    def _chat_prompt(self, body: ChatCompletionRequest) -> Prompt:
        if self.tokenizer is None:
            raise APIError(400, "this server has no tokenizer, so it cannot render chat messages", param="messages")
        return Prompt(None, self.tokenizer.encode_chat(body.plain_messages(), body.add_generation_prompt,
                                                       **self._template_variables(body)))

    def _template_variables(self, body: Union[ChatCompletionRequest, TokenizeChatRequest]) -> dict[str, Any]:
        return template_variables(body, self.chat_features, self.tokenizer.chat_template_variables)

    # ---- vLLM's /tokenize and /detokenize --------------------------------------------------------------
    async def tokenize_endpoint(self, body: Union[TokenizeCompletionRequest, TokenizeChatRequest]) -> dict[str, Any]:
        """vLLM's answer: the prompt's token ids as a completion or chat request would submit them."""
        self.check_model(body.model)
        if self.tokenizer is None:
            raise APIError(400, "this server has no tokenizer", param="prompt")
        self._check_text_length(body)
        if isinstance(body, TokenizeChatRequest):
            body.check_unsupported()
            ids = await asyncio.to_thread(self.tokenizer.encode_chat, template_messages(body.messages),
                                          body.add_generation_prompt, **self._template_variables(body))
        else:
            ids = await asyncio.to_thread(self.tokenizer.encode, body.prompt, body.add_special_tokens)
        answer: dict[str, Any] = {"count": len(ids), "max_model_len": self.max_model_len, "tokens": ids,
                                  "token_strs": None}
        if body.return_token_strs:
            answer["token_strs"] = [self.token_texts.text(t) for t in ids]
        return answer

    async def detokenize_endpoint(self, body: DetokenizeRequest) -> dict[str, str]:
        self.check_model(body.model)
        if self.tokenizer is None:
            raise APIError(400, "this server has no tokenizer", param="tokens")
        vocab = self.model_info.vocab_size
        outside = next((t for t in body.tokens if not 0 <= t < vocab), None)
        if outside is not None:
            raise APIError(400, f"token id {outside} is not in this model's vocabulary [0, {vocab})", param="tokens")
        return {"prompt": self.tokenizer.decode(body.tokens, skip_special_tokens=False)}

    # ---- OpenAI's /v1/embeddings ----------------------------------------------------------------------
    async def embeddings(self, body: EmbeddingRequest, request: Request) -> JSONResponse:
        """One pooling request per input, batched by the engine with everything else; the body once all are in."""
        self.check_model(body.model)
        items = body.inputs()  # 1 to MAX_PROMPTS_PER_REQUEST of them (the body's schema)
        check_fan_out(1, len(items), self.limits.max_sequences_per_request, param="input")
        self._check_text_length(body)
        prompts = await asyncio.to_thread(lambda: [self._prompt(item, body.add_special_tokens) for item in items])
        too_long = next((i for i, p in enumerate(prompts) if len(p.token_ids) > self.max_model_len), None)
        if too_long is not None:
            raise APIError(400, f"input {too_long} has {len(prompts[too_long].token_ids)} tokens, but max_model_len "
                                f"is {self.max_model_len}", param="input", code="context_length_exceeded")
        audit = request.scope.get(AUDIT_KEY, {})
        audit.update(model=self.model_name, user=body.user, stream=False, completion_tokens=0,
                     prompt_tokens=sum(len(p.token_ids) for p in prompts), prompt=[p.text for p in prompts])
        params = PoolingParams(dimensions=body.dimensions, normalize=body.normalize)
        streams = await self._submit(prompts, [params] * len(prompts), uuid.uuid4().hex)
        finals: dict[int, PoolingRequestOutput] = {}

        async def gather() -> None:
            for index, stream in enumerate(streams):
                async for output in stream:  # one output each, when pooled
                    finals[index] = output
                    self.metrics.observe_finished(output, [0], ["stop"])

        try:
            await _unless_disconnected(gather(), request)
        finally:
            for stream in streams:
                stream.cancel()
            self.metrics.observe_aborted(len(streams) - len(finals))
        return JSONResponse(embedding_body([finals[i] for i in range(len(streams))], self.model_name,
                                           body.encoding_format))

    # ---- submission -------------------------------------------------------------------------------
    async def _submit(self, prompts: list[Prompt], params: list[Union[SamplingParams, PoolingParams]], base_id: str,
                      priority: int = 0) -> list[RequestStream]:
        """One engine request per prompt; if one cannot be added, those added before are aborted."""
        streams: list[RequestStream] = []
        try:
            for index, (prompt, request_params) in enumerate(zip(prompts, params)):
                request_id = f"{base_id}-{index}" if len(prompts) > 1 else base_id
                streams.append(await self.engine.add_request(request_id, prompt.token_ids, request_params,
                                                             priority=priority))
        except BaseException:
            for stream in streams:
                stream.cancel()
            raise
        return streams

    async def _outputs(self, job: _Job) -> AsyncIterator[tuple[int, RequestOutput]]:
        """(prompt index, output) from every stream of the job, as they come: deltas when streaming,
        else each request's one final output."""
        if len(job.streams) == 1:
            async for output in job.streams[0]:
                yield 0, self._note(job, 0, output)
            return
        queue: asyncio.Queue = asyncio.Queue(maxsize=1)  # a stalled reader's backlog stays in the streams (bounded)

        async def pump(index: int, stream: RequestStream) -> None:
            try:
                async for output in stream:
                    await queue.put((index, output, None))
            except Exception as exc:  # noqa: BLE001 - re-raised in the consumer
                await queue.put((index, None, exc))
            await queue.put((index, None, None))

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
            choices = [(index, c_index) for c_index in range(job.params.n)]
            self.metrics.observe_finished(output, [job.generated.get(c, 0) for c in choices],
                                          [job.finish_reasons.get(c) for c in choices])
        if job.params.scores_prompt_only:
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

        try:
            await _unless_disconnected(drain(), request)
        finally:
            job.cancel()
            self.metrics.observe_aborted(job.unfinished_choices())

    # ---- streaming --------------------------------------------------------------------------------
    async def _sse(self, job: _Job, audit: dict[str, Any]) -> AsyncIterator[str]:
        shapes = job.shapes
        try:
            for event in shapes.opening_chunks():
                yield shapes.stream_event(event, job.usage)
            async for p_index, output in self._outputs(job):
                for completion in output.outputs:  # a delta: only the choices with something new
                    first = job.send((p_index, completion.index), len(completion.token_ids))
                    event = shapes.chunk(p_index, completion, first, job.prompt_logprobs.get(p_index))
                    yield shapes.stream_event(event, job.usage)
            closing = shapes.usage_event(job.usage())
            if closing is not None:
                yield closing
        except EngineError as exc:
            yield sse(from_exception(exc).body())
        finally:
            job.cancel()
            # Count what reached the client, also when it went away mid-stream.
            audit["completion_tokens"] = job.completion_tokens()
            self.metrics.observe_cut_off(job.cut_off_tokens())
            self.metrics.observe_aborted(job.unfinished_choices())
        yield SSE_DONE


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


async def _unless_disconnected(work, request: Request) -> Any:
    """Await the coroutine `work`, or raise `ClientDisconnectedError` (cancelling it) if the client leaves first."""
    task = asyncio.create_task(work)
    watch = asyncio.create_task(_wait_for_disconnect(request))
    try:
        done, _ = await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
        if task not in done:
            raise ClientDisconnectedError()
        return task.result()
    finally:
        watch.cancel()
        task.cancel()


async def _wait_for_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return
