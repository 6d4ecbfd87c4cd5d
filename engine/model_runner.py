"""The model runner: owns the device, the weights, the KV pool and the sampler.

Each step it flattens the scheduled sequences into one batch (single-token queries first, then
prefill chunks; no padding), runs one forward, and samples the rows that finished their known
tokens.

Where the batch state lives: the per-step vectors (token ids, positions, slot mapping, logits indices) are built
fresh each step, on the CPU as arrays the native step reads, on CUDA staged in pinned memory and copied
non-blocking. The block tables persist on the device for a backend that reads them there (Triton):
`self.block_table`, a `PersistentBlockTable` (engine/block_table.py) with a row per sequence, updated by
differences each step against the scheduler's lists; the other backends build theirs from the lists.
"""

from __future__ import annotations

import logging
from array import array
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable, NamedTuple, Optional

import torch

from llmctl.engine.block_table import PersistentBlockTable
from llmctl.engine.cuda_graphs import (DecodeGraphs, GraphDispatch, has_full_graphs, maybe_decode_graphs,
                                       maybe_full_decode_graphs, ranks_agree, resolve_cudagraph_mode)
from llmctl.engine.device_memory import device_memory
from llmctl.engine.errors import EngineArgsError
from llmctl.engine.gguf_loader import is_gguf
from llmctl.engine.host import release_free_heap
from llmctl.engine.kernels import cpu_kernels_for
from llmctl.engine.layers.attention import CommonAttentionMetadata, select_backend
from llmctl.engine.layers.attention.torch_backend import NATIVE_MAX_QUERY
from llmctl.engine.layers.fused_ops import select_layer_ops
from llmctl.engine.layers.quantization import linear_methods_for, on_the_fly_quantization
from llmctl.engine.layers.quantization.grouped import add_batch_weights
from llmctl.engine.loader import build_model
from llmctl.engine.model_config import ModelConfig
from llmctl.engine.parallel import PipelineParallel, TensorParallel
from llmctl.engine.sampler import DeviceSample, Sampler, SamplerOutput, SamplingRow
from llmctl.engine.sequence import Sequence
from llmctl.engine.spec_decode.rejection_sampler import PLACEHOLDER_TOKEN_ID, DraftSpan
from llmctl.engine.step_types import ModelRunnerOutput, ScheduledSeq
from llmctl.engine.weight_pages import huge_page_zeros, move_weights_to_huge_pages

logger = logging.getLogger(__name__)

CPU_DEFAULT_KV_BYTES = 4 << 30
# On CPU the kept decode K/V (the backend's workspace_share of the pool) may take at least this much.
WORKSPACE_FLOOR_BYTES = 1 << 30
# Decode graphs may take at most this share of the memory left for graphs + KV: an 8B model's graphs for
# 256 sequences take ~3.1 GiB (0.85 GiB at 128), a few percent of an 80-141 GB card's budget; on a 24 GB card
# the cap keeps most of the budget for the KV pool, and the larger batch sizes run eagerly.
GRAPH_SHARE = 0.1


class StepLogits(NamedTuple):
    """A forward's float32 logits [rows, vocab], and each row's argmax where the native step found them while
    writing the logits (the greedy sampler then reads none of them: after a batch-1 step's weight stream, half the
    row in the other core's cache, that read cost ~45 us of a two-CCD int4-g32 SmolLM-135M step), else None."""

    logits: torch.Tensor
    argmax: Optional[list[int]] = None
    hidden: Optional[torch.Tensor] = None  # float32 final hidden states of the step's pooling_indices rows


@dataclass
class PoolRow:
    """A pooling row's hidden states in the forward's pooled rows: `count` rows from `start`."""

    seq_id: int
    start: int
    count: int


@dataclass
class PromptRow:
    """A batch row whose logits score the next prompt token (for prompt log-probs)."""

    seq_id: int
    row: int
    position: int  # position of the scored token
    target: int
    top: int


def _prompt_logprobs(logits: torch.Tensor, rows: list[PromptRow]) -> dict[int, list[tuple[int, dict[int, float]]]]:
    if not rows:
        return {}
    logprobs = torch.log_softmax(logits, dim=-1)
    targets = torch.tensor([r.target for r in rows], device=logits.device)
    chosen = logprobs.gather(1, targets.unsqueeze(1)).squeeze(1).tolist()
    top_n = max(r.top for r in rows)
    top_values, top_ids = logprobs.topk(top_n, dim=-1) if top_n else (None, None)
    result: dict[int, list[tuple[int, dict[int, float]]]] = {}
    for i, row in enumerate(rows):
        entry = {row.target: chosen[i]}
        if row.top:
            entry.update(zip(top_ids[i, : row.top].tolist(), top_values[i, : row.top].tolist()))
        result.setdefault(row.seq_id, []).append((row.position, entry))
    return result


class HostVectors(NamedTuple):
    """A step's four vectors on the host. On CPU the int64 arrays its tensors view: what the native step reads (no
    torch call); on a GPU the lists its tensors were staged from: what a multi-rank driver sends the other ranks
    without waiting for the device."""

    input_ids: "array | list[int]"
    positions: "array | list[int]"
    slot_mapping: "array | list[int]"
    logits_indices: "array | list[int]"


@dataclass
class StepInputs:
    """What the forward of one step reads, and all of it: plain tensors and integer lists, the same on
    every rank (a multi-rank executor sends exactly these, without `host`). Rows in forward order (1-token rows
    first)."""

    input_ids: torch.Tensor  # [num_tokens] int64
    positions: torch.Tensor  # [num_tokens] int64
    slot_mapping: torch.Tensor  # [num_tokens] int64: where each new token's K/V goes in the pool
    logits_indices: torch.Tensor  # [num_logits] int64: the token rows whose logits come back
    seq_ids: list[int]  # per row
    query_lens: list[int]
    context_lens: list[int]
    block_tables: list[list[int]]
    host: Optional[HostVectors] = None  # the driver's host copy of the four vectors (None on the other ranks)
    # the token rows whose final hidden states pooling rows read (driver only; None: no row pools)
    pooling_indices: Optional[torch.Tensor] = None
    # pipeline parallelism: which of the micro-batches in flight this is (vLLM's virtual engine); the same
    # sequences come back in the same slot, so per-slot state kept between steps stays valid
    micro_batch: int = 0

    def attention_batch(self, block_size: int, table: Optional[PersistentBlockTable] = None) -> CommonAttentionMetadata:
        """The rows for the attention backend; with `table` (the runner's persistent block table) brought up to
        this step's block lists first, their rows in it."""
        rows = None if table is None else table.update(self.seq_ids, self.block_tables)
        return CommonAttentionMetadata(seq_ids=self.seq_ids, query_lens=self.query_lens,
                                       context_lens=self.context_lens, block_tables=self.block_tables,
                                       slot_mapping=self.slot_mapping, block_size=block_size,
                                       micro_batch=self.micro_batch, table_rows=rows)


@dataclass
class PreparedStep:
    """The driver's view of a step: the batch as scheduled, the rows in forward order, the forward's
    inputs, and the prompt tokens whose log-probs the logits after the sampled ones hold."""

    scheduled: list[ScheduledSeq]
    order: list[ScheduledSeq]
    inputs: StepInputs
    prompt_rows: list[PromptRow]
    pool_rows: list[PoolRow] = field(default_factory=list)
    # async scheduling: (token row, seq id) of inputs that are the step in flight's samples, filled on the device
    placeholders: list[tuple[int, int]] = field(default_factory=list)


@dataclass
class SamplingPlan:
    """The sampled positions of a step in logits order: each one's sampling row and batch row, and the verify
    rows whose drafts came with their distribution."""

    positions: list[SamplingRow]
    owners: list[int]
    drafts: list[DraftSpan]


class LastSampled(NamedTuple):
    """The previous step's sampled ids on the device, and where each sequence's last one is among them."""

    token_ids: torch.Tensor
    index: dict[int, int]


class AsyncModelRunnerOutput:
    """A launched step's output (vLLM's name): its sampled ids and log-probs on their way to the host in one
    non-blocking copy behind an event; `get_output` waits for that copy alone (on CPU the copy is the tensor)."""

    def __init__(self, sample: Optional[DeviceSample],
                 assemble: Callable[[Optional[SamplerOutput]], ModelRunnerOutput]):
        self._sample, self._assemble = sample, assemble
        self._host = None if sample is None else sample.table.to("cpu", non_blocking=True)
        self._ready = None
        if sample is not None and sample.table.is_cuda:
            self._ready = torch.cuda.Event()
            self._ready.record()

    def get_output(self) -> ModelRunnerOutput:
        if self._ready is not None:
            self._ready.synchronize()
        return self._assemble(None if self._sample is None else self._sample.output(self._host.tolist()))


def _unmeasured(work) -> int:
    """Run `work` where no device memory budget applies: nothing to measure."""
    work()
    return 0


def kv_bytes_per_token(model_config: ModelConfig, dtype: torch.dtype, num_kv_heads: Optional[int] = None,
                       num_layers: Optional[int] = None) -> int:
    """K and V of one token in `num_layers` layers (a pipeline stage's; default every layer), for `num_kv_heads`
    (a tensor-parallel rank's; default all of them)."""
    element = torch.empty((), dtype=dtype).element_size()
    heads = model_config.num_kv_heads if num_kv_heads is None else num_kv_heads
    layers = model_config.num_layers if num_layers is None else num_layers
    return 2 * layers * heads * model_config.head_dim * element


@dataclass
class RunnerConfig:
    model_config: ModelConfig
    model_folder: Optional[Path]
    device: torch.device
    dtype: torch.dtype
    block_size: Optional[int]
    max_model_len: int
    max_num_seqs: int
    max_num_batched_tokens: int
    kv_cache_memory: Optional[int]
    gpu_memory_utilization: float
    num_kv_blocks: Optional[int]
    load_format: str
    seed: int
    verify: bool
    enforce_eager: bool = False
    cudagraph_mode: str = "piecewise"  # EngineArgs.cudagraph_mode
    attention_backend: str = "auto"  # EngineArgs.attention_backend
    cuda_profiler_steps: Optional[str] = None  # EngineArgs': the worker ranks bracket the same steps
    quantization: Optional[str] = None  # EngineArgs.quantization: weight-only linears quantised on load
    quantization_batch_cache: bool = False  # EngineArgs': quantised CPU linears keep a bf16 copy for batches
    # This process's rank: the model, the attention heads and the KV pool are this rank's shard.
    tensor_parallel: TensorParallel = TensorParallel.single()
    # This rank's pipeline stage: the model and the KV pool hold its decoder layers only.
    pipeline_parallel: PipelineParallel = PipelineParallel()
    # KV bytes per token of a second pool on the same block ids (a draft model's): the pools are sized
    # together, so a block costs both.
    extra_kv_bytes_per_token: int = 0
    # Device bytes another model of this process takes after this runner has planned (a draft's weights):
    # held out of the --gpu-memory-utilization budget.
    extra_reserved_bytes: int = 0


def quantization_label(quantization: Optional[str], mc: ModelConfig) -> Optional[str]:
    """How the linears are quantised: `--quantization`, else the checkpoint's own scheme, else None."""
    described = mc.quantization.describe() if mc.quantization else mc.quant_method
    return on_the_fly_quantization(quantization, mc) or described


def model_bytes(model: torch.nn.Module) -> int:
    """What the model's tensors occupy, each storage once: parameters, buffers and the tensors a linear
    method keeps beside them. int8 linears hold 1 byte per weight plus scales; the AMX bf16 method holds
    its tiles only; the oneDNN bf16 (no AMX) and fp32 CPU methods hold the weight twice, plain for one row
    and packed for more (quantised ones with --quantization-batch-cache too). A packed copy's
    storage is opaque (oneDNN/MKL layout) and counts as its logical shape's elements, the weight it
    packs (MKL's own size is its reserved
    buffer, many times the pages it touches: a 64x128 fp32 pack reports 7.9 MB and adds 0.3 MB RSS)."""
    storages: dict[tuple[str, int], int] = {}
    for module in model.modules():
        attributes = [v for v in vars(module).values() if isinstance(v, torch.Tensor)]
        for tensor in [*module.parameters(recurse=False), *module.buffers(recurse=False), *attributes]:
            if tensor.layout == torch._mkldnn:  # an MKL pack's numel is its reserved buffer: count the weight it packs
                packs = getattr(module, "weight", None)
                storages[("packed", id(tensor))] = (packs.numel() * packs.element_size()
                                                    if isinstance(packs, torch.Tensor) else
                                                    tensor.numel() * tensor.element_size())
                continue
            storage = tensor.untyped_storage()
            storages[(str(tensor.device), storage.data_ptr())] = storage.nbytes()
    return sum(storages.values())


class ModelRunner:
    def __init__(self, config: RunnerConfig):
        self.config = config
        self.device = config.device
        self._on_cpu = self.device.type == "cpu"
        mc = config.model_config
        tp = config.tensor_parallel
        self.pp = pp = config.pipeline_parallel
        self._sends: list = []  # the last step's sends to the next pipeline stage, until they complete
        self.stage_layers = pp.layer_range(mc.num_layers)
        kernels = cpu_kernels_for(self.device, config.dtype)
        backend_cls = select_backend(self.device, config.dtype, mc.head_dim, config.attention_backend)
        # This rank's heads: the KV pool holds its KV heads only (a replicated one where they are fewer than ranks).
        self.num_heads, self.num_kv_heads = tp.attention_heads(mc.num_heads, mc.num_kv_heads)
        self.attention = backend_cls(self.num_heads, self.num_kv_heads, mc.head_dim, mc.sliding_window,
                                     dtype=config.dtype, kernels=kernels, scale=mc.attention_scale,
                                     softcap=mc.attn_logit_softcapping)
        self.block_size = config.block_size or backend_cls.preferred_block_size
        problem = self.attention.validate_block_size(self.block_size)
        if problem:
            raise EngineArgsError(problem)
        # rows for every micro-batch's sequences in flight, each as wide as a max_model_len context's blocks
        self.block_table = PersistentBlockTable(
            config.max_num_seqs * pp.size, -(-config.max_model_len // self.block_size),
            self.device) if self.attention.uses_persistent_block_table else None
        linear_method, lm_head_method = linear_methods_for(
            mc, config.quantization, self.device, config.dtype, kernels, load_format=config.load_format,
            gguf=config.model_folder is not None and is_gguf(config.model_folder),
            batch_hint=min(config.max_num_seqs, 64))
        self.model = build_model(mc, config.model_folder, max_positions=config.max_model_len, dtype=config.dtype,
                                 device=self.device, load_format=config.load_format, seed=config.seed,
                                 linear_method=linear_method, ops=select_layer_ops(self.device, kernels),
                                 verify=config.verify, lm_head_method=lm_head_method, tp=tp, pp=pp)
        if config.quantization_batch_cache and not add_batch_weights(self.model, kernels):
            raise EngineArgsError("--quantization-batch-cache needs quantised linears on the CPU with bfloat16 "
                                  "activations (--quantization or a pre-quantised checkpoint, --dtype bfloat16)")
        if self.device.type == "cpu":
            move_weights_to_huge_pages(self.model)
            release_free_heap()  # what loading freed (full-precision weights a quantised linear replaced)
        self.weight_bytes = model_bytes(self.model)  # this rank's
        logger.info("weights: %.1f MiB (%s)", self.weight_bytes / 2**20,
                    quantization_label(config.quantization, mc) or config.dtype)
        # Start-up, in this order on every device: measure the worst-case forward (where a device memory
        # budget applies), capture the decode graphs within that budget, then size the KV pool from what is
        # left and allocate it. The profile peak and the graphs' memory both come out of
        # --gpu-memory-utilization, and nothing runs before the pieces it reads exist.
        self.native_decode = None  # set once the KV pool exists
        self.memory = device_memory(self.device) if config.num_kv_blocks is None else None
        peak = self._profile_peak() if self.memory is not None else 0
        mode = resolve_cudagraph_mode(config.cudagraph_mode, self.device, self.attention, config.enforce_eager,
                                      tp.size, pp.size)
        self.graphs = maybe_decode_graphs(self.model, self.attention, self.device, config.dtype, config.max_num_seqs,
                                          mode)
        if self.graphs is not None:
            self._capture_graphs(self.graphs, peak)
        # Full decode graphs hold the pool's addresses, so they are captured after it, in memory held back from it.
        full_allowance = self._graph_allowance(peak) if has_full_graphs(mode) else None
        self.num_blocks = self._plan_num_blocks(peak + (full_allowance or 0))
        self.kv_caches = self._allocate_kv_cache(self.num_blocks)
        if has_full_graphs(mode):
            self._capture_full_graphs(mode, full_allowance)
        # CPU steps of a few tokens (batch-1 decode; verify rows and small decode batches where the linears' kernel
        # takes several rows): the whole forward in one native call where the model's kernels allow it and the
        # attention backend's short rows are the same native kernel on its head-major pool (the Python between
        # ~15 kernel calls per layer was ~40% of a batch-1 step; benchmarks/decode_overhead.py).
        if kernels is not None and self.attention.native_decode_kernels() is kernels:
            self.native_decode = self.model.native_decode_step(kernels, self.kv_caches)
        # Kept decode K/V may hold the backend's workspace_share of the pool's size again (on CPU at least
        # 1 GiB; on CUDA that share is reserved out of --gpu-memory-utilization by _plan_num_blocks).
        bytes_per_token = self.bytes_per_block // self.block_size
        budget = int(self.kv_cache_bytes * self.attention.workspace_share)
        if self.device.type != "cuda":
            budget = max(budget, WORKSPACE_FLOOR_BYTES)
        self.attention.set_workspace_budget(budget // bytes_per_token, self.pp.size)
        self.sampler = Sampler(torch.Generator(device=self.device).manual_seed(config.seed))
        self._last_sampled: Optional[LastSampled] = None  # async scheduling: the last launched step's ids
        logger.info("KV cache: %d blocks of %d tokens (%.1f MiB), attention backend %s", self.num_blocks,
                    self.block_size, self.kv_cache_bytes / 2**20, self.attention.label)

    # ---- KV pool ------------------------------------------------------------------------------
    @property
    def bytes_per_block(self) -> int:
        return self.block_size * kv_bytes_per_token(self.config.model_config, self.config.dtype, self.num_kv_heads,
                                                    len(self.stage_layers))

    @property
    def _planned_bytes_per_block(self) -> int:
        """What one block id costs: this pool's block and the other pool's on the same id."""
        return self.bytes_per_block + self.block_size * self.config.extra_kv_bytes_per_token

    @property
    def kv_cache_bytes(self) -> int:
        return self.num_blocks * self.bytes_per_block

    @property
    def _reserved_bytes_per_block(self) -> int:
        """A block's bytes plus the backend's kept decode K/V for it (its workspace_share of the pool)."""
        return int(self._planned_bytes_per_block * (1.0 + self.attention.workspace_share))

    def _plan_num_blocks(self, peak: int) -> int:
        cfg = self.config
        min_blocks = -(-cfg.max_model_len // self.block_size)
        # More than max_num_seqs full contexts (+1 block each for block alignment) can never be in use.
        usable = cfg.max_num_seqs * (min_blocks + 1)
        if cfg.num_kv_blocks is not None:
            blocks = cfg.num_kv_blocks
        elif self.memory is not None:
            # Capped at `usable`: a tiny model on a 141 GB GPU would otherwise get millions of blocks, one
            # Python object each in the block manager (~1.1 s and 250 MiB per million).
            blocks = min(self._budget_bytes(peak) // self._reserved_bytes_per_block, usable)
        else:
            budget = cfg.kv_cache_memory if cfg.kv_cache_memory is not None else min(
                CPU_DEFAULT_KV_BYTES, usable * self._planned_bytes_per_block)
            blocks = budget // self._planned_bytes_per_block
        blocks = max(int(blocks), 0)
        if blocks < min_blocks:
            raise EngineArgsError(
                f"the KV cache holds {blocks} blocks of {self.block_size} tokens, fewer than one "
                f"{cfg.max_model_len}-token sequence needs ({min_blocks}); raise --kv-cache-memory / "
                "--gpu-memory-utilization / --num-kv-blocks or lower --max-model-len")
        return blocks

    def _budget_bytes(self, peak: int) -> int:
        """Bytes --gpu-memory-utilization leaves for what is not allocated yet, less the profiled peak."""
        free, total = self.memory.free_and_total()
        return (int(total * self.config.gpu_memory_utilization) - (total - free) - peak
                - self.config.extra_reserved_bytes)

    def _capture_graphs(self, graphs: DecodeGraphs, peak: int) -> None:
        """Capture every decode-graph bucket now, within `_graph_allowance`."""
        with torch.inference_mode():
            graphs.capture_all(self._graph_allowance(peak), self.memory.growth if self.memory else _unmeasured)

    def _graph_allowance(self, peak: int) -> Optional[int]:
        """Bytes one set of graphs may take: GRAPH_SHARE of the budget, leaving room for one max_model_len
        sequence's blocks (None where no budget applies, e.g. with --num-kv-blocks: every bucket)."""
        if self.memory is None:
            return None
        budget = self._budget_bytes(peak)
        one_sequence = -(-self.config.max_model_len // self.block_size) * self._reserved_bytes_per_block
        return max(min(budget - one_sequence, int(budget * GRAPH_SHARE)), 0)

    def _capture_full_graphs(self, mode: str, allowance: Optional[int]) -> None:
        """Capture the full decode graphs on the allocated pool within `allowance`; they replay before the
        piecewise ones."""
        cfg = self.config
        full = maybe_full_decode_graphs(self.model, self.attention, self.kv_caches, self.device, cfg.max_num_seqs,
                                        cfg.max_model_len, self.block_size, mode)
        with torch.inference_mode():
            full.capture_all(allowance, self.memory.growth if self.memory else _unmeasured,
                             ranks_agree(cfg.tensor_parallel, self.device))
        self.graphs = GraphDispatch(full, self.graphs)

    def _profile_peak(self) -> int:
        """Peak extra device memory of the worst step: the largest prefill chunk (max_num_batched_tokens, at
        most max_model_len) ending a max_model_len context, so a cached prefix, the masked attention path and
        its K/V gather are in it. Its K/V go to a scratch pool the size of the chunk, which the prefix's block
        table walks round and round (the values do not matter; the shapes do)."""
        cfg = self.config
        tokens = min(cfg.max_num_batched_tokens, cfg.max_model_len)
        scratch_blocks = -(-tokens // self.block_size)
        scratch = self._allocate_kv_cache(scratch_blocks)
        seq = Sequence(-1, "profile", 0, [0] * cfg.max_model_len, params=None)  # type: ignore[arg-type]
        seq.num_computed_tokens = cfg.max_model_len - tokens
        seq.block_table = [i % scratch_blocks for i in range(-(-cfg.max_model_len // self.block_size))]
        try:
            with torch.inference_mode():
                inputs, *_ = self._prepare([ScheduledSeq(seq, tokens)])
                return self.memory.growth(lambda: self._run(inputs, scratch, None, self._stage_input(inputs, False)))
        except torch.cuda.OutOfMemoryError as exc:
            raise EngineArgsError(
                f"out of memory in the profile step ({tokens} new tokens of a {cfg.max_model_len}-token context) "
                "after loading the weights; lower --max-num-batched-tokens or --max-model-len, or raise "
                f"--gpu-memory-utilization: {exc}") from exc
        finally:
            del scratch
            if self.block_table is not None:
                self.block_table.release()  # the profile's scratch row

    def _allocate_kv_cache(self, num_blocks: int) -> list[torch.Tensor]:
        shape = (2, *self.attention.kv_cache_shape(num_blocks, self.block_size))
        layers = len(self.stage_layers)
        if self.device.type == "cpu":  # the attention's scattered block reads: fewer TLB misses in 2 MiB pages
            pools = [huge_page_zeros(shape, self.config.dtype) for _ in range(layers)]
            if all(pool is not None for pool in pools):
                return pools
        return [torch.zeros(shape, dtype=self.config.dtype, device=self.device) for _ in range(layers)]

    # ---- one step -----------------------------------------------------------------------------
    # execute = prepare (the batch as plain tensors, on the driver) -> forward (every rank, on those
    # tensors alone) -> sample (the driver). A multi-rank executor sends `StepInputs` to the other ranks
    # between the first two.
    def execute(self, scheduled: list[ScheduledSeq], rows: list[Optional[SamplingRow]]) -> ModelRunnerOutput:
        """Run the batch: sample every row that finished its known tokens (`rows[i]` says how; a verify
        row is sampled after each of its last k + 1 inputs), and score prompt tokens for the rows that
        asked for prompt log-probs. The output's lists are aligned with `scheduled`."""
        step = self.prepare(scheduled)
        if self._runs_natively(step.inputs, self.kv_caches):
            # one C call on the step's arrays, then a sampler that only reads its logits: no autograd state to
            # switch off, and after a batch-1 step's weight stream entering inference mode took ~40 us of cold caches
            return self._sample(step, self._native_step(step.inputs), rows)
        # inference mode entered once, not again by forward and sample (each entry runs from cold caches)
        with torch.inference_mode():
            return self._sample(step, self._run(step.inputs, self.kv_caches, self.graphs), rows)

    def prepare(self, scheduled: list[ScheduledSeq]) -> "PreparedStep":
        # 1-token rows first: the decode fast paths take the leading ones (CommonAttentionMetadata.num_single)
        order = [s for s in scheduled if s.num_new_tokens == 1] + [s for s in scheduled if s.num_new_tokens > 1]
        inputs, prompt_rows, pool_rows, placeholders = self._prepare(order)
        return PreparedStep(scheduled, order, inputs, prompt_rows, pool_rows, placeholders)

    @torch.inference_mode()
    def forward(self, inputs: "StepInputs") -> Optional[StepLogits]:
        """The logits of the step's sampled (and prompt-scored) positions; every rank runs this. A pipeline
        stage after the first receives its input from the stage before, one before the last sends its output
        on and returns None."""
        out = self._run(inputs, self.kv_caches, self.graphs, self._stage_input(inputs, True))
        if self.pp.is_last:
            return out
        for work in self._sends:  # the previous micro-batch's: by now the next stage is taking it
            work.wait()
        self._sends = self.pp.send(*out)
        return None

    @torch.inference_mode()
    def idle_step(self) -> None:
        """A data-parallel replica's share of a step the others run (experts dealt over the replicas): its MoE
        layers' exchanges with no tokens of its own."""
        self.model.idle_step()

    def _stage_input(self, inputs: "StepInputs", receive: bool) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
        """A later pipeline stage's (hidden, residual) for the step's tokens: received from the stage before,
        or zeros where nothing is sent (the memory profile); None on the first stage."""
        if self.pp.is_first:
            return None
        shape = (inputs.input_ids.numel(), self.config.model_config.hidden_size)
        if receive:
            return tuple(self.pp.receive(2, shape, self.config.dtype, self.device))
        return (torch.zeros(shape, dtype=self.config.dtype, device=self.device),) * 2

    @torch.inference_mode()
    def sample(self, step: "PreparedStep", out: StepLogits, rows: list[Optional[SamplingRow]]) -> ModelRunnerOutput:
        """The tokens of a forward's output (`execute`'s second half, for a multi-rank executor's driver)."""
        return self._sample(step, out, rows)

    def _sample(self, step: "PreparedStep", out: StepLogits, rows: list[Optional[SamplingRow]]) -> ModelRunnerOutput:
        plan = self._sampling_plan(step, rows)
        sampled = None
        if plan.positions:
            logits, argmax = self._sampler_inputs(step, out, plan)
            sampled = self.sampler(logits, plan.positions, plan.drafts, argmax)
        return self._runner_output(step, plan, sampled, self._score_prompts(step, out.logits, len(plan.positions)),
                                   self._pooled_sums(step, out))

    def _sampling_plan(self, step: "PreparedStep", rows: list[Optional[SamplingRow]]) -> SamplingPlan:
        batch_index = {id(item): i for i, item in enumerate(step.scheduled)}
        plan = SamplingPlan([], [], [])
        for item in step.order:
            samples = item.num_samples
            if not samples:
                continue
            owner = batch_index[id(item)]
            row = rows[owner]
            if item.spec_draft_probs is not None:
                plan.drafts.append(DraftSpan(len(plan.positions), item.spec_token_ids, item.spec_draft_probs))
            # Each draft position is sampled as if the drafts before it had been decoded (penalties,
            # min_tokens and logits processors see them).
            plan.positions.append(row)
            plan.positions.extend(replace(row, output_token_ids=row.output_token_ids + item.spec_token_ids[:j])
                                  for j in range(1, samples))
            plan.owners.extend([owner] * samples)
        return plan

    @staticmethod
    def _sampler_inputs(step: "PreparedStep", out: StepLogits,
                        plan: SamplingPlan) -> tuple[torch.Tensor, Optional[list[int]]]:
        """The sampled positions' logits, and their argmax where the forward found them. The logits' rows are the
        sampled positions', then the prompt rows' (no torch call when none: each costs ~15-50 us of cold caches
        after a step's weight stream)."""
        if step.prompt_rows:
            return out.logits[: len(plan.positions)], None
        return out.logits, out.argmax

    @staticmethod
    def _score_prompts(step: "PreparedStep", logits: torch.Tensor, num_sampled: int) -> dict:
        return _prompt_logprobs(logits[num_sampled:], step.prompt_rows) if step.prompt_rows else {}

    @staticmethod
    def _pooled_sums(step: "PreparedStep", out: StepLogits) -> Optional[dict]:
        """Each pooling row's sum of this chunk's hidden states, on the host (None: no pooling rows)."""
        if not step.pool_rows:
            return None
        return {r.seq_id: out.hidden[r.start:r.start + r.count].sum(dim=0).cpu() for r in step.pool_rows if r.count}

    @staticmethod
    def _runner_output(step: "PreparedStep", plan: SamplingPlan, sampled: Optional[SamplerOutput],
                       scored: dict, pooled: Optional[dict]) -> ModelRunnerOutput:
        scheduled = step.scheduled
        result = ModelRunnerOutput([[] for _ in scheduled], [[] for _ in scheduled], [[] for _ in scheduled])
        if sampled is not None:
            logprobs = sampled.logprobs or [None] * len(plan.positions)
            for owner, token, entry in zip(plan.owners, sampled.token_ids, logprobs):
                if token == PLACEHOLDER_TOKEN_ID:
                    continue  # past a rejected draft
                result.sampled_token_ids[owner].append(token)
                result.logprobs[owner].append(entry)
        for i, item in enumerate(scheduled):
            result.prompt_logprobs[i] = scored.get(item.seq.seq_id, [])
        if pooled is not None:
            result.pooled_hidden = [pooled.get(item.seq.seq_id) for item in scheduled]
        return result

    # ---- async scheduling ---------------------------------------------------------------------
    def execute_async(self, scheduled: list[ScheduledSeq], rows: list[Optional[SamplingRow]]) -> AsyncModelRunnerOutput:
        """`execute` without waiting for it: the step's inputs that the step before samples are taken from that
        step's ids on the device, and its own ids stay there for the next; the host reads them from the returned
        output (prompt log-probs, rare, are read now)."""
        step = self.prepare(scheduled)
        with torch.inference_mode():
            self.fill_placeholders(step)
            return self.sample_async(step, self._run(step.inputs, self.kv_caches, self.graphs), rows)

    @torch.inference_mode()
    def sample_async(self, step: "PreparedStep", out: StepLogits,
                     rows: list[Optional[SamplingRow]]) -> AsyncModelRunnerOutput:
        """`execute_async`'s second half (a multi-rank executor's driver): sample on the device, keep the ids for
        the next step's placeholders, and start their copy to the host."""
        plan = self._sampling_plan(step, rows)
        scored = self._score_prompts(step, out.logits, len(plan.positions))
        sample = None
        if plan.positions:
            logits, argmax = self._sampler_inputs(step, out, plan)
            sample = self.sampler.sample(logits, plan.positions, plan.drafts, argmax)
            last = {step.scheduled[owner].seq.seq_id: i for i, owner in enumerate(plan.owners)}
            self._last_sampled = LastSampled(sample.token_ids, last)
        pooled = self._pooled_sums(step, out)  # rare, as prompt log-probs: read now
        return AsyncModelRunnerOutput(sample, lambda sampled: self._runner_output(step, plan, sampled, scored,
                                                                                  pooled))

    @torch.inference_mode()
    def fill_placeholders(self, step: "PreparedStep") -> Optional[torch.Tensor]:
        """Scatter the previous step's sampled ids into this step's input ids where they are its inputs (on
        the device: no transfer; on CPU the input tensor is the host array the native step reads). Returns
        those ids in `step.placeholders`' order, on the device (what a multi-rank driver sends the other
        ranks); None where the step has no placeholder."""
        if not step.placeholders:
            return None
        last = self._last_sampled
        missing = [seq_id for _, seq_id in step.placeholders if last is None or seq_id not in last.index]
        if missing:
            raise RuntimeError(f"async scheduling: no sampled token in flight for sequence(s) {missing}")
        sources = self._tensor([last.index[seq_id] for _, seq_id in step.placeholders])
        ids = last.token_ids.to(self.device)[sources]
        self.scatter_placeholders(step.inputs, self._tensor([row for row, _ in step.placeholders]), ids)
        return ids

    @torch.inference_mode()
    def scatter_placeholders(self, inputs: "StepInputs", rows: torch.Tensor, ids: torch.Tensor) -> None:
        """Write `ids` into the input token rows `rows` (every rank: the driver's own sampled ids, or on the
        other ranks the ones it sent)."""
        inputs.input_ids[rows] = ids

    @torch.inference_mode()
    def sample_logits(self, scheduled: list[ScheduledSeq]) -> torch.Tensor:
        """Run the batch and return the logits after the last input of each row that samples, in
        `scheduled`'s order ([rows that sample, vocab]), for a caller that draws the tokens itself (the
        draft proposer). Rows that verify drafts or want prompt log-probs are not for this."""
        step = self.prepare(scheduled)
        logits = self.forward(step.inputs).logits
        sampling = [item for item in step.order if item.num_samples]
        index = {id(item): i for i, item in enumerate(sampling)}
        return logits[[index[id(item)] for item in scheduled if item.num_samples]]

    def _runs_natively(self, inputs: "StepInputs", kv_caches: list[torch.Tensor]) -> bool:
        return (self.native_decode is not None and inputs.pooling_indices is None and inputs.host is not None
                and kv_caches is self.kv_caches and self.native_decode.can_run(inputs.query_lens, NATIVE_MAX_QUERY))

    def _native_step(self, inputs: "StepInputs") -> StepLogits:
        host = inputs.host
        return StepLogits(*self.native_decode(host.input_ids, host.positions, host.slot_mapping, inputs.block_tables,
                                              inputs.context_lens, inputs.query_lens, host.logits_indices))

    def _run(self, inputs: "StepInputs", kv_caches: list[torch.Tensor], graphs: "DecodeGraphs | GraphDispatch | None",
             intermediate: Optional[tuple[torch.Tensor, torch.Tensor]] = None):
        """The step's logits; a pipeline stage before the last: its (hidden, residual)."""
        if not self.pp.is_single:
            meta = self.attention.build_metadata(inputs.attention_batch(self.block_size, self.block_table))
            out = self.model(inputs.input_ids, inputs.positions, kv_caches, meta, self.attention,
                             inputs.logits_indices, intermediate)
            return StepLogits(out) if self.pp.is_last else out
        if self._runs_natively(inputs, kv_caches):
            return self._native_step(inputs)
        batch = inputs.attention_batch(self.block_size, self.block_table)
        if inputs.pooling_indices is None and graphs is not None and graphs.can_run(batch, kv_caches):
            return StepLogits(graphs.run(inputs.input_ids, inputs.positions, kv_caches, batch, inputs.logits_indices))
        meta = self.attention.build_metadata(batch)
        if inputs.pooling_indices is not None:  # hidden states come from the eager forward only
            logits, hidden = self.model(inputs.input_ids, inputs.positions, kv_caches, meta, self.attention,
                                        inputs.logits_indices, pooling_indices=inputs.pooling_indices)
            return StepLogits(logits, hidden=hidden)
        return StepLogits(self.model(inputs.input_ids, inputs.positions, kv_caches, meta, self.attention,
                                     inputs.logits_indices))

    def _prepare(self, order: list[ScheduledSeq]) -> tuple["StepInputs", list[PromptRow], list[PoolRow],
                                                           list[tuple[int, int]]]:
        """Token ids, positions, slot mapping and logits indices of the batch, its rows (query and context
        lengths, block tables), the prompt tokens to score, the pooling rows' hidden states to read, and the
        inputs the step in flight samples."""
        bs = self.block_size
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        logits_indices: list[int] = []
        query_lens: list[int] = []
        context_lens: list[int] = []
        prompt_rows: list[PromptRow] = []
        placeholders: list[tuple[int, int]] = []
        pooling_indices: list[int] = []
        pool_rows: list[PoolRow] = []
        for item in order:
            seq, start = item.seq, item.start
            end = start + item.num_new_tokens
            row = len(ids)
            ids.extend(item.input_token_ids)
            if len(ids) - row < item.num_new_tokens:  # ends at the token the step in flight samples
                placeholders.append((len(ids), seq.seq_id))
                ids.append(0)
            positions.extend(range(start, end))
            table = seq.block_table
            slots.extend(table[p // bs] * bs + p % bs for p in range(start, end))
            query_lens.append(item.num_new_tokens)
            context_lens.append(end)
            logits_indices.extend(range(len(ids) - item.num_samples, len(ids)))
            wanted = seq.params.prompt_logprobs if seq.params is not None else None
            if wanted is not None:
                last = min(end, seq.num_prompt_tokens - 1)
                prompt_rows.extend(PromptRow(seq.seq_id, row + p - start, p + 1, seq.token_ids[p + 1], wanted)
                                   for p in range(start, last))
            if seq.pooling is not None:
                read = seq.pooling.positions(start, end, seq.num_prompt_tokens)
                pool_rows.append(PoolRow(seq.seq_id, len(pooling_indices), len(read)))
                pooling_indices.extend(row + p - start for p in read)
        logits_indices.extend(r.row for r in prompt_rows)
        vectors = (ids, positions, slots, logits_indices)
        host = HostVectors(*((array("q", values) for values in vectors) if self._on_cpu else vectors))
        inputs = StepInputs(*(self._tensor(values) for values in host), [s.seq.seq_id for s in order],
                            query_lens, context_lens, [s.seq.block_table for s in order], host,
                            self._pooling_tensor(pooling_indices))
        return inputs, prompt_rows, pool_rows, placeholders

    def _pooling_tensor(self, rows: list[int]) -> Optional[torch.Tensor]:
        if not rows:
            return None
        return self._tensor(array("q", rows) if self._on_cpu else rows)

    def _tensor(self, values: "array | list[int]") -> torch.Tensor:
        if self._on_cpu:
            if isinstance(values, array) and values:
                # a view of the array, not torch.tensor's walk over a Python list (cold caches after a weight stream)
                return torch.frombuffer(values, dtype=torch.long)
            return torch.tensor(values, dtype=torch.long)
        # staged in pinned memory (the caching host allocator keeps it until the copy ran): no stream sync
        staged = torch.tensor(values, dtype=torch.long, pin_memory=self.device.type == "cuda")
        return staged.to(self.device, non_blocking=True)

    def truncate_kept_state(self, seq_id: int, num_tokens: int) -> None:
        """Only the sequence's first `num_tokens` K/V still hold (rejected drafts rolled back)."""
        self.attention.truncate(seq_id, num_tokens)

    def release_kept_state(self) -> None:
        """Drop what is kept between steps: the attention backend's (the torch backend's decode K/V) and the
        persistent block table's rows."""
        self.attention.release()
        if self.block_table is not None:
            self.block_table.release()

    def make_generator(self, seed: int) -> torch.Generator:
        return torch.Generator(device=self.device).manual_seed(seed)
