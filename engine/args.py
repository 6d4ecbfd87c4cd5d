"""`EngineArgs`: every engine setting, validated in one place.

The field names are vLLM's where vLLM has them, and they double as CLI flags (`--max-model-len`)
and YAML keys (`max-model-len` or `max_model_len`).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any, Mapping, Optional

from llmctl.engine.cuda_profiler import StepRange
from llmctl.engine.errors import EngineArgsError

DTYPES = ("auto", "float32", "bfloat16", "float16")
LOAD_FORMATS = ("auto", "dummy")
SCHEDULING_POLICIES = ("fcfs", "priority")
ATTENTION_BACKENDS = ("auto", "torch", "triton", "flash-attn")
CUDAGRAPH_MODES = ("none", "piecewise", "full_decode_only", "full_and_piecewise")  # vLLM's, lower-case
STRUCTURED_OUTPUTS_BACKENDS = ("auto", "xgrammar")  # engine/structured_output/
POOLING_TYPES = ("auto", "LAST", "MEAN", "CLS")  # engine/pooling.py
# Weight-only methods applied on the fly to a full-precision checkpoint (engine/layers/quantization/on_the_fly.py, fp8.py).
DEFAULT_MASTER_PORT = 29500  # torchrun's
# Pre-quantised checkpoint formats a --quantization value may name (accepted when the checkpoint is one, as in vLLM).
CHECKPOINT_QUANTIZATIONS = ("gptq", "awq", "compressed-tensors")
ON_THE_FLY_QUANTIZATIONS = ("int8", "int4", "int4-g32", "int4-g64", "int4-g128",
                            "int4-asym", "int4-g32-asym", "int4-g64-asym", "int4-g128-asym", "fp8")
# (max_num_seqs, max_num_batched_tokens) a device type gets when the user names none: a GPU step reads its
# weights once for many more rows before it stops being memory-bound (vLLM's GPU defaults).
BATCH_DEFAULTS = {"cuda": (256, 8192), "cpu": (128, 2048)}


def _arg(default: Any, help: str, **cli: Any) -> Any:
    """A field that is also a CLI flag: `help` is its help text, `short` an optional short name,
    `choices` the allowed values. `llmctl/engine_options.py` builds every command's engine flags
    from these; a field without `help` (skip_tokenizer_init) is Python-only."""
    return field(default=default, metadata={"help": help, **cli})


@dataclass
class EngineArgs:
    model: Optional[str] = _arg(None, "Hugging Face model folder, .gguf file, or model id ORG/NAME found in the local "
                                      "Hugging Face cache (never downloaded; default: the embedded model).", short="-m")
    revision: Optional[str] = _arg(None, "With a model id: the cached branch, tag or commit (default: main).")
    tokenizer: Optional[str] = _arg(None, "Tokenizer folder or cached model id (default: the model's).")
    dtype: str = _arg("auto", "Weight and activation dtype (auto: the checkpoint's).", choices=DTYPES)
    device: str = _arg("auto", "auto, cpu, cuda or cuda:N.")
    seed: int = _arg(0, "Engine random seed (unseeded sampling).")
    block_size: Optional[int] = _arg(None, "Tokens per KV block (default: the attention backend's).")
    max_model_len: Optional[int] = _arg(None, "Context length (default: the model's).")
    # None: the device's default (BATCH_DEFAULTS, resolved by `with_device_defaults`)
    max_num_seqs: Optional[int] = _arg(None, "Most sequences in one batch (default: 256 on CUDA, 128 on CPU).")
    max_num_batched_tokens: Optional[int] = _arg(None, "Token budget of one step (default: 8192 on CUDA, 2048 "
                                                       "on CPU).")  # at least block_size
    enable_prefix_caching: bool = _arg(True, "Reuse KV blocks of shared prompt prefixes.")
    gpu_memory_utilization: float = _arg(0.9, "Fraction of GPU memory the engine may use (CUDA).")
    # None: enough for max_num_seqs full contexts, capped at 4 GiB
    kv_cache_memory: Optional[int] = _arg(None, "KV cache size in bytes (CPU).")
    num_kv_blocks: Optional[int] = _arg(None, "Explicit KV pool size in blocks (overrides the memory settings).")
    load_format: str = _arg("auto", "auto: read the checkpoint; dummy: random weights of its shapes.",
                            choices=LOAD_FORMATS)
    skip_tokenizer_init: bool = False  # Python-only (LLM(..., skip_tokenizer_init=True)): no flag
    batch_wait_timeout_ms: float = _arg(0.0, "With nothing running, hold an under-filled batch up to this many "
                                             "ms for more requests (0: off).")
    long_prompt_penalty: float = _arg(0.0, "Admission delay in seconds per 1000 prompt tokens, so short prompts "
                                           "overtake long ones (0: off).")
    scheduling_policy: str = _arg("fcfs", "fcfs: arrival order; priority: lower request priority values run "
                                          "first (ties by arrival) and are preempted last.",
                                  choices=SCHEDULING_POLICIES)
    verify: bool = _arg(False, "Check weight files against the folder's SHA256SUMS first.")
    num_threads: Optional[int] = _arg(None, "CPU threads for torch.")
    enforce_eager: bool = _arg(False, "Never capture CUDA graphs for decode steps (CUDA).")
    cuda_profiler_steps: Optional[str] = _arg(None, "START:STOP: call cudaProfilerStart before engine step START and "
                                                    "cudaProfilerStop after step STOP-1, an NVTX range per step, for "
                                                    "nsys --capture-range=cudaProfilerApi (CUDA; `llmctl profile nsys` "
                                                    "sets it).")
    cudagraph_mode: str = _arg("piecewise", "CUDA graphs of decode steps (CUDA): piecewise (around eager attention; "
                                            "one rank), full_decode_only (the whole step, attention and tensor-"
                                            "parallel collectives included: the triton backend; others none), "
                                            "full_and_piecewise (full graphs, piecewise where no full one is "
                                            "captured; others piecewise) or none. Pipeline stages, "
                                            "--enforce-eager: none.", choices=CUDAGRAPH_MODES)
    # None: resolved per device by `with_device_defaults` (on for CUDA where nothing blocks it, off on CPU)
    async_scheduling: Optional[bool] = _arg(
        None, "Schedule and prepare the next step while the device runs this one (vLLM's async scheduling): "
              "sampled ids stay on the device as the next step's inputs and reach the host one step late, in one "
              "copy. Default: on for CUDA, off on CPU (the host runs the forward: nothing to overlap). With tensor "
              "parallelism rank 0 samples and sends the ids to the other ranks on the device. Not with "
              "speculative decoding or pipeline parallelism yet; requests with penalties, logits "
              "processors or structured outputs wait for the step before.", negatable=True)
    attention_backend: str = _arg("auto", "Paged attention kernels: auto (flash-attn where it imports and runs the "
                                          "model, else triton on CUDA where triton imports, else torch), torch, "
                                          "triton (CUDA), flash-attn (CUDA).", choices=ATTENTION_BACKENDS)
    quantization: Optional[str] = _arg(None, "Quantise the linear weights on load: int8 (weight-only, per "
                                             "output channel), int4-g32|g64|g128 (weight-only, grouped, "
                                             "symmetric; int4: g128), int4[-gN]-asym (with a zero point per "
                                             "group), fp8 (e4m3 weights and activations, CUDA sm_89+); gptq, "
                                             "awq, compressed-tensors: the checkpoint's own format, checked. "
                                             "Default: none.")
    quantization_batch_cache: bool = _arg(False, "CPU, quantised linears with bfloat16 activations: also keep each "
                                                 "weight dequantised to bf16, in bf16's own layout (AMX tiles, else "
                                                 "oneDNN-packed), for batches of 16+ rows: no per-call "
                                                 "dequantisation, for 2 more bytes per weight. Default: off "
                                                 "(weights at their quantised size).")
    structured_outputs_backend: str = _arg("auto", "Grammar engine for structured outputs (response_format, "
                                                   "structured_outputs): auto (xgrammar) or xgrammar.",
                                           choices=STRUCTURED_OUTPUTS_BACKENDS)
    pooling_type: str = _arg("auto", "How embedding requests pool the final hidden states: LAST (last token), "
                                     "MEAN or CLS (first token); auto: the checkpoint's sentence-transformers "
                                     "pooling, else LAST (vLLM's pooler_config pooling_type).", choices=POOLING_TYPES)
    # A JSON string (flag, env) or a mapping (Python, YAML); validated into `speculative` below.
    speculative_config: Optional[Any] = _arg(
        None, 'Speculative decoding as JSON, vLLM\'s keys: {"method": "ngram", "num_speculative_tokens": K, '
              '"prompt_lookup_max": N, "prompt_lookup_min": M, "disable_by_batch_size": B} (n-gram prompt '
              'lookup) or {"model": PATH, "num_speculative_tokens": K} (a draft model with the same tokenizer; '
              '"default-draft": the one shipped for the embedded model).', cli_type=str)
    # Tensor parallelism (engine/executor/multiproc_executor.py). Under torchrun its environment variables give the
    # rendezvous (see ParallelConfig.resolve); the flags are for launching without it.
    tensor_parallel_size: int = _arg(1, "Ranks the model is sharded over (one process each; 1: in-process).",
                                     short="-tp")
    pipeline_parallel_size: int = _arg(1, "Pipeline stages the decoder layers are split over (ranks = pipeline x "
                                          "tensor-parallel size).", short="-pp")
    enable_expert_parallel: bool = _arg(False, "Mixture-of-experts models with --tensor-parallel-size N: each rank "
                                               "holds num_experts / N whole experts (instead of a 1/N slice of "
                                               "every expert); attention stays tensor-parallel. With "
                                               "--data-parallel-size D the experts are dealt over all D x N ranks "
                                               "and the replicas step together.")
    pp_layer_partition: Optional[str] = _arg(None, "Decoder layers per pipeline stage, comma-separated (\"12,16\"; "
                                                   "default: an even split, like vLLM's VLLM_PP_LAYER_PARTITION).")
    nnodes: int = _arg(1, "Machines the ranks span; each runs the same command with its --node-rank.")
    node_rank: int = _arg(0, "This machine's index among --nnodes (0 runs the engine; others run model ranks "
                             "only and exit when rank 0 stops).")
    master_addr: str = _arg("127.0.0.1", "Address of node 0, where ranks meet (torch.distributed rendezvous).")
    master_port: Optional[int] = _arg(None, "Port on node 0 where ranks meet (default: a free one on one node, "
                                            f"{DEFAULT_MASTER_PORT} with --nnodes > 1).")
    # Data parallelism (llmctl/server/replicas.py): whole engine replicas behind one `llmctl serve`.
    data_parallel_size: int = _arg(1, "Engine replicas `llmctl serve` runs and balances requests over by load "
                                      "(CPU: the threads are split between them; CUDA: one device each, T with "
                                      "--tensor-parallel-size T).",
                                   short="-dp")
    # Python-only: how long a rank waits in a step's collective for the others before the engine fails.
    collective_timeout_s: float = 30.0

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        _choice("dtype", self.dtype, DTYPES)
        _choice("load_format", self.load_format, LOAD_FORMATS)
        _choice("scheduling_policy", self.scheduling_policy, SCHEDULING_POLICIES)
        _choice("attention_backend", self.attention_backend, ATTENTION_BACKENDS)
        _choice("cudagraph_mode", self.cudagraph_mode, CUDAGRAPH_MODES)
        _choice("structured_outputs_backend", self.structured_outputs_backend, STRUCTURED_OUTPUTS_BACKENDS)
        if self.cuda_profiler_steps is not None:
            StepRange.parse(self.cuda_profiler_steps)
        _choice("pooling_type", self.pooling_type, POOLING_TYPES)
        if self.quantization is not None:
            _choice("quantization", self.quantization, ON_THE_FLY_QUANTIZATIONS + CHECKPOINT_QUANTIZATIONS)
        for name in ("max_num_seqs", "block_size", "max_model_len", "max_num_batched_tokens", "num_kv_blocks",
                     "kv_cache_memory", "num_threads"):
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
        SpeculativeConfig.parse(self.speculative_config)
        self.parallel_for({})
        if self.async_scheduling not in (None, True, False):
            raise EngineArgsError(f"async_scheduling must be true or false, got {self.async_scheduling!r}")
        if self.async_scheduling and self.async_scheduling_blocker:
            raise EngineArgsError(f"async_scheduling does not combine with {self.async_scheduling_blocker} yet; "
                                  "turn one of them off")
        _positive("data_parallel_size", self.data_parallel_size)
        if self.data_parallel_size > 1 and (self.pipeline_parallel_size > 1 or self.nnodes > 1):
            raise EngineArgsError("data_parallel_size > 1 with pipeline_parallel_size > 1 or nnodes > 1 is not "
                                  "supported yet: the replicas share the server's process as their rank 0, on one "
                                  "node (run one `llmctl serve -dp D` per node behind a load balancer)")

    @property
    def async_scheduling_blocker(self) -> Optional[str]:
        """The setting async scheduling cannot run with yet (None: nothing blocks it)."""
        if self.speculative_config is not None:
            return "speculative decoding (speculative_config)"
        if self.pipeline_parallel_size > 1:  # its micro-batches in flight are its own overlap (submit/collect)
            return "pipeline parallelism (pipeline_parallel_size > 1)"
        return None

    @property
    def speculative(self) -> Optional["SpeculativeConfig"]:
        """The validated speculative-decoding settings (None: off)."""
        return SpeculativeConfig.parse(self.speculative_config)

    @property
    def parallel(self) -> "ParallelConfig":
        """Where this process's ranks are (torchrun's environment honoured when started under it)."""
        import os

        return self.parallel_for(os.environ)

    def parallel_for(self, environ: Mapping[str, str]) -> "ParallelConfig":
        return ParallelConfig.resolve(self, environ)

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

    def with_device_defaults(self, device_type: str) -> "EngineArgs":
        """A copy whose unset batch limits take `device_type`'s defaults ("cuda" or "cpu", BATCH_DEFAULTS;
        the token budget at least one block), and unset async scheduling on for CUDA where nothing blocks it;
        a value the user gave stays."""
        seqs, tokens = BATCH_DEFAULTS["cuda" if device_type == "cuda" else "cpu"]
        overlap = self.async_scheduling
        if overlap is None:
            overlap = device_type == "cuda" and self.async_scheduling_blocker is None
        return replace(self, max_num_seqs=self.max_num_seqs or seqs, async_scheduling=overlap,
                       max_num_batched_tokens=self.max_num_batched_tokens or max(tokens, self.block_size or 16))


SPEC_METHODS = ("ngram", "draft_model")
NGRAM_KEYS = ("prompt_lookup_max", "prompt_lookup_min")


@dataclass(frozen=True)
class SpeculativeConfig:
    """`--speculative-config`, vLLM's spelling. `ngram`: prompt lookup, the drafts are the tokens that
    followed the longest earlier occurrence of the sequence's last n tokens (prompt_lookup_max >= n >=
    prompt_lookup_min, vLLM's defaults). `draft_model` (implied by a `model`, as in vLLM): a smaller
    model with the target's tokenizer proposes the drafts (engine/spec_decode/draft_proposer.py; `"default-draft"`
    is the one shipped for the embedded model)."""

    method: str
    num_speculative_tokens: int
    model: Optional[str] = None
    prompt_lookup_max: int = 5
    prompt_lookup_min: int = 1
    # vLLM's key: no drafts while more sequences than this run. A verify row of k + 1 tokens costs about
    # what one token costs only while a step is memory-bound (small batches); a large batch is
    # compute-bound, where every rejected draft is paid in full, and on CUDA a verify row also leaves the
    # decode graphs. 8 is where vLLM's n-gram guidance starts to lose (its examples use 4..8).
    disable_by_batch_size: int = 8
    # llmctl's key (vLLM has none): skip drafting on the steps where the measured cost of a draft round
    # and verify rows exceeds what the sequences' measured acceptance saves (engine/spec_decode/cost_gate.py); false:
    # draft on every step the batch-size gate and the per-request window allow. Default (None): on for a
    # draft model (a round of the 1-layer default draft costs about a target step on CPU: 0.43-0.45x of
    # no speculation at batch 8), off for n-gram (a lookup costs ~30 us a sequence, a miss nothing more,
    # and a verify row about a decode row while the batch is memory-bound).
    disable_by_cost: Optional[bool] = None

    def __post_init__(self) -> None:
        if self.disable_by_cost is None:
            object.__setattr__(self, "disable_by_cost", self.model is not None or self.method == "draft_model")

    @classmethod
    def parse(cls, value: Any) -> Optional["SpeculativeConfig"]:
        """A JSON string or a mapping -> the config (None stays None); every error names its key."""
        if value is None or isinstance(value, cls):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                raise EngineArgsError(f"speculative_config is not valid JSON: {exc}") from None
        if not isinstance(value, dict):
            raise EngineArgsError("speculative_config must be a JSON object, e.g. "
                                  '{"method": "ngram", "num_speculative_tokens": 4}')
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise EngineArgsError(f"speculative_config: unsupported key(s) {', '.join(unknown)} "
                                  f"(supported: {', '.join(sorted(known))})")
        value = dict(value)
        if value.get("model") is not None:
            value.setdefault("method", "draft_model")  # vLLM infers the method from the model
        for name in ("method", "num_speculative_tokens"):
            if name not in value:
                raise EngineArgsError(f"speculative_config needs {name!r}")
        if value["method"] not in SPEC_METHODS:
            raise EngineArgsError(f"speculative_config: method {value['method']!r} is not supported "
                                  f"(supported: {', '.join(SPEC_METHODS)})")
        _check_method_keys(value)
        config = cls(**value)
        for name in ("num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min", "disable_by_batch_size"):
            _positive(f"speculative_config {name}", getattr(config, name))
        if not isinstance(config.disable_by_cost, bool):
            raise EngineArgsError(f"speculative_config disable_by_cost must be true or false, got "
                                  f"{config.disable_by_cost!r}")
        if config.prompt_lookup_min > config.prompt_lookup_max:
            raise EngineArgsError(f"speculative_config: prompt_lookup_min {config.prompt_lookup_min} exceeds "
                                  f"prompt_lookup_max {config.prompt_lookup_max}")
        return config


def _check_method_keys(value: dict[str, Any]) -> None:
    """Each method's own keys, and no key of the other one (never silently ignored)."""
    if value["method"] == "draft_model":
        if not isinstance(value.get("model"), str) or not value["model"]:
            raise EngineArgsError('speculative_config: the draft_model method needs "model": a model folder '
                                  'or "default-draft"')
        stray = [k for k in NGRAM_KEYS if k in value]
        if stray:
            raise EngineArgsError(f"speculative_config: {', '.join(stray)} belong to the ngram method, not to a "
                                  "draft model")
    elif value.get("model") is not None:
        raise EngineArgsError(f"speculative_config: method {value['method']!r} takes no \"model\" "
                              '(a draft model is method "draft_model")')


TORCHRUN_KEYS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT")


@dataclass(frozen=True)
class ParallelConfig:
    """The ranks of one engine and where they run. World size = tensor_parallel_size, split evenly over
    `nnodes` machines: node k holds global ranks k * ranks_per_node ... (k + 1) * ranks_per_node - 1;
    rank 0 (node 0) is the engine's process. Launched by llmctl (`torchrun` False), node 0 starts its
    other ranks with torch.multiprocessing and a node k > 0 starts all of its own; under torchrun every
    process already is one rank (`rank`), and nothing is started."""

    world_size: int = 1
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = 0  # 0: rank 0 picks a free one (one node)
    collective_timeout_s: float = 30.0
    torchrun: bool = False
    rank: Optional[int] = None  # under torchrun: this process's global rank
    pipeline_parallel_size: int = 1  # stages; global rank = stage x tensor_parallel_size + tensor-parallel rank
    layer_partition: Optional[tuple[int, ...]] = None  # decoder layers per stage (None: an even split)
    enable_expert_parallel: bool = False  # MoE layers: whole experts per tensor-parallel rank (engine/parallel.py)
    # `llmctl serve -dp D -tp T`: this engine is replica `data_parallel_rank` of D, whose rank 0 is the server's
    # process (shared by every replica) and whose ranks 1.. are its own processes (`global_rank`)
    data_parallel_size: int = 1
    data_parallel_rank: int = 0
    expert_data_parallel: bool = False  # MoE experts dealt over every replica's ranks (engine/parallel.py)

    @property
    def tensor_parallel_size(self) -> int:
        return self.world_size // self.pipeline_parallel_size

    @property
    def process_group_size(self) -> int:
        """The torch.distributed world: one engine's ranks, or the replicas' shared rank 0 and each one's others."""
        return 1 + self.data_parallel_size * (self.world_size - 1)

    def global_rank(self, rank: int) -> int:
        """This engine's rank `rank` in the process group (the same number without data-parallel replicas)."""
        return 0 if rank == 0 else rank + self.data_parallel_rank * (self.world_size - 1)

    @property
    def ranks_per_node(self) -> int:
        return self.world_size // self.nnodes

    @property
    def node_ranks(self) -> range:
        """The global ranks this machine holds."""
        return range(self.node_rank * self.ranks_per_node, (self.node_rank + 1) * self.ranks_per_node)

    @property
    def runs_engine(self) -> bool:
        """This process is rank 0: scheduler, sampler and the rank-0 model shard."""
        return (self.rank or 0) == 0 if self.torchrun else self.node_rank == 0

    @classmethod
    def resolve(cls, args: "EngineArgs", environ: Mapping[str, str]) -> "ParallelConfig":
        _positive("tensor_parallel_size", args.tensor_parallel_size)
        _positive("pipeline_parallel_size", args.pipeline_parallel_size)
        _positive("nnodes", args.nnodes)
        stages = args.pipeline_parallel_size
        partition = _layer_partition(args.pp_layer_partition, stages)
        port = args.master_port if args.master_port is not None else 0 if args.nnodes == 1 else DEFAULT_MASTER_PORT
        if not isinstance(port, int) or not 0 <= port <= 65535:
            raise EngineArgsError(f"master_port must be in 0..65535, got {port!r}")
        if not args.collective_timeout_s > 0:
            raise EngineArgsError("collective_timeout_s must be > 0")
        if all(key in environ for key in TORCHRUN_KEYS):
            return replace(cls._from_torchrun(args, environ), pipeline_parallel_size=stages, layer_partition=partition,
                           enable_expert_parallel=args.enable_expert_parallel)
        if not 0 <= args.node_rank < args.nnodes:
            raise EngineArgsError(f"node_rank must be in 0..{args.nnodes - 1} (--nnodes {args.nnodes}), "
                                  f"got {args.node_rank}")
        world = args.tensor_parallel_size * stages
        if world % args.nnodes:
            raise EngineArgsError(f"tensor_parallel_size x pipeline_parallel_size ({world}) must be a multiple of "
                                  f"nnodes ({args.nnodes}): every node holds the same number of ranks")
        if port == 0 and args.nnodes > 1:
            raise EngineArgsError("master_port 0 (a free port) works on one node only: the other nodes must be "
                                  "told the port; give --master-port")
        return cls(world, args.nnodes, args.node_rank, args.master_addr, port, args.collective_timeout_s,
                   pipeline_parallel_size=stages, layer_partition=partition,
                   enable_expert_parallel=args.enable_expert_parallel)

    @classmethod
    def _from_torchrun(cls, args: "EngineArgs", environ: Mapping[str, str]) -> "ParallelConfig":
        try:
            rank, world, local_world, group_rank, port = (int(environ[key]) for key in (
                "RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_PORT"))
        except ValueError as exc:
            raise EngineArgsError(f"torchrun's environment is not numeric: {exc}") from None
        asked = args.tensor_parallel_size * args.pipeline_parallel_size
        if asked != world and (args.tensor_parallel_size, world % args.pipeline_parallel_size) != (1, 0):
            raise EngineArgsError(f"tensor_parallel_size x pipeline_parallel_size ({asked}) differs from torchrun's "
                                  f"WORLD_SIZE {world}: one rank per torchrun process")
        if world % local_world:
            raise EngineArgsError(f"torchrun's WORLD_SIZE {world} is not a multiple of LOCAL_WORLD_SIZE {local_world}")
        return cls(world, world // local_world, group_rank, environ["MASTER_ADDR"], port, args.collective_timeout_s,
                   torchrun=True, rank=rank)


def _layer_partition(spec: Optional[str], stages: int) -> Optional[tuple[int, ...]]:
    """--pp-layer-partition "a,b,...": one positive layer count per pipeline stage (their sum is checked
    against the model's layers when it loads)."""
    if spec is None:
        return None
    try:
        counts = tuple(int(part) for part in spec.split(","))
    except ValueError:
        raise EngineArgsError(f"pp_layer_partition must be comma-separated layer counts, got {spec!r}") from None
    if len(counts) != stages or min(counts) < 1:
        raise EngineArgsError(f"pp_layer_partition {spec!r} must give one positive layer count for each of the "
                              f"{stages} pipeline stage(s)")
    return counts


def _choice(name: str, value: Any, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise EngineArgsError(f"{name} must be one of {', '.join(allowed)}, got {value!r}")


def _positive(name: str, value: Any) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise EngineArgsError(f"{name} must be a positive integer, got {value!r}")
