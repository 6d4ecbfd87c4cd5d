"""`LLM`: the offline API. Submit prompts, step the engine until they finish, return outputs in order."""

from __future__ import annotations

import copy
import itertools
from dataclasses import replace
from typing import Any, Callable, Optional, Sequence, Union

from llmctl.engine.args import EngineArgs
from llmctl.engine.errors import InvalidRequestError
from llmctl.engine.llm_engine import LLMEngine
from llmctl.engine.outputs import PoolingRequestOutput, RequestOutput
from llmctl.engine.pooling import PoolingParams
from llmctl.engine.sampling_params import RequestOutputKind, SamplingParams

PromptInput = Union[str, list[int], dict[str, Any]]


class LLM:
    """`LLM(model=FOLDER, **engine_args)`; `model=None` runs the embedded default model."""

    def __init__(self, model: Optional[str] = None, **engine_args: Any):
        self.engine = LLMEngine(EngineArgs.from_dict({"model": model, **engine_args}))
        self._ids = itertools.count()

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> "LLM":
        llm = cls.__new__(cls)
        llm.engine = LLMEngine(args)
        llm._ids = itertools.count()
        return llm

    def shutdown(self) -> None:
        """Stop the engine's other ranks and leave the process group (idempotent), so this process can build
        another parallel engine; the LLM runs no more requests."""
        self.engine.shutdown()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc_info) -> None:
        self.shutdown()

    def get_tokenizer(self):
        return self.engine.tokenizer

    def generate(
        self,
        prompts: Union[PromptInput, Sequence[PromptInput]],
        sampling_params: Union[None, SamplingParams, Sequence[SamplingParams]] = None,
        *,
        on_output: Optional[Callable[[int, RequestOutput], None]] = None,
    ) -> list[RequestOutput]:
        """Run every prompt as one continuously batched workload and return each one's whole output.
        `on_output(index, output)` sees each intermediate output as the params' `output_kind` asks
        (with `DELTA` only what is new), for streaming and progress display."""
        prompt_list = _as_prompt_list(prompts)
        params_list = _as_params_list(sampling_params, len(prompt_list))
        if on_output is None:  # nobody sees the intermediate outputs: the engine need not build them
            params_list = _final_only(params_list)
        return self._submit_and_run(prompt_list, params_list, on_output)

    def embed(
        self,
        prompts: Union[PromptInput, Sequence[PromptInput]],
        pooling_params: Union[None, PoolingParams, Sequence[PoolingParams]] = None,
        *,
        on_output: Optional[Callable[[int, PoolingRequestOutput], None]] = None,
    ) -> list[PoolingRequestOutput]:
        """Embed every prompt (vLLM's `LLM.embed`): one prefill each, batched, pooled as the model pools;
        `outputs.embedding` is the vector. `on_output(index, output)` sees each as it finishes."""
        prompt_list = _as_prompt_list(prompts)
        params_list = _as_params_list(pooling_params, len(prompt_list), PoolingParams, "pooling")
        return self._submit_and_run(prompt_list, params_list, on_output)

    def _submit_and_run(self, prompt_list: list[PromptInput], params_list: list, on_output) -> list:
        """Add every request, then step until all finished; on any failure the ones added are aborted."""
        ids = []
        try:
            for prompt, params in zip(prompt_list, params_list):
                request_id = f"llm-{next(self._ids)}"
                self.engine.add_request(request_id, _prompt_value(prompt), params)
                ids.append(request_id)
            deltas = {rid for rid, p in zip(ids, params_list) if p.output_kind is RequestOutputKind.DELTA}
            return self._run(ids, deltas, on_output)
        except BaseException:
            for request_id in ids:
                self.engine.abort_request(request_id)
            raise

    def chat(
        self,
        messages: Union[list[dict[str, Any]], list[list[dict[str, Any]]]],
        sampling_params: Union[None, SamplingParams, Sequence[SamplingParams]] = None,
        *,
        add_generation_prompt: bool = True,
        on_output: Optional[Callable[[int, RequestOutput], None]] = None,
    ) -> list[RequestOutput]:
        tokenizer = self.engine.tokenizer
        if tokenizer is None:
            raise InvalidRequestError("chat needs a tokenizer (the engine runs with skip_tokenizer_init)")
        conversations = messages if messages and isinstance(messages[0], list) else [messages]
        prompts = [tokenizer.encode_chat(conv, add_generation_prompt) for conv in conversations]
        return self.generate(prompts, sampling_params, on_output=on_output)

    def _run(self, ids: list[str], deltas: set[str], on_output) -> list[RequestOutput]:
        """Step until every request finished; the deltas of the requests in `deltas` are summed up."""
        position = {request_id: i for i, request_id in enumerate(ids)}
        latest: dict[str, RequestOutput] = {}
        finished = 0
        while finished < len(ids):
            for output in self.engine.step().outputs:
                if on_output is not None:
                    on_output(position[output.request_id], output)
                request_id = output.request_id
                if request_id not in deltas:
                    latest[request_id] = output
                elif request_id in latest:  # a copy is summed up: on_output's caller may keep the delta it saw
                    latest[request_id].add(_own_copy(output), aggregate=True)
                else:
                    latest[request_id] = _own_copy(output)
                finished += output.finished
        return [latest[request_id] for request_id in ids]


def _as_prompt_list(prompts: Any) -> list[PromptInput]:
    if isinstance(prompts, (str, dict)):
        return [prompts]
    if isinstance(prompts, list) and prompts and all(isinstance(t, int) for t in prompts):
        return [prompts]
    return list(prompts)


def _prompt_value(prompt: PromptInput):
    if isinstance(prompt, dict):
        if "prompt_token_ids" in prompt:
            return list(prompt["prompt_token_ids"])
        if "prompt" in prompt:
            return prompt["prompt"]
        raise InvalidRequestError("a prompt dict needs 'prompt' or 'prompt_token_ids'")
    return prompt


def _final_only(params_list: list[SamplingParams]) -> list[SamplingParams]:
    """The params as FINAL_ONLY: the same final output, without one per step (a cumulative one
    copies every token and logprob so far)."""
    swapped: dict[int, SamplingParams] = {}
    for params in params_list:
        if params.output_kind is not RequestOutputKind.FINAL_ONLY and id(params) not in swapped:
            final_only = copy.copy(params)  # validated already: not `replace`, which checks again
            final_only.output_kind = RequestOutputKind.FINAL_ONLY
            swapped[id(params)] = final_only
    return [swapped.get(id(params), params) for params in params_list]


def _own_copy(output: RequestOutput) -> RequestOutput:
    completions = [replace(c, token_ids=list(c.token_ids), logprobs=None if c.logprobs is None else list(c.logprobs))
                   for c in output.outputs]
    return replace(output, outputs=completions)


def _as_params_list(params: Any, count: int, kind: type = SamplingParams, name: str = "sampling") -> list:
    """One `kind` (SamplingParams or PoolingParams) per prompt: the default, the one given, or the list given."""
    if params is None:
        return [kind() for _ in range(count)]
    if isinstance(params, kind):
        return [params] * count
    params = list(params)
    if len(params) != count:
        raise InvalidRequestError(f"got {len(params)} {name} params for {count} prompts")
    return params
