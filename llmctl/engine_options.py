"""Engine flags shared by every command that runs the engine (`generate`, `serve`, `bench`, ...).

Flag names are `EngineArgs` field names with dashes, as in `vllm serve`; `engine_args()` turns the
parsed values back into a validated `EngineArgs`.
"""

from __future__ import annotations

import enum
from typing import Annotated, Any, Mapping, Optional

import typer

PANEL = "Engine"
# The model id `llmctl serve` gives the embedded model; clients that ship with llmctl (bench serve)
# find the same tokenizer locally by it.
EMBEDDED_MODEL_ID = "llmctl-default"


class Dtype(str, enum.Enum):
    auto = "auto"
    float32 = "float32"
    bfloat16 = "bfloat16"
    float16 = "float16"


class LoadFormat(str, enum.Enum):
    auto = "auto"
    dummy = "dummy"


def _opt(*names: str, help: str) -> Any:
    return typer.Option(*names, help=help, rich_help_panel=PANEL)


Model = Annotated[Optional[str], _opt("--model", "-m", help="Hugging Face model folder (default: the embedded model).")]
Tokenizer = Annotated[Optional[str], _opt("--tokenizer", help="Tokenizer folder (default: the model folder).")]
DtypeOpt = Annotated[Dtype, _opt("--dtype", help="Weight and activation dtype (auto: the checkpoint's).")]
Device = Annotated[str, _opt("--device", help="auto, cpu, cuda or cuda:N.")]
Seed = Annotated[int, _opt("--seed", help="Engine random seed (unseeded sampling).")]
BlockSize = Annotated[Optional[int], _opt("--block-size", help="Tokens per KV block (default: the attention backend's).")]
MaxModelLen = Annotated[Optional[int], _opt("--max-model-len", help="Context length (default: the model's).")]
MaxNumSeqs = Annotated[int, _opt("--max-num-seqs", help="Most sequences in one batch.")]
MaxBatchedTokens = Annotated[Optional[int], _opt("--max-num-batched-tokens", help="Token budget of one step.")]
PrefixCaching = Annotated[bool, _opt("--enable-prefix-caching/--no-enable-prefix-caching", help="Reuse KV blocks of shared prompt prefixes.")]
GpuMemUtil = Annotated[float, _opt("--gpu-memory-utilization", help="Fraction of GPU memory the engine may use (CUDA).")]
KvCacheMemory = Annotated[Optional[int], _opt("--kv-cache-memory", help="KV cache size in bytes (CPU).")]
NumKvBlocks = Annotated[Optional[int], _opt("--num-kv-blocks", help="Explicit KV pool size in blocks (overrides the memory settings).")]
LoadFormatOpt = Annotated[LoadFormat, _opt("--load-format", help="auto: read the checkpoint; dummy: random weights of its shapes.")]
NumThreads = Annotated[Optional[int], _opt("--num-threads", help="CPU threads for torch.")]
Verify = Annotated[bool, _opt("--verify", help="Check weight files against the folder's SHA256SUMS first.")]
EnforceEager = Annotated[bool, _opt("--enforce-eager", help="Never capture CUDA graphs for decode steps (CUDA).")]


ENGINE_FLAG_NAMES = ("model", "tokenizer", "dtype", "device", "seed", "block_size", "max_model_len", "max_num_seqs",
                     "max_num_batched_tokens", "enable_prefix_caching", "gpu_memory_utilization", "kv_cache_memory",
                     "num_kv_blocks", "load_format", "num_threads", "verify", "enforce_eager")


def engine_args_from(params: Mapping[str, Any]):
    """`EngineArgs` from a command's parsed parameters (its `locals()`): the engine flags among them."""
    return engine_args(**{name: params[name] for name in ENGINE_FLAG_NAMES if name in params})


def missing_tokenizer(args) -> Optional[str]:
    """The folder a tokenizer.json was expected in when there is none (a `--load-format dummy` folder
    often holds only config.json), else None."""
    from pathlib import Path

    folder = args.tokenizer or args.model
    if folder is None or not Path(folder).is_dir() or (Path(folder) / "tokenizer.json").is_file():
        return None  # the embedded model has one; a missing folder is the loader's error to report
    return str(folder)


def engine_args(**values: Any):
    """Build `EngineArgs` from the parsed flags (enum values unwrapped)."""
    from llmctl.engine.args import EngineArgs

    cleaned = {k: (v.value if isinstance(v, enum.Enum) else v) for k, v in values.items()}
    return EngineArgs.from_dict(cleaned)
