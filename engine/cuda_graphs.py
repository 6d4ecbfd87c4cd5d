"""Piecewise CUDA graphs for decode steps.

A decode step launches a few hundred small kernels whose launch cost exceeds their work at small
batches. Attention is the one op whose shapes follow each sequence's context length, so it stays
eager; everything around it is captured: embedding + layer 0's pre-attention half, then for each
layer its post-attention half fused with the next layer's pre-attention half, and finally the
last post-attention half + norm + lm_head. One set of graphs per batch-size bucket, all captured at
start-up (`capture_all`, smallest bucket first, within the memory the runner allows) into one shared
memory pool; a batch is padded to the smallest captured bucket that holds it (pad rows compute rows
nobody reads; their attention output is left as it was), and runs eagerly when none does.

`capturer` is injectable so the bookkeeping runs (and is tested) without CUDA; on CUDA it is
`CudaCapturer`: `torch.cuda.graph` capture on a stream of the engine's device.
"""

from __future__ import annotations

import logging
import time
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
                 capturer: Any = None):
        self.model, self.backend, self.device, self.dtype = model, backend, device, dtype
        self.buckets = batch_buckets(max_batch)
        self._capturer = capturer if capturer is not None else CudaCapturer(device)
        self._captured: dict[int, _Bucket] = {}

    def can_run(self, batch: CommonAttentionMetadata) -> bool:
        """Decode-only batches (every row one query token) that fit a captured bucket. A batch with any row of
        several query tokens (a prefill chunk, a k+1-token verify row) runs eagerly: the graphs' static
        tensors are sized in rows of one token each."""
        return batch.decode_only and self._bucket_for(batch.num_rows) is not None

    @property
    def num_captured(self) -> int:
        return len(self._captured)

    @property
    def captured_sizes(self) -> list[int]:
        return sorted(self._captured)

    def _bucket_for(self, rows: int) -> Optional[int]:
        return next((size for size in sorted(self._captured) if size >= rows), None)

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
            meta: Any, logits_indices: torch.Tensor) -> torch.Tensor:
        """Replay a batch `can_run` took; `meta` is the backend's metadata for it."""
        rows = input_ids.shape[0]
        bucket = self._captured[self._bucket_for(rows)]
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
                bucket.attended[index][:rows].copy_(
                    self.backend.forward(q, k, v, cache[0], cache[1], meta, layers[index].self_attn.window))
        return bucket.values["logits"][:rows][logits_indices]

    # ---- capture ----------------------------------------------------------------------------------
    def capture_all(self, allowance: Optional[int], measure: Callable[[Callable[[], object]], int]) -> int:
        """Capture every bucket, smallest first, while the next one is expected to fit in `allowance`
        bytes (None: no limit); `measure(work)` returns the bytes `work` took. A bucket whose capture
        fails runs eagerly; out of memory, or a capture that took more than was left, stops capturing
        (that bucket is dropped). Returns the bytes the kept graphs took."""
        started, spent, last = time.monotonic(), 0, None  # last: (size, bytes) of the last capture
        for size in self.buckets:
            # A bucket's graphs hold its rows' static outputs, so their memory grows with the batch size.
            expected = last[1] * size // last[0] if last else 0
            if allowance is not None and (allowance <= 0 or spent + expected > allowance):
                logger.info("decode graphs: batch sizes from %d run eagerly (%.0f MiB of %.0f MiB allowed for "
                            "graphs already used)", size, spent / 2**20, max(allowance, 0) / 2**20)
                break
            try:
                cost = measure(lambda: self._capture_bucket(size))
            except torch.cuda.OutOfMemoryError as exc:
                self._captured.pop(size, None)
                logger.warning("decode graphs: out of memory capturing batch size %d; it and larger ones run "
                               "eagerly (%s)", size, exc)
                break
            except RuntimeError as exc:
                self._captured.pop(size, None)
                logger.warning("decode graphs: capturing batch size %d failed, it runs eagerly: %s", size, exc)
                continue
            if allowance is not None and spent + cost > allowance:  # the first capture's cost is not known before
                del self._captured[size]
                logger.info("decode graphs: batch size %d took %.0f MiB, over the %.0f MiB allowed; batch sizes from "
                            "%d run eagerly", size, cost / 2**20, allowance / 2**20, size)
                break
            spent, last = spent + cost, (size, cost)
        logger.info("captured decode graphs for %d batch sizes (%s) in %.1f s, %.0f MiB", len(self._captured),
                    ", ".join(map(str, self.captured_sizes)) or "none", time.monotonic() - started, spent / 2**20)
        return spent

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


def maybe_decode_graphs(model: torch.nn.Module, backend, device: torch.device, dtype: torch.dtype,
                        max_num_seqs: int, enforce_eager: bool) -> Optional[DecodeGraphs]:
    """Decode graphs (nothing captured yet) on CUDA unless `enforce_eager`; None elsewhere."""
    if device.type != "cuda" or enforce_eager:
        return None
    return DecodeGraphs(model, backend, min(max_num_seqs, 256), device, dtype)
