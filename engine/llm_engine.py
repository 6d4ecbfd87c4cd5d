"""`LLMEngine`: requests in, `RequestOutput`s out, one `step()` at a time.

Owns the request table and the text side of each token (detokenization, stop strings, outputs).
Each step is schedule -> execute -> update: the scheduler picks the batch, the executor runs it, and
`Scheduler.update_from_output` applies the results (computed tokens, prefix-cache blocks, appended
tokens, token stops, finishing); the engine then detokenizes what was appended.
"""

from __future__ import annotations

import itertools
from collections import deque
import logging
import os
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable, Optional, Union

import torch

from llmctl.engine.args import EngineArgs
from llmctl.engine.block_manager import BlockManager
from llmctl.engine.cuda_profiler import ProfilerSteps, step_bracket
from llmctl.engine.errors import (CapacityError, EngineArgsError, InvalidRequestError, ModelLoadError,
                                  is_out_of_memory)
from llmctl.engine.executor.abstract import Executor
from llmctl.engine.executor.uniproc_executor import UniProcExecutor
from llmctl.engine.gguf_loader import GGUFFile, is_gguf
from llmctl.engine.host import tune_cpu_allocator
from llmctl.engine.model_config import ModelConfig
from llmctl.engine.model_runner import RunnerConfig, quantization_label
from llmctl.engine.parallel import TensorParallelError, expert_ranges
from llmctl.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput, SpecDecodeCounts
from llmctl.engine.outputs import (CompletionOutput, PoolingOutput, PoolingRequestOutput, RequestMetrics,
                                   RequestOutput, SpecDecodeCounts)
from llmctl.engine.pooling import PoolerConfig, Pooling, PoolingParams
from llmctl.engine.sampler import SamplingRow
from llmctl.engine.sampling_params import RequestOutputKind, SamplingParams
from llmctl.engine.scheduler import Scheduler, SchedulerConfig
from llmctl.engine.sequence import Sequence
from llmctl.engine.spec_decode.draft_proposer import DraftModel, DraftProposer
from llmctl.engine.spec_decode.ngram_proposer import NgramProposer, SpecDecodeStats
from llmctl.engine.step_types import ModelRunnerOutput, SchedulerOutput, SeqUpdate
from llmctl.engine.hub import resolve_model_folder
from llmctl.engine.structured_output import StructuredOutputManager
from llmctl.engine.tokenizer import IncrementalDetokenizer, Tokenizer

logger = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
Prompt = Union[str, list[int]]


def default_model_path() -> Path:
    from importlib.resources import files

    return Path(str(files("llmctl").joinpath("default_model")))


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda")
        # INFO, not WARNING: on a CPU host with the default --device auto this is the expected case;
        # a user who asks for a GPU (--device cuda) gets an error instead.
        logger.info("CUDA is not available; running on the CPU")
        return torch.device("cpu")
    if name.startswith("cuda"):
        if not torch.cuda.is_available():
            raise EngineArgsError(f"device {name!r} requested but CUDA is not available "
                                  f"(torch {torch.__version__}, {torch.cuda.device_count()} GPUs visible)")
        index = int(name.split(":", 1)[1]) if ":" in name else 0
        if index >= torch.cuda.device_count():
            raise EngineArgsError(f"device {name!r} does not exist ({torch.cuda.device_count()} GPUs visible)")
        return torch.device("cuda", index)
    return torch.device("cpu")


def resolve_dtype(requested: str, config: ModelConfig, device: torch.device) -> torch.dtype:
    if requested != "auto":
        return DTYPES[requested]
    name = str(config.checkpoint_dtype or "float32").replace("torch.", "")
    dtype = DTYPES.get(name, torch.float32)
    if dtype is torch.float16 and device.type == "cpu":
        logger.info("float16 checkpoint on CPU: computing in bfloat16 (same width, fast kernels)")
        return torch.bfloat16
    return dtype


def model_path(args: EngineArgs) -> Path:
    """The model folder (or .gguf file) the arguments name, a model id's cached snapshot, checked to exist."""
    folder = resolve_model_folder(args.model, args.revision) if args.model else default_model_path()
    if not folder.exists():
        raise ModelLoadError(f"model folder {folder} does not exist")
    if not is_gguf(folder) and not folder.is_dir():
        raise ModelLoadError(f"{folder} is not a folder (give the Hugging Face model folder or a .gguf file)")
    return folder


def resolve_max_model_len(args: EngineArgs, config: ModelConfig) -> int:
    limit = config.max_context
    if args.max_model_len is None:
        return limit
    if args.max_model_len > limit:
        stretched = " (with its RoPE scaling)" if limit != config.max_position_embeddings else ""
        raise EngineArgsError(f"max_model_len {args.max_model_len} exceeds the model's "
                              f"max_position_embeddings {limit}{stretched}")
    return args.max_model_len


def build_runner_config(args: EngineArgs, folder: Path, model_config: ModelConfig, device: torch.device,
                        extra_kv_bytes_per_token: int = 0, extra_reserved_bytes: int = 0) -> RunnerConfig:
    args = args.with_device_defaults(device.type)
    return RunnerConfig(
        model_config=model_config, model_folder=folder, device=device,
        dtype=resolve_dtype(args.dtype, model_config, device), block_size=args.block_size,
        max_model_len=resolve_max_model_len(args, model_config), max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens, kv_cache_memory=args.kv_cache_memory,
        gpu_memory_utilization=args.gpu_memory_utilization, num_kv_blocks=args.num_kv_blocks,
        load_format=args.load_format, seed=args.seed, verify=args.verify, enforce_eager=args.enforce_eager,
        cudagraph_mode=args.cudagraph_mode,
        attention_backend=args.attention_backend,
        cuda_profiler_steps=args.cuda_profiler_steps,
        quantization=args.quantization, quantization_batch_cache=args.quantization_batch_cache,
        extra_kv_bytes_per_token=extra_kv_bytes_per_token,
        extra_reserved_bytes=extra_reserved_bytes,
    )


def runner_config(args: EngineArgs) -> RunnerConfig:
    """The model side's settings from the engine's alone (no tokenizer): what a node k > 0 builds its ranks'
    runners from, the same flags giving the same settings as on node 0."""
    folder = model_path(args)
    model_config = GGUFFile(folder).model_config() if is_gguf(folder) else ModelConfig.from_pretrained(folder)
    return build_runner_config(args, folder, model_config, resolve_device(args.device))


def default_executor_class(args: EngineArgs) -> Callable[[RunnerConfig], Executor]:
    """In-process for one rank; the multi-rank executor (rank 0 here) for tensor or pipeline parallelism."""
    parallel = args.parallel
    if parallel.world_size == 1:
        return UniProcExecutor
    if not parallel.runs_engine:
        raise EngineArgsError(f"node_rank {parallel.node_rank} runs model ranks only: start `llmctl serve` there "
                              "with the same flags (the engine, and generate or bench, run on node 0)")
    from llmctl.engine.executor.multiproc_executor import multiproc_executor_for

    return multiproc_executor_for(parallel, args.num_threads)


def _request_ids(*batches: Optional[SchedulerOutput]) -> tuple[str, ...]:
    """The requests with a row in any of `batches` (None: no batch), each once, in order."""
    return tuple(dict.fromkeys(s.seq.request_id for out in batches if out is not None for s in out.scheduled))


@dataclass(frozen=True)
class StepInfo:
    """What a step ran (no `request_ids`: nothing was scheduled) and the outputs it produced. The
    server fails exactly these requests when a step raises. `inter_token_latencies` (seconds since
    each sampled sequence's previous token; first tokens have none) is filled once the step's tokens
    are in, for the server's per-token histogram."""
    request_ids: tuple[str, ...]
    num_batched_tokens: int
    token_budget: int
    inter_token_latencies: tuple[float, ...] = ()
    outputs: list[RequestOutput] = field(default_factory=list)

    @property
    def ran(self) -> bool:
        return bool(self.request_ids)

    @property
    def batch_efficiency(self) -> float:
        return self.num_batched_tokens / self.token_budget if self.token_budget else 0.0


@dataclass(frozen=True)
class ModelInfo:
    """The served model's facts, for readers outside the engine (the server): read-only."""
    model: str  # the model folder
    max_model_len: int
    vocab_size: int
    tokenizer: Optional[Tokenizer]  # None with skip_tokenizer_init
    eos_token_ids: frozenset[int]
    bos_token_id: Optional[int]
    dtype: str  # the weights' and activations' dtype ("bfloat16")
    quantization: Optional[str]  # --quantization or the checkpoint's scheme (GPTQ, AWQ, ...); None: full precision
    weight_bytes: int  # what the parameters occupy (quantised linears at their quantised size)
    kv_cache_bytes: int  # the paged KV pool
    scheduling_policy: str = "fcfs"  # "priority": a request's priority orders it (else only 0 is accepted)
    expert_placement: tuple[tuple[int, ...], ...] = ()  # per tensor-parallel rank, its experts (expert parallel)
    pooler_config: Optional[PoolerConfig] = None  # how embeddings pool (what `dimensions` values pass)

    def expert_placement_text(self) -> str:
        """"experts: rank 0 holds 0-3, rank 1 holds 4-7" ("" without expert parallelism)."""
        held = [f"rank {rank} holds {ids[0]}" + (f"-{ids[-1]}" if len(ids) > 1 else "")
                for rank, ids in enumerate(self.expert_placement)]
        return f"experts: {', '.join(held)}" if held else ""


def _model_config_and_tokenizer(args: EngineArgs, folder: Path) -> tuple[ModelConfig, Optional[Tokenizer]]:
    """The checkpoint's model config and the tokenizer (--tokenizer, else the checkpoint's; None when skipped)."""
    if is_gguf(folder):  # the model config first: an unsupported architecture is the error to report
        gguf = GGUFFile(folder)
        model_config = gguf.model_config()
        tokenizer = None if args.skip_tokenizer_init else (
            Tokenizer.from_pretrained(resolve_model_folder(args.tokenizer)) if args.tokenizer
            else Tokenizer.from_gguf(gguf.metadata, folder.name))
        return model_config, tokenizer
    model_config = ModelConfig.from_pretrained(folder)
    tokenizer = (None if args.skip_tokenizer_init
                 else Tokenizer.from_pretrained(resolve_model_folder(args.tokenizer) if args.tokenizer else folder))
    return model_config, tokenizer


def _draft_model(args: EngineArgs, model_config: ModelConfig, folder: Path,
                 max_model_len: int) -> Optional[DraftModel]:
    """The speculative draft model (speculative_config "model"), or None; what it cannot run with refused."""
    speculative = args.speculative
    if speculative is not None and args.pipeline_parallel_size > 1:
        raise EngineArgsError("speculative decoding (speculative_config) with pipeline_parallel_size > 1 is not "
                              "supported yet")
    if speculative is None or speculative.model is None:
        return None
    if args.tensor_parallel_size > 1:
        raise EngineArgsError("a draft model (speculative_config \"model\") with tensor_parallel_size or "
                              "pipeline_parallel_size > 1 is not supported yet; the ngram method is")
    return DraftModel.load(speculative.model, model_config, Path(args.tokenizer or folder), max_model_len)


def expert_placement(args: EngineArgs, model_config: ModelConfig) -> tuple[tuple[int, ...], ...]:
    """The experts each tensor-parallel rank holds with --enable-expert-parallel (() without it, with one rank or
    a dense model); an expert count the ranks do not divide is refused here, before any rank starts."""
    size = args.parallel.tensor_parallel_size
    if model_config.moe is None or not args.enable_expert_parallel or size == 1:
        return ()
    try:
        return tuple(tuple(experts) for experts in expert_ranges(model_config.moe.num_experts, size))
    except TensorParallelError as exc:
        raise EngineArgsError(str(exc)) from None


@dataclass
class Emitted:
    """How much of one sample the request's outputs have carried (for `RequestOutputKind.DELTA`)."""
    text_len: int = 0
    num_tokens: int = 0
    finished: bool = False


@dataclass
class Request:
    request_id: str
    prompt: Optional[str]
    prompt_token_ids: list[int]
    params: Union[SamplingParams, PoolingParams]
    seqs: list[Sequence]
    detokenizers: list[Optional[IncrementalDetokenizer]]
    texts: list[str]
    arrival_time: float
    stop_holdback: int = 0
    emitted: list[Emitted] = field(default_factory=list)  # per sample
    emitted_prompt_logprobs: bool = False

    def __post_init__(self) -> None:
        self.emitted = [Emitted() for _ in self.seqs]

    @property
    def finished(self) -> bool:
        return all(seq.is_finished for seq in self.seqs)


class LLMEngine:
    def __init__(self, args: EngineArgs, executor_class: Optional[Callable[[RunnerConfig], Executor]] = None):
        """`executor_class` builds the executor from the runner's configuration (vLLM's seam for
        other executors; default: in-process, or `MultiprocExecutor` with several ranks)."""
        args.validate()
        asked_async = args.async_scheduling
        if args.data_parallel_size > 1:
            raise EngineArgsError(f"data_parallel_size {args.data_parallel_size}: an LLMEngine is one replica; "
                                  "data-parallel replicas are run by `llmctl serve --data-parallel-size`")
        device = resolve_device(args.device)
        self.args = args = args.with_device_defaults(device.type)  # what the engine runs with, as reported
        self.cuda_profiler = ProfilerSteps.for_device(args.cuda_profiler_steps, device)
        folder = model_path(args)
        self.model_config, self.tokenizer = _model_config_and_tokenizer(args, folder)
        if args.num_threads:
            torch.set_num_threads(args.num_threads)
        if device.type == "cpu":
            tune_cpu_allocator()
        self.max_model_len = resolve_max_model_len(args, self.model_config)
        speculative = args.speculative
        draft = _draft_model(args, self.model_config, folder, self.max_model_len)
        placement = expert_placement(args, self.model_config)
        dtype = resolve_dtype(args.dtype, self.model_config, device)
        config = build_runner_config(args, folder, self.model_config, device,
                             extra_kv_bytes_per_token=draft.kv_bytes_per_token(dtype) if draft else 0,
                             extra_reserved_bytes=draft.weight_bytes(dtype) if draft else 0)
        self.executor: Executor = (executor_class or default_executor_class(args))(config)
        placement = getattr(self.executor, "expert_placement", placement)  # over data-parallel replicas too
        self.block_manager = BlockManager(self.executor.num_blocks, self.executor.block_size,
                                          args.enable_prefix_caching)
        self.eos_token_ids = self._eos_ids()
        # thread-safe: the server compiles a request's grammar on a worker thread before submitting it
        self.structured_output = StructuredOutputManager(args.structured_outputs_backend, self.tokenizer,
                                                         self.vocab_size, self.eos_token_ids)
        self.scheduler = Scheduler(SchedulerConfig(
            max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
            max_model_len=self.max_model_len, eos_token_ids=self.eos_token_ids, policy=args.scheduling_policy,
            batch_wait_timeout_s=args.batch_wait_timeout_ms / 1000.0, long_prompt_penalty=args.long_prompt_penalty,
        ), self.block_manager)
        self.proposer: Optional[NgramProposer | DraftProposer] = None
        if draft is not None:  # its pool has the target's block ids, so it comes after the target's runner
            self.proposer = DraftProposer(speculative, draft, config, self.executor.num_blocks,
                                          self.executor.block_size, self.block_manager)
        elif speculative is not None:
            self.proposer = NgramProposer(speculative)
        self.spec_stats = SpecDecodeStats(speculative.num_speculative_tokens if speculative else 0)
        self.step_clock = time.perf_counter  # what the proposer's cost gate measures steps with (tests inject one)
        self.requests: dict[str, Request] = {}
        self._in_flight: deque[tuple[SchedulerOutput, object]] = deque()  # pipeline micro-batches, oldest first
        self.async_scheduling = self._resolve_async_scheduling(asked_async)
        self._launched: Optional[tuple[SchedulerOutput, object]] = None  # async scheduling: the step in flight
        self.last_step = StepInfo((), 0, self.scheduler.config.max_num_batched_tokens)
        self._seq_ids = itertools.count()
        self.num_oom_retries = 0  # steps retried smaller after running out of memory
        self.num_capacity_errors = 0  # requests finished because they did not fit even alone
        self.pooler_config = PoolerConfig.from_checkpoint(folder, self.model_config.hidden_size, args.pooling_type)
        self.model_info = ModelInfo(
            model=str(folder), max_model_len=self.max_model_len, vocab_size=self.vocab_size, tokenizer=self.tokenizer,
            eos_token_ids=self.eos_token_ids, bos_token_id=self.tokenizer.bos_token_id if self.tokenizer else None,
            dtype=str(self.executor.dtype).replace("torch.", ""),
            quantization=quantization_label(args.quantization, self.model_config),
            weight_bytes=self.executor.weight_bytes, kv_cache_bytes=self.executor.kv_cache_bytes,
            scheduling_policy=self.scheduler.config.policy, expert_placement=placement, pooler_config=self.pooler_config)
        if placement:
            logger.info("expert parallel: %s", self.model_info.expert_placement_text())

    # ---- configuration ------------------------------------------------------------------------
    def _resolve_async_scheduling(self, asked: Optional[bool]) -> bool:
        """`args.async_scheduling` as resolved for the device, where the executor can launch a step without
        waiting for it (asked for explicitly, it must; by default a log line says why it is off)."""
        if self.args.async_scheduling and not hasattr(self.executor, "execute_async"):
            reason = f"the executor {type(self.executor).__name__} cannot launch a step without waiting for it"
            if asked:
                raise EngineArgsError(f"async_scheduling: {reason}")
            logger.info("async scheduling off: %s", reason)
            return False
        if asked is None and self.executor.device.type == "cuda" and self.args.async_scheduling_blocker:
            logger.info("async scheduling off: it does not combine with %s yet", self.args.async_scheduling_blocker)
        return bool(self.args.async_scheduling)

    def _eos_ids(self) -> frozenset[int]:
        if self.tokenizer is not None and self.tokenizer.eos_token_ids:
            return self.tokenizer.eos_token_ids
        return frozenset(self.model_config.eos_token_ids)

    @property
    def vocab_size(self) -> int:
        return self.model_config.vocab_size

    # ---- requests -----------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt: Prompt, params: Union[None, SamplingParams, PoolingParams] = None,
                    *, arrival_time: Optional[float] = None, priority: int = 0, cache_salt: str = "") -> None:
        """A generation request, or with `PoolingParams` a pooling one (a prefill whose hidden states are pooled
        into an embedding, batched with the rest; its one output is a `PoolingRequestOutput`)."""
        if request_id in self.requests:
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        if priority != 0 and self.scheduler.config.policy != "priority":  # as vLLM: never silently ignored
            raise InvalidRequestError(f"priority {priority} needs the priority scheduling policy "
                                      "(--scheduling-policy priority); this engine schedules first come, first served",
                                      param="priority")
        params = params or SamplingParams()
        text, token_ids = self._tokenize(prompt)
        arrival = arrival_time if arrival_time is not None else time.monotonic()
        if isinstance(params, PoolingParams):
            self._add_pooling_request(request_id, text, token_ids, params, arrival, priority, cache_salt.encode())
            return
        self._validate_prompt(token_ids, params)
        seqs = self._make_sequences(request_id, token_ids, params, arrival, priority, cache_salt.encode())
        detoks = [self._detokenizer(token_ids, params) for _ in seqs]
        holdback = max((len(s) for s in params.stop), default=1) - 1
        self.requests[request_id] = Request(request_id, text, token_ids, params, seqs, detoks, [""] * len(seqs),
                                            arrival, stop_holdback=holdback)
        for seq in seqs:
            self.scheduler.add(seq)

    def _add_pooling_request(self, request_id: str, text: Optional[str], token_ids: list[int],
                             params: PoolingParams, arrival: float, priority: int, salt: bytes) -> None:
        if self.proposer is not None:
            raise InvalidRequestError("embeddings with speculative decoding (speculative_config) are not supported")
        if self.args.pipeline_parallel_size > 1:
            raise InvalidRequestError("embeddings with pipeline_parallel_size > 1 are not supported yet")
        self._validate_prompt(token_ids, SamplingParams())
        self.pooler_config.check(params)
        normalize = self.pooler_config.normalize if params.normalize is None else params.normalize
        # never sampled: the neutral SamplingParams are what the scheduler's and runner's reads of a sequence see
        seq = Sequence(next(self._seq_ids), request_id, 0, token_ids, SamplingParams(max_tokens=1),
                       arrival_time=arrival, priority=priority, cache_salt=salt,
                       pooling=Pooling(params, self.pooler_config.pooling_type, normalize))
        self.requests[request_id] = Request(request_id, text, token_ids, params, [seq], [None], [""], arrival)
        self.scheduler.add(seq)

    def _tokenize(self, prompt: Prompt) -> tuple[Optional[str], list[int]]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise InvalidRequestError("text prompts need a tokenizer (the engine runs with skip_tokenizer_init)",
                                          param="prompt")
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, (list, tuple)) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            return None, list(prompt)
        raise InvalidRequestError("a prompt is a string or a list of token ids", param="prompt")

    def _validate_prompt(self, token_ids: list[int], params: SamplingParams) -> None:
        if not token_ids:
            raise InvalidRequestError("the prompt is empty", param="prompt")
        bad = next((t for t in token_ids if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise InvalidRequestError(f"token id {bad} is outside the vocabulary [0, {self.vocab_size})",
                                      param="prompt")
        if len(token_ids) > self.max_model_len:
            raise InvalidRequestError(f"the prompt has {len(token_ids)} tokens, but max_model_len is "
                                      f"{self.max_model_len}", param="prompt")
        if params.stop and self.tokenizer is None:
            raise InvalidRequestError("stop strings need a tokenizer (the engine runs with skip_tokenizer_init)",
                                      param="stop")

    def _make_sequences(self, request_id: str, token_ids: list[int], params: SamplingParams, arrival: float,
                        priority: int, salt: bytes) -> list[Sequence]:
        seqs: list[Sequence] = []
        private = params.n > 1 and not self.args.enable_prefix_caching
        if private:  # siblings still share the prompt's blocks, but nobody else can hit them
            salt = b"siblings:" + os.urandom(16)
        for index in range(params.n):
            seq = Sequence(next(self._seq_ids), request_id, index, token_ids, params.clone_for_sample(),
                           arrival_time=arrival, priority=priority, cache_salt=salt,
                           parent=seqs[0] if seqs else None, shares_with_siblings=private)
            if params.structured_outputs is not None:  # one matcher per sample
                seq.grammar = self.structured_output.grammar_for(params.structured_outputs)
            if params.seed is not None:
                seq.draw_seed = hash((params.seed, index)) & (2**63 - 1)
                seq.generator = self.executor.make_generator(seq.draw_seed)
            seqs.append(seq)
        return seqs

    def _detokenizer(self, token_ids: list[int], params: SamplingParams) -> Optional[IncrementalDetokenizer]:
        if self.tokenizer is None:
            return None
        return IncrementalDetokenizer(self.tokenizer, token_ids, params.skip_special_tokens)

    def abort_request(self, request_id: str) -> Optional[RequestOutput]:
        """Stop a request now and free its KV blocks; returns its final output (None if unknown)."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return None
        for seq in request.seqs:
            if not seq.is_finished:
                seq.finish_reason = seq.finish_reason or "abort"
                self.scheduler.finish(seq)
        return self._output(request)

    def fail_last_step(self) -> list[str]:
        """After `step()` raised: abort the requests that step ran (freeing their blocks) and drop
        state the failed forward may have left half-written. Returns the aborted request ids."""
        failed = [rid for rid in self.last_step.request_ids if rid in self.requests]
        for request_id in failed:
            self.abort_request(request_id)
        self._launched = None  # its requests were among those aborted, or finished
        self.executor.release_kept_state()
        return failed

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def check_health(self) -> None:
        """Raise `EngineDeadError` when the model side can no longer step (a tensor-parallel rank died)."""
        self.executor.check_health()

    def shutdown(self) -> None:
        """Stop what the executor started (the other ranks' processes). The engine serves no more steps."""
        self.executor.shutdown()

    def idle_step(self) -> None:
        """A forward without sequences: this replica's part in a step the other data-parallel replicas run,
        when the experts are dealt over the replicas (the executor is a `LockstepExecutor`)."""
        self.executor.idle_step()

    # ---- stepping -----------------------------------------------------------------------------
    def step(self) -> StepInfo:
        """Schedule, execute and apply one batch; returns what ran and its outputs. A batch that runs
        out of memory is undone and retried smaller (see `Scheduler.shrink_after_oom`); a request that
        does not fit even alone is finished with a `CapacityError` (its output's `error`) and the
        others run on."""
        start = self.step_clock()
        with step_bracket(self.cuda_profiler) as ran_a_batch:
            if self.proposer is not None:
                self.proposer.propose(self.scheduler.running)
            info, scheduled = self._run_step()
            ran_a_batch(bool(scheduled))
        if self.proposer is not None:  # the measured cost of this step, with or without drafts
            self.proposer.end_step(scheduled, self.step_clock() - start)
        return info

    def _run_step(self) -> tuple[StepInfo, Optional[list]]:
        """`step`'s schedule, execute and apply; with the rows that ran (None: none, or a failed step)."""
        if self.executor.max_concurrent_batches > 1:
            return self._run_pipelined_step()
        if self.async_scheduling:
            return self._run_async_step()
        out, result, failed = self._schedule_and_execute(self.executor.execute)
        if failed is not None:
            return replace(self.last_step, outputs=[failed]), None
        if out is None:
            return StepInfo((), 0, self.scheduler.token_budget), None
        return self._apply(out, result), out.scheduled

    def _schedule_and_execute(self, execute: Callable) -> tuple[Optional[SchedulerOutput], object,
                                                                Optional[RequestOutput]]:
        """Schedule a batch and `execute` it: (batch, result, None); (None, None, None) when nothing was
        scheduled. A batch that runs out of memory is undone and retried smaller; a request that does not fit
        even alone is finished: (None, None, its output)."""
        while True:
            out = self.scheduler.schedule()
            if out.is_empty:
                return None, None, None
            self.last_step = StepInfo(_request_ids(out), out.num_batched_tokens, self.scheduler.token_budget)
            rows = [self._sampling_row(s.seq) if s.samples else None for s in out.scheduled]
            try:
                result = execute(out.scheduled, rows)
            except Exception as exc:  # noqa: BLE001 - only allocation failures are handled here
                if not is_out_of_memory(exc):
                    raise
                cause = f"{type(exc).__name__}: {' '.join(str(exc).split())}"
            else:
                return out, result, None
            # Outside the except block, so the traceback (and the activations its frames hold) is gone.
            failed = self._after_out_of_memory(out, cause)
            if failed is not None:
                return None, None, failed

    def _run_async_step(self) -> tuple[StepInfo, Optional[list]]:
        """Async scheduling (vLLM's): launch the next batch, then apply the one launched by the call before,
        whose tokens the device fed into the new batch's inputs; the new batch lands in the next call. Its
        info names both batches' requests (a failure fails both) and carries the applied one's outputs."""
        landing, self._launched = self._launched, None
        if landing is not None and self._needs_host_tokens(landing[0]):  # the next schedule needs its tokens
            self.last_step = StepInfo(_request_ids(landing[0]), 0, self.scheduler.token_budget)
            return self._land(landing), None
        out, pending, failed = self._schedule_and_execute(self.executor.execute_async)
        launched = self.last_step if out is not None else StepInfo((), 0, self.scheduler.token_budget)
        if out is not None:
            self.scheduler.mark_in_flight(out)
            self._launched = (out, pending)
        info = launched
        if landing is not None:
            self.last_step = replace(launched, request_ids=_request_ids(out, landing[0]))
            info = self._land(landing)
        if failed is not None:
            info = self.last_step = replace(info, outputs=[*info.outputs, failed])
        if self._launched is not None and not self.scheduler.has_unfinished:
            self._land(self._launched)  # only finished rows left in it: nothing in flight while idle
            self._launched, self.last_step = None, info
        return info, None

    def _land(self, launched: tuple[SchedulerOutput, object]) -> StepInfo:
        out, pending = launched
        return self._apply(out, pending.get_output())

    @staticmethod
    def _needs_host_tokens(out: SchedulerOutput) -> bool:
        """A sequence sampled by `out` samples its next token from the values of its outputs (penalties, logits
        processors, a grammar): its next row waits for `out` to land."""
        return any(s.samples and (s.seq.grammar is not None or s.seq.params.logits_processors
                                  or s.seq.params.needs_penalties) for s in out.scheduled)

    def _run_pipelined_step(self) -> tuple[StepInfo, Optional[list]]:
        """Pipeline parallelism (vLLM's way): fill the pipeline with up to max_concurrent_batches micro-batches,
        each scheduled from the sequences not in flight and holding about an equal share of them, then apply
        the oldest one's results. An out-of-memory in a multi-rank step is a rank fault, not retried."""
        busy = frozenset(s.seq.seq_id for out, _ in self._in_flight for s in out.scheduled)
        batches = self.executor.max_concurrent_batches
        while len(self._in_flight) < batches:
            unfinished = len(self.scheduler.running) + len(self.scheduler.waiting)
            out = self.scheduler.schedule(busy, max_seqs=max(1, -(-unfinished // batches)))
            if out.is_empty:
                break
            rows = [self._sampling_row(s.seq) if s.samples else None for s in out.scheduled]
            self._in_flight.append((out, self.executor.submit(out.scheduled, rows)))
            busy |= {s.seq.seq_id for s in out.scheduled}
        if not self._in_flight:
            return StepInfo((), 0, self.scheduler.token_budget), None
        out, pending = self._in_flight.popleft()
        self.last_step = StepInfo(_request_ids(out),
                                  out.num_batched_tokens, self.scheduler.token_budget)
        return self._apply(out, self.executor.collect(pending)), out.scheduled

    def _apply(self, out: SchedulerOutput, result: ModelRunnerOutput) -> StepInfo:
        now = time.monotonic()
        touched: dict[str, Request] = {}
        latencies: list[float] = []
        for update in self.scheduler.update_from_output(out, result, now):
            seq = update.seq
            request = self.requests[seq.request_id]
            if seq.grammar is not None:
                self._advance_grammar(update, now)
            if update.num_rejected and not seq.is_finished:
                self.executor.truncate_kept_state(seq.seq_id, seq.num_computed_tokens)
            if update.num_drafts:
                self.spec_stats.observe(update.num_drafts, update.num_accepted_drafts)
                if self.proposer is not None:
                    self.proposer.observe(seq.seq_id, update.num_drafts, update.num_accepted_drafts)
            if seq.last_token_time is not None:
                latencies.append(now - seq.last_token_time)
            if seq.first_token_time is None:
                seq.first_token_time = now
            seq.last_token_time = now
            self._detokenize(request, update, now)
            touched[request.request_id] = request
        outputs = [o for o in map(self._output, touched.values()) if o is not None]  # None: FINAL_ONLY, unfinished
        for request in touched.values():
            if request.finished:
                del self.requests[request.request_id]
        if not self.scheduler.has_unfinished:
            self.executor.release_kept_state()
        last = self.last_step  # built directly: dataclasses.replace walks the fields, each step
        self.last_step = StepInfo(last.request_ids, last.num_batched_tokens, last.token_budget, tuple(latencies), outputs)
        return self.last_step

    def _advance_grammar(self, update: SeqUpdate, now: float) -> None:
        """Feed the row's new tokens to its sequence's matcher; the sequence ends where the grammar does (a stop
        token accepted at its end, also under ignore_eos), and the tokens after that are taken back."""
        seq, tokens = update.seq, update.new_token_ids
        taken = seq.grammar.accept(tokens)
        if taken == len(tokens) and not seq.grammar.is_terminated:
            return
        if taken < len(tokens):
            if not seq.grammar.is_terminated:  # the bitmask allowed it, so this is a bug: end the output here
                logger.error("request %r: token %d is not allowed by its grammar; ending the output",
                             seq.request_id, tokens[taken])
            seq.drop_last_outputs(len(tokens) - taken)
            update.new_token_ids = tokens[:taken]
        if not seq.is_finished:
            seq.finish_reason, seq.stop_reason = ("stop", None) if seq.grammar.is_terminated else ("abort", None)
            seq.finished_time = now
            self.scheduler.finish(seq)

    def _after_out_of_memory(self, out: SchedulerOutput, cause: str) -> Optional[RequestOutput]:
        """Undo the failed batch and lower the budgets; when it was one sequence at the smallest
        chunk, finish that request with a capacity error instead and return its final output."""
        tokens, seqs = out.num_batched_tokens, len(out.scheduled)
        first = out.scheduled[0]
        context = first.seq.num_computed_tokens + first.num_new_tokens  # before undo() resets it
        self.scheduler.undo(out)
        self.executor.release_after_out_of_memory()  # the kept decode K/V may be half-updated
        if self.scheduler.shrink_after_oom(out):
            self.num_oom_retries += 1
            logger.warning("out of memory in a step of %d sequence(s), %d token(s) (%s); retrying with at most "
                           "%d token(s) and %d sequence(s) per step", seqs, tokens, cause,
                           self.scheduler.token_budget, self.scheduler.max_num_seqs)
            return None
        seq = first.seq
        error = CapacityError(f"request {seq.request_id!r} does not fit in free device memory: a step of {tokens} "
                              f"token(s) at a {context}-token context ran out of memory even alone ({cause}); "
                              "retry later, or with a shorter prompt or max_tokens")
        logger.error("%s", error)
        self.num_capacity_errors += 1
        output = self.abort_request(seq.request_id)
        output.error = error
        return output

    def _sampling_row(self, seq: Sequence) -> SamplingRow:
        stops = () if seq.params.ignore_eos else tuple(self.eos_token_ids)
        return SamplingRow(seq.params, seq.prompt_token_ids, seq.output_token_ids, seq.generator,
                           stops + tuple(seq.params.stop_token_ids), seq.draw_seed, seq.grammar,
                           seq.num_pending_tokens)

    def _detokenize(self, request: Request, update: SeqUpdate, now: float) -> None:
        """Add the row's new tokens to the text, one at a time; the first stop string ends the
        sequence there (the tokens after it are taken back). A token stop on the last token was
        checked first (it wins); a length stop on it loses to a stop string the token completed."""
        seq, tokens = update.seq, update.new_token_ids
        detok = request.detokenizers[seq.index]
        first_produced = len(seq.output_token_ids) - len(tokens)
        for j, token in enumerate(tokens):
            previous_len = len(request.texts[seq.index])
            if detok is not None:
                request.texts[seq.index] += detok.add(token)
            is_last = j == len(tokens) - 1
            if is_last and seq.finish_reason == "stop":
                return
            if first_produced + j + 1 < seq.params.min_tokens:
                continue
            hit = self._find_stop_string(request, seq, previous_len)
            if hit is not None:
                seq.drop_last_outputs(len(tokens) - 1 - j)
                seq.finish_reason, seq.stop_reason = "stop", hit
                if not seq.is_finished:
                    seq.finished_time = now
                    self.scheduler.finish(seq)
                return

    def _find_stop_string(self, request: Request, seq: Sequence, previous_len: int) -> Optional[str]:
        """Find the earliest stop string that the newest text completed, and cut the text there."""
        params = seq.params
        if not params.stop:
            return None
        text = request.texts[seq.index]
        window_start = max(0, previous_len - request.stop_holdback)
        best: Optional[tuple[int, str]] = None
        for stop in params.stop:
            at = text.find(stop, window_start)
            if at != -1 and (best is None or at < best[0]):
                best = (at, stop)
        if best is None:
            return None
        at, stop = best
        request.texts[seq.index] = text[: at + len(stop)] if params.include_stop_str_in_output else text[:at]
        return stop

    def _output(self, request: Request) -> Union[None, RequestOutput, PoolingRequestOutput]:
        """The request's output as its `output_kind` asks: everything so far, what is new since the
        previous output (samples with nothing new left out), or None until it finishes."""
        if isinstance(request.params, PoolingParams):
            return self._pooling_output(request)
        kind = request.params.output_kind
        if kind is RequestOutputKind.FINAL_ONLY and not request.finished:
            return None
        delta = kind is RequestOutputKind.DELTA
        completions = [c for c in (self._completion(request, seq, delta) for seq in request.seqs) if c is not None]
        first = request.seqs[0]
        metrics = RequestMetrics(
            arrival_time=request.arrival_time, first_scheduled_time=first.first_scheduled_time,
            first_token_time=min((s.first_token_time for s in request.seqs if s.first_token_time), default=None),
            finished_time=max((s.finished_time or 0.0 for s in request.seqs), default=None) if request.finished else None,
            num_preemptions=sum(s.num_preemptions for s in request.seqs),
            spec_decode=sum((s.spec_decode for s in request.seqs), SpecDecodeCounts()),
        )
        prompt_logprobs = None
        if request.params.prompt_logprobs is not None and not (delta and request.emitted_prompt_logprobs):
            prompt_logprobs = list(first.prompt_logprobs)  # a step's output comes after the whole prompt was scored
            request.emitted_prompt_logprobs = True
        return RequestOutput(request.request_id, request.prompt, request.prompt_token_ids, completions,
                             request.finished, metrics, prompt_logprobs)

    def _pooling_output(self, request: Request) -> Optional[PoolingRequestOutput]:
        """A pooling request's one output, once its prompt is pooled (or it was aborted: no vector)."""
        if not request.finished:
            return None
        seq = request.seqs[0]
        pooled = seq.pooling.hidden_sum is not None and seq.finish_reason == "stop"
        data = PoolingOutput(seq.pooling.embedding(seq.num_prompt_tokens)) if pooled else None
        metrics = RequestMetrics(arrival_time=request.arrival_time, first_scheduled_time=seq.first_scheduled_time,
                                 first_token_time=seq.first_token_time, finished_time=seq.finished_time,
                                 num_preemptions=seq.num_preemptions)
        return PoolingRequestOutput(request.request_id, request.prompt, request.prompt_token_ids, data, True, metrics)

    def _completion(self, request: Request, seq: Sequence, delta: bool) -> Optional[CompletionOutput]:
        text = request.texts[seq.index]
        if not seq.is_finished and request.stop_holdback:
            text = text[: max(0, len(text) - request.stop_holdback)]
        wants_logprobs = seq.params.logprobs is not None
        if delta:
            emitted = request.emitted[seq.index]
            nothing_new = len(text) == emitted.text_len and len(seq.output_token_ids) == emitted.num_tokens
            if emitted.finished or (nothing_new and not seq.is_finished):
                return None
            # Shown text never shrinks: a stop string is only searched for in the held-back tail.
            start = emitted.num_tokens
            text, token_ids = text[emitted.text_len:], seq.output_token_ids[start:]
            logprobs = seq.output_logprobs[start:] if wants_logprobs else None
            emitted.text_len += len(text)
            emitted.num_tokens += len(token_ids)
            emitted.finished = seq.is_finished
        else:
            token_ids = list(seq.output_token_ids)
            logprobs = list(seq.output_logprobs) if wants_logprobs else None
        return CompletionOutput(index=seq.index, text=text, token_ids=token_ids,
                                cumulative_logprob=seq.cumulative_logprob if wants_logprobs else None,
                                logprobs=logprobs, finish_reason=seq.finish_reason, stop_reason=seq.stop_reason)

    def get_stats(self) -> dict[str, float]:
        stats = self.scheduler.stats()
        # Requests, not sequences: every unfinished request with no sequence running is waiting
        # (queued, preempted or held back by dynamic batching); O(1), unlike a pass over the queue.
        stats["num_waiting_requests"] = len(self.requests) - stats["num_running_requests"]
        return {**stats, **self.spec_stats.as_stats(), "num_requests": len(self.requests),
                "num_oom_retries": self.num_oom_retries, "num_capacity_errors": self.num_capacity_errors,
                "num_draft_oom_skips": self.proposer.num_oom_skips if self.proposer else 0}
