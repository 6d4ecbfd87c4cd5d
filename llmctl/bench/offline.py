"""`llmctl bench throughput` / `bench latency`: the in-process engine on a fixed workload, with
vLLM's definitions (benchmarks/benchmark_throughput.py and benchmark_latency.py).

- throughput: one timed pass over N requests, all submitted at once; requests/s, output tokens/s
  and total (prompt + output) tokens/s; `repeats` passes give mean and standard deviation.
- latency: one batch of `batch_size` identical-length prompts run end to end, `warmup_iters`
  untimed passes then `iters` timed ones; mean, std and percentiles of the per-pass latency.

Prompts are token ids (random, or a file tokenized up front) and the engine runs with
`skip_tokenizer_init`, so `--load-format dummy` works on a folder holding only `config.json`.
Every request uses greedy sampling with `ignore_eos`, so output lengths are exactly the
requested ones. The transformers comparison lives in `llmctl.bench.hf_compare`.
"""

from __future__ import annotations

import math
import random
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

from llmctl.errors import UserError

SCHEMA_VERSION = 1
PERCENTILES = (10, 25, 50, 75, 90, 99)
Progress = Callable[[str, int, int], None]  # (phase, done, total)


@dataclass(frozen=True)
class Request:
    prompt_token_ids: list[int]
    output_len: int


@dataclass(frozen=True)
class ModelInfo:
    """What the workload needs to know about the model before it is loaded."""

    folder: Path
    label: str  # the --model value, or "embedded default model"
    vocab_size: int
    max_model_len: int


def model_info(args: Any) -> ModelInfo:
    """Read config.json (cheap) so bad lengths fail before the weights load."""
    from llmctl.engine.errors import ModelLoadError
    from llmctl.engine.hub import resolve_model_folder
    from llmctl.engine.llm_engine import default_model_path
    from llmctl.engine.model_config import ModelConfig

    try:  # a model id: its snapshot in the local Hugging Face cache
        model, revision = args.model, getattr(args, "revision", None)
        folder = resolve_model_folder(model, revision) if model else default_model_path()
    except ModelLoadError as exc:
        raise UserError(str(exc)) from None
    if not folder.is_dir():
        raise UserError(f"model folder {folder} does not exist" if not folder.exists()
                        else f"{folder} is not a folder (give the Hugging Face model folder)")
    config = ModelConfig.from_pretrained(folder)
    limit = config.max_context
    if args.max_model_len is not None and args.max_model_len > limit:
        raise UserError(f"--max-model-len {args.max_model_len} exceeds the model's max_position_embeddings {limit}")
    return ModelInfo(folder, args.model or "embedded default model", config.vocab_size, args.max_model_len or limit)


def device_type(args: Any) -> str:
    """The type of device the engine will run on ("cuda" or "cpu"): what its batch defaults depend on."""
    from llmctl.engine.llm_engine import resolve_device

    return resolve_device(args.device).type


# ---- workloads ----------------------------------------------------------------------------------
def length_bounds(length: int, range_ratio: float) -> tuple[int, int]:
    """vLLM's random-dataset range: uniform integers in [floor(L(1-r)), ceil(L(1+r))], at least 1."""
    return max(1, math.floor(length * (1 - range_ratio))), max(1, math.ceil(length * (1 + range_ratio)))


def check_lengths(input_len: int, output_len: int, range_ratio: float, max_model_len: int, model: str) -> None:
    if input_len < 1:
        raise UserError(f"--input-len must be >= 1, got {input_len}")
    if output_len < 1:
        raise UserError(f"--output-len must be >= 1, got {output_len}")
    if not 0.0 <= range_ratio < 1.0:
        raise UserError(f"--range-ratio must be in [0, 1), got {range_ratio:g}")
    longest = length_bounds(input_len, range_ratio)[1] + length_bounds(output_len, range_ratio)[1]
    if longest > max_model_len:
        spread = f" (up to {longest} with --range-ratio {range_ratio:g})" if range_ratio else ""
        raise UserError(f"--input-len {input_len} + --output-len {output_len}{spread} exceeds max-model-len "
                        f"{max_model_len} of {model}; lower them or raise --max-model-len")


def random_requests(num_prompts: int, input_len: int, output_len: int, range_ratio: float, vocab_size: int,
                    seed: int) -> list[Request]:
    """Random token prompts; lengths drawn per request from `length_bounds` with a seeded RNG."""
    rng = random.Random(seed)
    in_lo, in_hi = length_bounds(input_len, range_ratio)
    out_lo, out_hi = length_bounds(output_len, range_ratio)
    requests = []
    for _ in range(num_prompts):
        length = rng.randint(in_lo, in_hi)
        requests.append(Request([rng.randrange(vocab_size) for _ in range(length)], rng.randint(out_lo, out_hi)))
    return requests


def dataset_requests(path: Path, tokenizer_folder: Path, output_len: int, num_prompts: Optional[int],
                     info: ModelInfo) -> list[Request]:
    """Prompts from a file in `llmctl generate -f` format (plain lines or JSON lines with `prompt`,
    `prompt_token_ids` or `messages`); a line's `max_tokens` overrides --output-len."""
    from llmctl.prompt_file import parse_prompt_lines

    try:
        with path.open() as stream:
            specs = parse_prompt_lines(stream, str(path))
    except OSError as exc:
        raise UserError(f"cannot read --dataset {path}: {exc.strerror or exc}") from None
    if num_prompts is not None:
        if num_prompts > len(specs):
            raise UserError(f"--num-prompts {num_prompts} but {path} holds only {len(specs)} prompts")
        specs = specs[:num_prompts]
    tokenizer = _tokenizer(specs, tokenizer_folder)
    requests = []
    for number, spec in enumerate(specs, start=1):
        ids = _spec_ids(spec, tokenizer)
        out = spec.params.get("max_tokens", output_len)
        if not isinstance(out, int) or out < 1:
            raise UserError(f"{path} prompt {number}: max_tokens must be a positive integer")
        if not ids:
            raise UserError(f"{path} prompt {number} is empty")
        if any(not isinstance(t, int) or not 0 <= t < info.vocab_size for t in ids):
            raise UserError(f"{path} prompt {number}: token ids must be integers in [0, {info.vocab_size})")
        if len(ids) + out > info.max_model_len:
            raise UserError(f"{path} prompt {number}: {len(ids)} prompt + {out} output tokens exceed max-model-len "
                            f"{info.max_model_len}")
        requests.append(Request(list(ids), out))
    return requests


def _tokenizer(specs: list[Any], folder: Path) -> Any:
    if all(spec.prompt_token_ids is not None for spec in specs):
        return None
    from llmctl.engine.tokenizer import Tokenizer

    return Tokenizer.from_pretrained(folder)


def _spec_ids(spec: Any, tokenizer: Any) -> list[int]:
    if spec.prompt_token_ids is not None:
        return spec.prompt_token_ids
    if spec.messages is not None:
        return tokenizer.encode_chat(spec.messages)
    return tokenizer.encode(spec.prompt)


# ---- statistics ---------------------------------------------------------------------------------
def mean_std(values: list[float]) -> dict[str, float]:
    """Mean and sample standard deviation (0 for a single value)."""
    return {"mean": statistics.fmean(values), "std": statistics.stdev(values) if len(values) > 1 else 0.0}


def percentiles(values: list[float], points: tuple[int, ...] = PERCENTILES) -> dict[str, float]:
    """Linear-interpolation percentiles (numpy's default, as vLLM reports them)."""
    ordered = sorted(values)
    out = {}
    for p in points:
        rank = (len(ordered) - 1) * p / 100.0
        low = math.floor(rank)
        high = min(low + 1, len(ordered) - 1)
        out[str(p)] = ordered[low] + (ordered[high] - ordered[low]) * (rank - low)
    return out


@dataclass
class PassTimes:
    """Seconds of each timed pass over the same workload, and the workload's token counts."""

    seconds: list[float]
    num_requests: int
    prompt_tokens: int
    output_tokens: int
    spec_decode: Any = None  # the timed passes' summed SpecDecodeCounts (from each output's metrics)

    def rates(self) -> dict[str, dict[str, float]]:
        return {
            "requests_per_second": mean_std([self.num_requests / s for s in self.seconds]),
            "output_tokens_per_second": mean_std([self.output_tokens / s for s in self.seconds]),
            "total_tokens_per_second": mean_std([(self.prompt_tokens + self.output_tokens) / s for s in self.seconds]),
        }


# ---- engine runs --------------------------------------------------------------------------------
@dataclass
class EngineRun:
    llm: Any
    device: str
    dtype: str
    load_s: float
    quantization: Optional[str] = None
    weight_bytes: int = 0  # the engine's parameters (quantised linears at their quantised size)
    kv_cache_bytes: int = 0  # its paged KV pool
    max_num_seqs: int = 0  # as the engine resolved it for its device
    extra: dict[str, Any] = field(default_factory=dict)


def load_engine(args: Any) -> EngineRun:
    from llmctl.engine import LLM

    args.skip_tokenizer_init = True
    started = time.perf_counter()
    llm = LLM.from_engine_args(args)
    load_s = time.perf_counter() - started
    info = llm.engine.model_info
    return EngineRun(llm, str(llm.engine.executor.device), info.dtype, load_s, quantization=info.quantization,
                     weight_bytes=info.weight_bytes, kv_cache_bytes=info.kv_cache_bytes,
                     max_num_seqs=llm.engine.args.max_num_seqs)


def _params(output_len: int):
    from llmctl.engine import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)


def _warm_up(llm: Any, request: Request) -> None:
    """One short request first: lazy allocations and kernel selection stay out of the timed pass."""
    llm.generate([request.prompt_token_ids[:8]], _params(2))


def run_throughput(engine: EngineRun, requests: list[Request], repeats: int, progress: Progress) -> PassTimes:
    llm = engine.llm
    _warm_up(llm, requests[0])
    params = [_params(r.output_len) for r in requests]
    prompts = [r.prompt_token_ids for r in requests]
    seconds, spec = [], None
    for repeat in range(repeats):
        phase = f"pass {repeat + 1}/{repeats}"
        done = 0
        progress(phase, 0, len(requests))

        def on_output(_index: int, output: Any, phase: str = phase) -> None:
            nonlocal done
            if output.finished:
                done += 1
                progress(phase, done, len(requests))

        started = time.perf_counter()
        outputs = llm.generate(prompts, params, on_output=on_output)
        seconds.append(time.perf_counter() - started)
        _check_lengths(outputs, requests)
        spec = spec_decode_counts(outputs, spec)
    return PassTimes(seconds, len(requests), sum(len(p) for p in prompts), sum(r.output_len for r in requests),
                     spec)


def spec_decode_counts(outputs: list[Any], start: Any = None) -> Any:
    """The outputs' speculative-decoding counters summed (onto `start`)."""
    from llmctl.engine.outputs import SpecDecodeCounts

    return sum((o.metrics.spec_decode for o in outputs), start or SpecDecodeCounts())


def spec_decode_figures(args: Any, counts: Any) -> Optional[dict[str, Any]]:
    """The timed passes' acceptance (vLLM's names), None when the run had no speculative decoding."""
    if args.speculative is None:
        return None
    return {"num_drafts": counts.num_drafts, "num_draft_tokens": counts.num_draft_tokens,
            "num_accepted_tokens": counts.num_accepted_tokens, "acceptance_rate": counts.acceptance_rate,
            "mean_acceptance_length": counts.mean_acceptance_length}


def run_latency(engine: EngineRun, requests: list[Request], warmup_iters: int, iters: int,
                progress: Progress) -> tuple[list[float], Any]:
    """Seconds of each timed iteration, and their summed speculative-decoding counters."""
    llm = engine.llm
    prompts = [r.prompt_token_ids for r in requests]
    params = _params(requests[0].output_len)
    latencies, spec = [], None
    for i in range(warmup_iters):
        progress("warm-up", i, warmup_iters)
        llm.generate(prompts, params)
    for i in range(iters):
        progress("timed", i, iters)
        started = time.perf_counter()
        outputs = llm.generate(prompts, params)
        latencies.append(time.perf_counter() - started)
        _check_lengths(outputs, requests)
        spec = spec_decode_counts(outputs, spec)
    progress("timed", iters, iters)
    return latencies, spec


def _check_lengths(outputs: list[Any], requests: list[Request]) -> None:
    """ignore_eos makes every output exactly as long as asked; anything else would skew the rates."""
    for output, request in zip(outputs, requests):
        got = len(output.outputs[0].token_ids)
        if got != request.output_len:
            raise RuntimeError(f"a request produced {got} tokens instead of {request.output_len} "
                               f"(finish reason {output.outputs[0].finish_reason})")


def release(engine: EngineRun) -> None:
    """Drop the engine (weights and KV cache) before another model is loaded in this process."""
    import gc

    import torch

    if engine.llm is not None:
        engine.llm.engine.shutdown()  # tensor parallel: the other ranks' processes stop now
    engine.llm = None
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def header(kind: str, info: ModelInfo, args: Any, engine: EngineRun) -> dict[str, Any]:
    from llmctl.__about__ import __version__

    return {"schema_version": SCHEMA_VERSION, "llmctl_version": __version__, "benchmark": kind,
            "model": info.label, "load_format": args.load_format, "device": engine.device, "dtype": engine.dtype,
            "quantization": engine.quantization, "weight_bytes": engine.weight_bytes,
            "kv_cache_bytes": engine.kv_cache_bytes, "max_model_len": info.max_model_len,
            "enable_prefix_caching": args.enable_prefix_caching,
            "max_num_seqs": engine.max_num_seqs, "tensor_parallel_size": args.tensor_parallel_size,
            "engine_load_s": round(engine.load_s, 3),
            "speculative_config": None if args.speculative is None else asdict(args.speculative)}
