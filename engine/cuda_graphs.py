"""CUDA graphs for decode steps: piecewise around eager attention, or the whole step (full decode graphs).

A decode step launches a few hundred small kernels whose launch cost exceeds their work at small
batches. Attention is the one op whose shapes follow each sequence's context length, so it stays
eager; everything around it is captured: embedding + layer 0's pre-attention half, then for each
layer its post-attention half fused with the next layer's pre-attention half, and finally the
last post-attention half + norm + lm_head. One set of graphs per batch-size bucket, all captured at
start-up (`capture_all`, smallest bucket first, within the memory the runner allows) into one shared
memory pool; a batch is padded to the smallest captured bucket that holds it (pad rows compute rows
nobody reads; their attention output is left as it was), and runs eagerly when none does.

Full decode graphs (`FullDecodeGraphs`, vLLM's FULL cudagraph mode) capture a decode step whole, attention and
KV writes included, on a backend whose decode metadata can live in static tensors (`supports_full_graphs`: the
Triton backend, block tables padded to max_model_len's blocks, a key-split plan fixed per bucket). They need the
KV pool, so they are captured after it is allocated. `cudagraph_mode` (EngineArgs) picks which sets exist; a
step replays the first set that takes it (`GraphDispatch`), else runs eagerly. With tensor parallelism only full
graphs are captured, NCCL collectives inside, every capture decision agreed by all ranks (their warm-ups run the
collectives together; every rank then replays the same buckets).

`capturer` is injectable so the bookkeeping runs (and is tested) without CUDA; on CUDA it is
`CudaCapturer`: `torch.cuda.graph` capture on a stream of the engine's device.
"""

from __future__ import annotations

import logging
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch

from llmctl.engine.layers.attention import CommonAttentionMetadata

logger = logging.getLogger(__name__)

Piece = Callable[[], None]


class CudaCapturer:
    """Records pieces into CUDA graphs drawing on one memory pool, on a stream of `device`.

    The stream is explicit: without `stream=`, `torch.cuda.graph` captures on one class-wide stream
    created on whichever device was current the first time, so on any other GPU (`--device cuda:1`)
    the graph records nothing and every replay is a no-op (torch only warns "The CUDA Graph is empty").
    """

    def __init__(self, device: torch.device):
        self.device = device
        self.stream = torch.cuda.Stream(device)
        self.pool = torch.cuda.graph_pool_handle()

    def warm_up(self, pieces: list[Piece]) -> None:
        """Run each piece once outside capture (library handles and workspaces get created), on the
        capture stream, a side stream as torch's CUDA graph notes ask."""
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            for piece in pieces:
                piece()
        torch.cuda.current_stream(self.device).wait_stream(self.stream)

    def __call__(self, piece: Piece) -> Any:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.device(self.device), torch.cuda.graph(graph, pool=self.pool, stream=self.stream):
            piece()
        return graph


def batch_buckets(max_batch: int) -> list[int]:
    """1, 2, 4, 8, then every 16 up to max_batch (vLLM's spacing), always including max_batch."""
    sizes = [size for size in (1, 2, 4, 8) if size < max_batch] + list(range(16, max_batch, 16))
    return sorted(set(sizes + [max_batch]))


class _GraphBuckets(ABC):
    """Graphs per batch-size bucket, captured smallest first within a memory allowance; a batch replays the
    smallest captured bucket that holds it. A subclass captures one bucket (`_capture_bucket`)."""

    kind = "decode graphs"  # as the start-up log names the set

    def __init__(self, max_batch: int, device: torch.device, capturer: Any = None):
        self.device = device
        self.buckets = batch_buckets(max_batch)
        self._capturer = capturer if capturer is not None else CudaCapturer(device)
        self._captured: dict[int, Any] = {}

    @property
    def num_captured(self) -> int:
        return len(self._captured)

    @property
    def captured_sizes(self) -> list[int]:
        return sorted(self._captured)

    def _bucket_for(self, rows: int) -> Optional[int]:
        return next((size for size in sorted(self._captured) if size >= rows), None)

    @abstractmethod
    def _capture_bucket(self, size: int) -> None:
        """Capture one batch-size bucket's graph(s) into `self._captured[size]`."""

    def capture_all(self, allowance: Optional[int], measure: Callable[[Callable[[], object]], int],
                    agree: Optional[Callable[[bool], bool]] = None) -> int:
        """Capture every bucket, smallest first, while the next one is expected to fit in `allowance`
        bytes (None: no limit); `measure(work)` returns the bytes `work` took. A bucket whose capture
        fails runs eagerly; out of memory, or a capture that took more than was left, stops capturing
        (that bucket is dropped). Returns the bytes the kept graphs took. With `agree(flag)` (tensor-parallel
        ranks: whether the flag holds on every rank) each memory decision is the same on every rank, whose
        warm-ups run collectives together, and a failed capture fails start-up instead."""
        together = agree is not None
        agree = agree or (lambda flag: flag)
        started, spent, last = time.monotonic(), 0, None  # last: (size, bytes) of the last capture
        for size in self.buckets:
            # A bucket's graphs hold its rows' static outputs, so their memory grows with the batch size.
            expected = last[1] * size // last[0] if last else 0
            if not agree(allowance is None or (allowance > 0 and spent + expected <= allowance)):
                logger.info("%s: batch sizes from %d run eagerly (%.0f MiB of %.0f MiB allowed for graphs "
                            "already used)", self.kind, size, spent / 2**20, max(allowance or 0, 0) / 2**20)
                break
            try:
                cost = measure(lambda: self._capture_bucket(size))
            except RuntimeError as exc:  # torch.cuda.OutOfMemoryError included
                self._captured.pop(size, None)
                if together:
                    raise RuntimeError(f"{self.kind}: capturing batch size {size} failed on this tensor-parallel "
                                       f"rank, whose ranks capture alike (--cudagraph-mode none runs eagerly): "
                                       f"{exc}") from exc
                if isinstance(exc, torch.cuda.OutOfMemoryError):
                    logger.warning("%s: out of memory capturing batch size %d; it and larger ones run "
                                   "eagerly (%s)", self.kind, size, exc)
                    break
                logger.warning("%s: capturing batch size %d failed, it runs eagerly: %s", self.kind, size, exc)
                continue
            if not agree(allowance is None or spent + cost <= allowance):  # the first capture's cost is unknown before
                del self._captured[size]
                logger.info("%s: batch size %d took %.0f MiB, over the %.0f MiB allowed; batch sizes from "
                            "%d run eagerly", self.kind, size, cost / 2**20, (allowance or 0) / 2**20, size)
                break
            spent, last = spent + cost, (size, cost)
        logger.info("captured %s for %d batch sizes (%s) in %.1f s, %.0f MiB", self.kind, len(self._captured),
                    ", ".join(map(str, self.captured_sizes)) or "none", time.monotonic() - started, spent / 2**20)
        return spent


def _fill(static: torch.Tensor, values: torch.Tensor) -> None:
    """A bucket's static input: the batch's values, zeros in the pad rows."""
    rows = values.shape[0]
    static[:rows].copy_(values)
    static[rows:].zero_()


@dataclass
class _Bucket:
    """Static tensors of one batch size: inputs written before replay, outputs the graphs refill."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    attended: list[torch.Tensor]  # per layer: [rows, heads, head_dim], written by eager attention
    values: dict[str, Any] = field(default_factory=dict)  # piece outputs: rope, residual, q/k/v, logits
    graphs: list[Any] = field(default_factory=list)


class DecodeGraphs(_GraphBuckets):
    """Captures and replays the model's decode steps in pieces around eager attention."""

    def __init__(self, model: torch.nn.Module, backend, max_batch: int, device: torch.device, dtype: torch.dtype,
                 capturer: Any = None):
        super().__init__(max_batch, device, capturer)
        self.model, self.backend, self.dtype = model, backend, dtype

    def can_run(self, batch: CommonAttentionMetadata, kv_caches: Optional[list[torch.Tensor]] = None) -> bool:
        """Decode-only batches (every row one query token) that fit a captured bucket. A batch with any row of
        several query tokens (a prefill chunk, a k+1-token verify row) runs eagerly: the graphs' static
        tensors are sized in rows of one token each. Attention runs eagerly, on whichever pool is given."""
        return batch.decode_only and self._bucket_for(batch.num_rows) is not None

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
            batch: CommonAttentionMetadata, logits_indices: torch.Tensor) -> torch.Tensor:
        """Replay a batch `can_run` took."""
        rows = input_ids.shape[0]
        bucket = self._captured[self._bucket_for(rows)]
        meta = self.backend.build_metadata(batch)
        _fill(bucket.input_ids, input_ids)
        _fill(bucket.positions, positions)
        layers = self.model.model.layers
        for index, graph in enumerate(bucket.graphs):
            graph.replay()
            if index < len(layers):  # attention of layer `index`, on the real rows only
                q, k, v = (bucket.values[f"{name}{index}"][:rows] for name in "qkv")
                cache = kv_caches[index]
                bucket.attended[index][:rows].copy_(
                    self.backend.forward(q, k, v, cache[0], cache[1], meta, layers[index].self_attn.window))
        return bucket.values["logits"][:rows][logits_indices]

    # ---- capture ----------------------------------------------------------------------------------
    def _capture_bucket(self, size: int) -> None:
        config = self.model.config
        zeros = dict(dtype=torch.long, device=self.device)
        bucket = _Bucket(
            input_ids=torch.zeros(size, **zeros), positions=torch.zeros(size, **zeros),
            attended=[torch.zeros(size, config.num_heads, config.head_dim, dtype=self.dtype, device=self.device)
                      for _ in self.model.model.layers])
        pieces = self._pieces(bucket)
        self._capturer.warm_up(pieces)
        bucket.graphs = [self._capturer(piece) for piece in pieces]
        self._captured[size] = bucket

    def _pieces(self, bucket: _Bucket) -> list[Piece]:
        model, values = self.model, bucket.values
        layers = model.model.layers

        def keep(index: int, q, k, v, residual) -> None:
            values.update({f"q{index}": q, f"k{index}": k, f"v{index}": v, "residual": residual})

        def first() -> None:
            hidden, values["rope"] = model.embed(bucket.input_ids, bucket.positions)
            keep(0, *layers[0].pre_attention(values["rope"], hidden, None))

        def between(index: int) -> Piece:  # layer index-1's second half, then layer index's first half
            def piece() -> None:
                hidden, residual = layers[index - 1].post_attention(bucket.attended[index - 1], values["residual"])
                keep(index, *layers[index].pre_attention(values["rope"], hidden, residual))
            return piece

        def last() -> None:
            hidden, residual = layers[-1].post_attention(bucket.attended[-1], values["residual"])
            values["logits"] = model.logits(hidden, residual)

        return [first] + [between(index) for index in range(1, len(layers))] + [last]


@dataclass
class _FullBucket:
    """Static tensors of one batch size for a whole-step graph: inputs and attention metadata written before
    replay, the logits the graph refills."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    logits_rows: torch.Tensor  # 0..size-1: every row's logits (the pad rows' are never read)
    meta: Any  # the backend's static decode metadata
    logits: Optional[torch.Tensor] = None
    graph: Any = None


class FullDecodeGraphs(_GraphBuckets):
    """Captures and replays whole decode steps (embedding, every layer with its attention and KV write, norm,
    lm_head) as one graph per bucket, on the KV pool `kv_caches` and a backend with `supports_full_graphs`."""

    kind = "full decode graphs"

    def __init__(self, model: torch.nn.Module, backend, kv_caches: list[torch.Tensor], max_batch: int,
                 max_context_len: int, block_size: int, device: torch.device, capturer: Any = None):
        if not backend.supports_full_graphs:
            raise ValueError(f"full decode graphs need static attention metadata; the {backend.name} backend "
                             "has none")
        super().__init__(max_batch, device, capturer)
        self.model, self.backend, self.kv_caches = model, backend, kv_caches
        self.max_context_len, self.block_size = max_context_len, block_size

    def can_run(self, batch: CommonAttentionMetadata, kv_caches: Optional[list[torch.Tensor]] = None) -> bool:
        """Decode-only batches on the captured pool (the graphs hold its addresses) that fit a captured bucket."""
        return (batch.decode_only and kv_caches is self.kv_caches and batch.block_size == self.block_size
                and max(batch.context_lens) <= self.max_context_len and self._bucket_for(batch.num_rows) is not None)

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
            batch: CommonAttentionMetadata, logits_indices: torch.Tensor) -> torch.Tensor:
        """Replay a batch `can_run` took: its rows into the bucket's static tensors, pad rows as rows of no keys
        whose K/V go nowhere, then the logits of the real rows."""
        bucket = self._captured[self._bucket_for(batch.num_rows)]
        _fill(bucket.input_ids, input_ids)
        _fill(bucket.positions, positions)
        self.backend.fill_decode_metadata(bucket.meta, batch)
        bucket.graph.replay()
        return bucket.logits[:batch.num_rows][logits_indices]

    def _capture_bucket(self, size: int) -> None:
        longs = dict(dtype=torch.long, device=self.device)
        bucket = _FullBucket(
            input_ids=torch.zeros(size, **longs), positions=torch.zeros(size, **longs),
            logits_rows=torch.arange(size, **longs),
            meta=self.backend.static_decode_metadata(size, self.max_context_len, self.block_size, self.device))

        def step() -> None:
            bucket.logits = self.model(bucket.input_ids, bucket.positions, self.kv_caches, bucket.meta,
                                       self.backend, bucket.logits_rows)

        self._capturer.warm_up([step])  # every row a pad row: nothing written to the pool, nothing read
        bucket.graph = self._capturer(step)
        self._captured[size] = bucket


class GraphDispatch:
    """The graph sets a step may replay, in order of preference (full decode graphs, then piecewise ones):
    the first that takes the batch replays it."""

    def __init__(self, *graph_sets):
        self.graph_sets = [graphs for graphs in graph_sets if graphs is not None]

    def can_run(self, batch: CommonAttentionMetadata, kv_caches: Optional[list[torch.Tensor]] = None) -> bool:
        return any(graphs.can_run(batch, kv_caches) for graphs in self.graph_sets)

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
            batch: CommonAttentionMetadata, logits_indices: torch.Tensor) -> torch.Tensor:
        graphs = next(graphs for graphs in self.graph_sets if graphs.can_run(batch, kv_caches))
        return graphs.run(input_ids, positions, kv_caches, batch, logits_indices)


def has_full_graphs(mode: str) -> bool:
    return mode in ("full_decode_only", "full_and_piecewise")


def resolve_cudagraph_mode(mode: str, device: torch.device, backend, enforce_eager: bool,
                           tensor_parallel_size: int = 1, pipeline_parallel_size: int = 1) -> str:
    """The graphs a runner captures for `--cudagraph-mode`: none off CUDA, with --enforce-eager or pipeline stages
    (their sends run between forwards); with tensor parallelism the full graphs only (NCCL collectives captured
    inside them; the piecewise pieces' collectives never were). A full mode on a backend without static decode
    metadata keeps its mixed part (full_and_piecewise: piecewise; full_decode_only: none), as vLLM does."""
    if device.type != "cuda" or enforce_eager or pipeline_parallel_size > 1:
        return "none"
    if has_full_graphs(mode) and not backend.supports_full_graphs:
        fallback = "piecewise" if mode == "full_and_piecewise" else "none"
        logger.warning("--cudagraph-mode %s: the %s attention backend cannot run inside a full graph (its decode "
                       "metadata follows each step); using %s", mode, backend.name, fallback)
        mode = fallback
    if tensor_parallel_size > 1:
        return "full_decode_only" if has_full_graphs(mode) else "none"
    return mode


def ranks_agree(tp, device: torch.device) -> Optional[Callable[[bool], bool]]:
    """With several tensor-parallel ranks: `agree(flag)`, whether `flag` holds on every rank (one all-reduce);
    None on one rank."""
    if tp.is_single:
        return None

    def agree(flag: bool) -> bool:
        return int(tp.all_reduce(torch.tensor([0 if flag else 1], device=device)).item()) == 0

    return agree


def _model_runs_eagerly(model: torch.nn.Module) -> bool:
    """A model whose step does host work graphs cannot hold (e.g. quantised experts grouped by expert on the
    host) says why in `eager_reason`."""
    reason = getattr(model, "eager_reason", None)
    if reason:
        logger.info("decode graphs: off (%s); every step runs eagerly", reason)
    return bool(reason)


def maybe_decode_graphs(model: torch.nn.Module, backend, device: torch.device, dtype: torch.dtype,
                        max_num_seqs: int, mode: str, capturer: Any = None) -> Optional[DecodeGraphs]:
    """Piecewise decode graphs (nothing captured yet) where the resolved `mode` has them; None elsewhere."""
    if mode not in ("piecewise", "full_and_piecewise") or _model_runs_eagerly(model):
        return None
    return DecodeGraphs(model, backend, min(max_num_seqs, 256), device, dtype, capturer)


def maybe_full_decode_graphs(model: torch.nn.Module, backend, kv_caches: list[torch.Tensor], device: torch.device,
                             max_num_seqs: int, max_model_len: int, block_size: int,
                             mode: str, capturer: Any = None) -> Optional[FullDecodeGraphs]:
    """Full decode graphs (nothing captured yet) on the allocated pool where the resolved `mode` has them."""
    if not has_full_graphs(mode) or _model_runs_eagerly(model):
        return None
    return FullDecodeGraphs(model, backend, kv_caches, min(max_num_seqs, 256), max_model_len, block_size, device,
                            capturer)
