"""Piecewise CUDA graphs for decode steps.

A decode step launches a few hundred small kernels whose launch cost exceeds their work at small
batches. Attention is the one op whose shapes follow each sequence's context length, so it stays
eager; everything around it is captured: embedding + layer 0's pre-attention half, then for each
layer its post-attention half fused with the next layer's pre-attention half, and finally the
last post-attention half + norm + lm_head. One set of graphs per batch-size bucket, captured on
first use into one shared memory pool; a batch is padded to its bucket (pad rows compute rows
nobody reads; their attention output is left as it was).

`capture` and `new_pool` are injectable so the bookkeeping runs (and is tested) without CUDA;
on CUDA they are `torch.cuda.graph` capture and `torch.cuda.graph_pool_handle`.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch

from llmctl.engine.layers.attention import AttentionMetadata

logger = logging.getLogger(__name__)

Piece = Callable[[], None]


def cuda_capture(piece: Piece, pool: Any) -> Any:
    """Record `piece` into a CUDA graph drawing on `pool`; the graph's `replay()` reruns it."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        piece()
    return graph


def batch_buckets(max_batch: int) -> list[int]:
    """1, 2, 4, 8, then every 16 up to max_batch (vLLM's spacing), always including max_batch."""
    sizes = [size for size in (1, 2, 4, 8) if size < max_batch] + list(range(16, max_batch, 16))
    return sorted(set(sizes + [max_batch]))


@dataclass
class _Bucket:
    """Static tensors of one batch size: inputs written before replay, outputs the graphs refill."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    attended: list[torch.Tensor]  # per layer: [rows, heads, head_dim], written by eager attention
    values: dict[str, Any] = field(default_factory=dict)  # piece outputs: rope, residual, q/k/v, logits
    graphs: list[Any] = field(default_factory=list)


class DecodeGraphs:
    """Captures and replays the model's decode steps in pieces around eager attention."""

    def __init__(self, model: torch.nn.Module, backend, max_batch: int, device: torch.device, dtype: torch.dtype,
                 capture: Callable[[Piece, Any], Any] = cuda_capture,
                 new_pool: Callable[[], Any] = lambda: torch.cuda.graph_pool_handle()):
        self.model, self.backend, self.device, self.dtype = model, backend, device, dtype
        self.buckets = batch_buckets(max_batch)
        self._capture, self._pool = capture, new_pool()
        self._captured: dict[int, _Bucket] = {}

    def can_run(self, num_tokens: int, meta: AttentionMetadata) -> bool:
        """Decode-only batches (every row one new token, no prefill) up to the largest bucket."""
        return not meta.prefills and meta.num_single == num_tokens and 0 < num_tokens <= self.buckets[-1]

    @property
    def num_captured(self) -> int:
        return len(self._captured)

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
            meta: AttentionMetadata, logits_indices: torch.Tensor) -> torch.Tensor:
        rows = input_ids.shape[0]
        size = next(b for b in self.buckets if b >= rows)
        bucket = self._captured.get(size) or self._capture_bucket(size)
        bucket.input_ids[:rows].copy_(input_ids)
        bucket.input_ids[rows:].zero_()
        bucket.positions[:rows].copy_(positions)
        bucket.positions[rows:].zero_()
        layers = self.model.model.layers
        for index, graph in enumerate(bucket.graphs):
            graph.replay()
            if index < len(layers):  # attention of layer `index`, on the real rows only
                q, k, v = (bucket.values[f"{name}{index}"][:rows] for name in "qkv")
                cache = kv_caches[index]
                bucket.attended[index][:rows].copy_(self.backend.forward(q, k, v, cache[0], cache[1], meta))
        return bucket.values["logits"][:rows][logits_indices]

    # ---- capture ----------------------------------------------------------------------------------
    def _capture_bucket(self, size: int) -> _Bucket:
        config = self.model.config
        zeros = dict(dtype=torch.long, device=self.device)
        bucket = _Bucket(
            input_ids=torch.zeros(size, **zeros), positions=torch.zeros(size, **zeros),
            attended=[torch.zeros(size, config.num_heads, config.head_dim, dtype=self.dtype, device=self.device)
                      for _ in self.model.model.layers])
        pieces = self._pieces(bucket)
        self._warm_up(pieces)
        bucket.graphs = [self._capture(piece, self._pool) for piece in pieces]
        self._captured[size] = bucket
        logger.info("captured decode graphs for batch size %d (%d pieces)", size, len(pieces))
        return bucket

    def _warm_up(self, pieces: list[Piece]) -> None:
        """Run each piece once outside capture (library handles and workspaces get created), on a
        side stream as torch's CUDA graph notes ask."""
        if self.device.type != "cuda":
            for piece in pieces:
                piece()
            return
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for piece in pieces:
                piece()
        torch.cuda.current_stream(self.device).wait_stream(stream)

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


def maybe_decode_graphs(model: torch.nn.Module, backend, device: torch.device, dtype: torch.dtype,
                        max_num_seqs: int, enforce_eager: bool) -> Optional[DecodeGraphs]:
    """Decode graphs on CUDA unless `enforce_eager`; None elsewhere."""
    if device.type != "cuda" or enforce_eager:
        return None
    return DecodeGraphs(model, backend, min(max_num_seqs, 256), device, dtype)
