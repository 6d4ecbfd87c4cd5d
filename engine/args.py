"""`EngineArgs`: every engine setting, validated in one place.

The field names are vLLM's where vLLM has them, and they double as CLI flags (`--max-model-len`)
and YAML keys (`max-model-len` or `max_model_len`).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any, Optional

from llmctl.engine.errors import EngineArgsError

DTYPES = ("auto", "float32", "bfloat16", "float16")
LOAD_FORMATS = ("auto", "dummy")
SCHEDULING_POLICIES = ("fcfs", "priority")


@dataclass
class EngineArgs:
    model: Optional[str] = None  # None: the embedded default model
    tokenizer: Optional[str] = None  # None: the model folder
    dtype: str = "auto"
    device: str = "auto"
    seed: int = 0
    block_size: Optional[int] = None  # None: the attention backend's preferred size
    max_model_len: Optional[int] = None  # None: the model's max_position_embeddings
    max_num_seqs: int = 128
    max_num_batched_tokens: Optional[int] = None  # None: max(2048, block_size)
    enable_prefix_caching: bool = True
    gpu_memory_utilization: float = 0.9
    kv_cache_memory: Optional[int] = None  # bytes, CPU; None: enough for max_num_seqs full contexts, capped at 4 GiB
    num_kv_blocks: Optional[int] = None  # explicit pool size, overrides both memory settings
    load_format: str = "auto"
    skip_tokenizer_init: bool = False
    batch_wait_timeout_ms: float = 0.0
    long_prompt_penalty: float = 0.0  # admission delay, in seconds per 1000 prompt tokens
    scheduling_policy: str = "fcfs"
    verify: bool = False  # check weight files against a sha256 manifest before loading
    num_threads: Optional[int] = None  # CPU threads for torch; None: torch's default
    enforce_eager: bool = False  # CUDA: never capture decode steps into CUDA graphs

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        _choice("dtype", self.dtype, DTYPES)
        _choice("load_format", self.load_format, LOAD_FORMATS)
        _choice("scheduling_policy", self.scheduling_policy, SCHEDULING_POLICIES)
        _positive("max_num_seqs", self.max_num_seqs)
        for name in ("block_size", "max_model_len", "max_num_batched_tokens", "num_kv_blocks", "kv_cache_memory",
                     "num_threads"):
            if getattr(self, name) is not None:
                _positive(name, getattr(self, name))
        if self.block_size is not None and self.block_size & (self.block_size - 1):
            raise EngineArgsError(f"block_size must be a power of two, got {self.block_size}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise EngineArgsError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.batch_wait_timeout_ms < 0:
            raise EngineArgsError("batch_wait_timeout_ms must be >= 0")
        if self.long_prompt_penalty < 0:
            raise EngineArgsError("long_prompt_penalty must be >= 0")
        if not isinstance(self.seed, int):
            raise EngineArgsError("seed must be an integer")
        if not (self.device in ("auto", "cpu", "cuda") or self.device.startswith("cuda:")):
            raise EngineArgsError(f"device must be auto, cpu, cuda or cuda:N, got {self.device!r}")

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in fields(cls)]

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> "EngineArgs":
        names = set(cls.field_names())
        cleaned = {str(k).replace("-", "_"): v for k, v in values.items()}
        unknown = sorted(set(cleaned) - names)
        if unknown:
            raise EngineArgsError(f"unknown engine argument(s): {', '.join(unknown)}")
        return cls(**cleaned)

    @classmethod
    def from_yaml(cls, path: str | Path, **overrides: Any) -> "EngineArgs":
        import yaml

        try:
            data = yaml.safe_load(Path(path).read_text()) or {}
        except (OSError, yaml.YAMLError) as exc:
            raise EngineArgsError(f"cannot read engine config {path}: {exc}") from None
        if not isinstance(data, dict):
            raise EngineArgsError(f"engine config {path} must be a mapping")
        return cls.from_dict({**data, **overrides})

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _choice(name: str, value: Any, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise EngineArgsError(f"{name} must be one of {', '.join(allowed)}, got {value!r}")


def _positive(name: str, value: Any) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise EngineArgsError(f"{name} must be a positive integer, got {value!r}")
