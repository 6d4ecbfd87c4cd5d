"""The microbenchmarks behind `llmctl bench --gpu/--cpu`, each returning raw per-repetition rates.

Measurement rules kept by every function here: a timed warm-up before the repetitions (clocks
ramp up, lazy kernel selection happens), per-repetition timing (CUDA events on GPU,
`perf_counter` on CPU), random non-zero inputs, and rotating input sets whose total size
exceeds the last-level cache so no repetition reads what the previous one left in cache.
Nothing here touches clocks, power limits or any other device setting.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F

from llmctl.bench.shapes import ModelShape
from llmctl.output import format_bytes

GEMM_DTYPES = {"fp32": torch.float32, "tf32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass
class Measured:
    """Per-repetition rates of one benchmark; `peak_key`/`peak_scale` say how to derive its peak
    from a datasheet (peak = spec.peak(peak_key) * peak_scale)."""

    name: str
    label: str
    unit: str
    values: list[float]
    params: dict[str, Any] = field(default_factory=dict)
    peak_key: Optional[str] = None
    peak_scale: float = 1.0


class Timer:
    """Wall-clock timer for CPU work: `perf_counter` around each call."""

    def __init__(self, warmup_s: float, reps: int):
        self.warmup_s = warmup_s
        self.reps = reps

    def sync(self) -> None:
        pass

    def warmup(self, fn: Callable[[int], Any]) -> None:
        """At least two calls, then keep calling until warmup_s has passed."""
        start, i = time.perf_counter(), 0
        while i < 2 or time.perf_counter() - start < self.warmup_s:
            fn(i)
            i += 1
            if i % 4 == 0:
                self.sync()
        self.sync()

    def time(self, fn: Callable[[int], Any]) -> list[float]:
        self.warmup(fn)
        seconds = []
        for i in range(self.reps):
            start = time.perf_counter()
            fn(i)
            self.sync()
            seconds.append(time.perf_counter() - start)
        return seconds


class CudaTimer(Timer):
    """CUDA events around each call on the current stream; repetitions are queued back to back so
    the GPU never idles between them, and the host synchronises once at the end."""

    def __init__(self, warmup_s: float, reps: int, device: torch.device):
        super().__init__(warmup_s, reps)
        self.device = device

    def sync(self) -> None:
        torch.cuda.synchronize(self.device)

    def time(self, fn: Callable[[int], Any]) -> list[float]:
        with torch.cuda.device(self.device):  # events record on the current device's stream
            return self._time(fn)

    def _time(self, fn: Callable[[int], Any]) -> list[float]:
        self.warmup(fn)
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(self.reps)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(self.reps)]
        for i in range(self.reps):
            starts[i].record()
            fn(i)
            ends[i].record()
        self.sync()
        return [s.elapsed_time(e) / 1e3 for s, e in zip(starts, ends)]


def rotating_sets(set_bytes: int, cache_bytes: int, most: int = 8) -> int:
    """How many input sets to rotate through so that together they exceed twice the cache."""
    return max(2, min(most, math.ceil(2 * cache_bytes / max(set_bytes, 1))))


_POOL = 1 << 20  # elements of fresh random numbers that large CPU buffers are tiled from


def _random(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Random values in [0.5, 1.5): never zero."""
    return _fill(torch.empty(shape, dtype=dtype, device=device), lambda t: t.uniform_(0.5, 1.5))


def _signed_random(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, std: float) -> torch.Tensor:
    return _fill(torch.empty(shape, dtype=dtype, device=device), lambda t: t.normal_(0.0, std))


def _fill(tensor: torch.Tensor, draw: Callable[[torch.Tensor], Any]) -> torch.Tensor:
    """Fill with random numbers. A large CPU tensor is tiled from a 1 Mi-element random pool: drawing
    gigabytes of random numbers on a few cores takes seconds, and the speed of a copy or a GEMV does
    not depend on whether the data repeats every few megabytes (caches hold addresses, not values)."""
    flat = tensor.view(-1)
    if tensor.device.type != "cpu" or flat.numel() <= _POOL:
        draw(flat)
        return tensor
    pool = draw(torch.empty(_POOL, dtype=tensor.dtype))
    whole = flat.numel() // _POOL
    flat[:whole * _POOL].view(whole, _POOL).copy_(pool.expand(whole, _POOL))
    flat[whole * _POOL:].copy_(pool[:flat.numel() - whole * _POOL])
    return tensor


# ---- GEMM ---------------------------------------------------------------------------------------
def gemm(timer: Timer, device: torch.device, kind: str, size: int, cache_bytes: int) -> Measured:
    """Dense C = A @ B of size^3, 2*size^3 FLOP per call. kind: fp32 (no tensor cores), tf32,
    bf16, fp16, or fp8 (e4m3 inputs through torch._scaled_mm, bf16 output)."""
    if kind == "fp8":
        return _gemm_fp8(timer, device, size, cache_bytes)
    dtype = GEMM_DTYPES[kind]
    elt = torch.finfo(dtype).bits // 8
    sets = rotating_sets(3 * size * size * elt, cache_bytes)
    a = [_signed_random((size, size), dtype, device, 1.0) for _ in range(sets)]
    b = [_signed_random((size, size), dtype, device, 1.0) for _ in range(sets)]
    c = [torch.empty((size, size), dtype=dtype, device=device) for _ in range(sets)]
    previous = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("high" if kind == "tf32" else "highest")
    try:
        seconds = timer.time(lambda i: torch.mm(a[i % sets], b[i % sets], out=c[i % sets]))
    finally:
        torch.set_float32_matmul_precision(previous)
    flop = 2.0 * size ** 3
    unit, scale = ("TFLOP/s", 1e12) if device.type == "cuda" else ("GFLOP/s", 1e9)
    return Measured(f"gemm_{kind}", f"GEMM {kind} {size}³", unit, [flop / s / scale for s in seconds],
                    {"m": size, "n": size, "k": size, "dtype": kind, "input_sets": sets},
                    peak_key=f"gemm_{kind}", peak_scale=1e12 / scale)


def _gemm_fp8(timer: Timer, device: torch.device, size: int, cache_bytes: int) -> Measured:
    sets = rotating_sets(size * size * 4, cache_bytes)  # two 1-byte inputs + a 2-byte output
    a = [_signed_random((size, size), torch.bfloat16, device, 1.0).to(torch.float8_e4m3fn) for _ in range(sets)]
    # _scaled_mm wants its second operand column-major: the transpose of a contiguous matrix.
    b = [_signed_random((size, size), torch.bfloat16, device, 1.0).to(torch.float8_e4m3fn).t() for _ in range(sets)]
    c = [torch.empty((size, size), dtype=torch.bfloat16, device=device) for _ in range(sets)]
    one = torch.ones((), dtype=torch.float32, device=device)

    def call(i: int) -> None:
        torch._scaled_mm(a[i % sets], b[i % sets], one, one, out_dtype=torch.bfloat16, use_fast_accum=True,
                         out=c[i % sets])

    seconds = timer.time(call)
    unit, scale = ("TFLOP/s", 1e12) if device.type == "cuda" else ("GFLOP/s", 1e9)
    return Measured("gemm_fp8", f"GEMM fp8 e4m3 {size}³", unit, [2.0 * size ** 3 / s / scale for s in seconds],
                    {"m": size, "n": size, "k": size, "dtype": "fp8_e4m3", "out_dtype": "bf16",
                     "use_fast_accum": True, "input_sets": sets}, peak_key="gemm_fp8", peak_scale=1e12 / scale)


# ---- memory -------------------------------------------------------------------------------------
def memory_copy(timer: Timer, device: torch.device, nbytes: int, peak_key: Optional[str] = "memory") -> Measured:
    """dst.copy_(src) of nbytes, two rotating pairs; counts bytes read + written (2 x nbytes)."""
    n = nbytes // 4
    src = [_random((n,), torch.float32, device) for _ in range(2)]
    dst = [torch.empty_like(s) for s in src]
    seconds = timer.time(lambda i: dst[i % 2].copy_(src[i % 2]))
    return Measured("memory_copy", f"memory copy {format_bytes(nbytes)}", "GB/s", [2 * n * 4 / s / 1e9 for s in seconds],
                    {"bytes": n * 4, "counted": "read + written"}, peak_key=peak_key)


def memory_read(timer: Timer, device: torch.device, nbytes: int, peak_key: Optional[str] = "memory") -> Measured:
    """A sum over nbytes (read-only stream), two rotating buffers."""
    n = nbytes // 4
    src = [_random((n,), torch.float32, device) for _ in range(2)]
    seconds = timer.time(lambda i: src[i % 2].sum())
    return Measured("memory_read", f"memory read {format_bytes(nbytes)}", "GB/s", [n * 4 / s / 1e9 for s in seconds],
                    {"bytes": n * 4, "counted": "read"}, peak_key=peak_key)


def host_transfer(timer: Timer, device: torch.device, nbytes: int, direction: str) -> Measured:
    """Pinned host <-> device copies (direction "h2d" or "d2h") of nbytes, two rotating buffers."""
    n = nbytes // 4
    host = [_random((n,), torch.float32, torch.device("cpu")).pin_memory() for _ in range(2)]
    dev = [_random((n,), torch.float32, device) for _ in range(2)]
    if direction == "h2d":
        seconds = timer.time(lambda i: dev[i % 2].copy_(host[i % 2], non_blocking=True))
    else:
        seconds = timer.time(lambda i: host[i % 2].copy_(dev[i % 2], non_blocking=True))
    label = "host→device" if direction == "h2d" else "device→host"
    return Measured(direction, f"{label} pinned {format_bytes(nbytes)}", "GB/s", [n * 4 / s / 1e9 for s in seconds],
                    {"bytes": n * 4, "pinned": True}, peak_key="pcie")


def host_transfer_bidirectional(timer: Timer, device: torch.device, nbytes: int) -> Measured:
    """Pinned host -> device and device -> host copies of nbytes each at once, on two streams (the PCIe
    link is full duplex); counts both directions, so the peak is twice the per-direction link."""
    n = nbytes // 4
    host_in = _random((n,), torch.float32, torch.device("cpu")).pin_memory()
    host_out = torch.empty((n,), dtype=torch.float32).pin_memory()
    dev_in = torch.empty((n,), dtype=torch.float32, device=device)
    dev_out = _random((n,), torch.float32, device)
    up, down = torch.cuda.Stream(device), torch.cuda.Stream(device)

    def both(_i: int) -> None:
        with torch.cuda.stream(up):
            dev_in.copy_(host_in, non_blocking=True)
        with torch.cuda.stream(down):
            host_out.copy_(dev_out, non_blocking=True)
        up.synchronize()
        down.synchronize()

    seconds = Timer(timer.warmup_s, timer.reps).time(both)  # two streams: host-side timing around both
    return Measured("bidirectional", f"host↔device pinned {format_bytes(nbytes)} each way", "GB/s",
                    [2 * n * 4 / s / 1e9 for s in seconds], {"bytes_each_way": n * 4, "pinned": True},
                    peak_key="pcie", peak_scale=2.0)


def peer_copy(src_device: torch.device, dst_device: torch.device, nbytes: int, warmup_s: float, reps: int) -> Measured:
    """GPU -> GPU copy of nbytes. Timed on the host around a synchronised copy (the copy involves
    two devices' streams, so one device's events would not bracket it); nbytes is large enough
    that the microseconds of synchronisation do not matter."""
    n = nbytes // 4
    src = [_random((n,), torch.float32, src_device) for _ in range(2)]
    dst = [torch.empty((n,), dtype=torch.float32, device=dst_device) for _ in range(2)]

    class _TwoDeviceTimer(Timer):
        def sync(self) -> None:
            torch.cuda.synchronize(src_device)
            torch.cuda.synchronize(dst_device)

    seconds = _TwoDeviceTimer(warmup_s, reps).time(lambda i: dst[i % 2].copy_(src[i % 2]))
    peer = torch.cuda.can_device_access_peer(dst_device.index, src_device.index)
    return Measured("p2p", f"peer copy cuda:{src_device.index}→cuda:{dst_device.index}", "GB/s",
                    [n * 4 / s / 1e9 for s in seconds], {"bytes": n * 4, "peer_access": peer})


# ---- attention ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class AttentionShape:
    batch: int
    q_heads: int
    kv_heads: int
    head_dim: int
    seq: int  # prefill: tokens per sequence; decode: context length


def _flash_attn() -> Any:
    try:
        import flash_attn  # noqa: F401 - optional, CUDA only
        from flash_attn import flash_attn_func, flash_attn_with_kvcache
    except Exception:  # noqa: BLE001 - a broken flash-attn build (ImportError, OSError) means "not available"
        return None
    return flash_attn_func, flash_attn_with_kvcache


def attention_prefill(timer: Timer, device: torch.device, dtype: torch.dtype, shape: AttentionShape,
                      use_flash: bool) -> Measured:
    """Causal self-attention over `seq` tokens per sequence; FLOP = 2 * b * h * s^2 * d (QK^T and PV,
    halved by the causal mask)."""
    b, h, hkv, d, s = shape.batch, shape.q_heads, shape.kv_heads, shape.head_dim, shape.seq
    flash = _flash_attn() if use_flash else None
    sets = 2
    if flash is not None:  # flash-attn layout: (batch, seq, heads, dim); GQA handled natively
        q = [_signed_random((b, s, h, d), dtype, device, 1.0) for _ in range(sets)]
        k = [_signed_random((b, s, hkv, d), dtype, device, 1.0) for _ in range(sets)]
        v = [_signed_random((b, s, hkv, d), dtype, device, 1.0) for _ in range(sets)]
        call = lambda i: flash[0](q[i % sets], k[i % sets], v[i % sets], causal=True)  # noqa: E731
    else:
        q = [_signed_random((b, h, s, d), dtype, device, 1.0) for _ in range(sets)]
        k = [_signed_random((b, hkv, s, d), dtype, device, 1.0) for _ in range(sets)]
        v = [_signed_random((b, hkv, s, d), dtype, device, 1.0) for _ in range(sets)]
        call = lambda i: F.scaled_dot_product_attention(  # noqa: E731
            q[i % sets], k[i % sets], v[i % sets], is_causal=True, enable_gqa=hkv != h)
    seconds = timer.time(call)
    flop = 2.0 * b * h * s * s * d
    kind = _dtype_key(dtype)
    unit, scale = ("TFLOP/s", 1e12) if device.type == "cuda" else ("GFLOP/s", 1e9)
    return Measured("attention_prefill", f"attention prefill {kind} b{b} s{s} h{h}/{hkv} d{d}", unit,
                    [flop / t / scale for t in seconds],
                    {"backend": "flash-attn" if flash else "torch-sdpa", "batch": b, "seq": s, "q_heads": h,
                     "kv_heads": hkv, "head_dim": d, "dtype": kind, "causal": True},
                    peak_key=f"gemm_{kind}", peak_scale=1e12 / scale)


def attention_decode(timer: Timer, device: torch.device, dtype: torch.dtype, shape: AttentionShape,
                     use_flash: bool, page: int = 256) -> Measured:
    """One query token per sequence against a `seq`-token KV cache. Memory-bound, so the figure is
    the KV bytes read per second (peak: memory bandwidth); TFLOP/s (4 * b * h * ctx * d) is kept in
    params. With flash-attn the cache is paged (block table over a shuffled block pool); torch SDPA
    has no paged kernel, so it reads a contiguous cache."""
    b, h, hkv, d, ctx = shape.batch, shape.q_heads, shape.kv_heads, shape.head_dim, shape.seq
    flash = _flash_attn() if use_flash else None
    q = [_signed_random((b, 1, h, d) if flash else (b, h, 1, d), dtype, device, 1.0) for _ in range(2)]
    if flash is not None:
        blocks_per_seq = math.ceil(ctx / page)
        pool = b * blocks_per_seq
        k_cache = _signed_random((pool, page, hkv, d), dtype, device, 1.0)
        v_cache = _signed_random((pool, page, hkv, d), dtype, device, 1.0)
        table = torch.randperm(pool, device=device, dtype=torch.int32).view(b, blocks_per_seq)
        lens = torch.full((b,), ctx, dtype=torch.int32, device=device)
        call = lambda i: flash[1](q[i % 2], k_cache, v_cache, cache_seqlens=lens, block_table=table)  # noqa: E731
    else:
        k_cache = _signed_random((b, hkv, ctx, d), dtype, device, 1.0)
        v_cache = _signed_random((b, hkv, ctx, d), dtype, device, 1.0)
        call = lambda i: F.scaled_dot_product_attention(q[i % 2], k_cache, v_cache,  # noqa: E731
                                                        enable_gqa=hkv != h)
    seconds = timer.time(call)
    kv_bytes = 2 * b * ctx * hkv * d * (torch.finfo(dtype).bits // 8)
    flop = 4.0 * b * h * ctx * d
    median_s = sorted(seconds)[len(seconds) // 2]
    kind = _dtype_key(dtype)
    return Measured("attention_decode", f"attention decode {kind} b{b} ctx{ctx} h{h}/{hkv} d{d}", "GB/s",
                    [kv_bytes / t / 1e9 for t in seconds],
                    {"backend": "flash-attn" if flash else "torch-sdpa", "paged": flash is not None,
                     "page_size": page if flash else None, "batch": b, "context": ctx, "q_heads": h,
                     "kv_heads": hkv, "head_dim": d, "dtype": kind, "kv_bytes": kv_bytes,
                     "tflops_median": round(flop / median_s / 1e12, 4)},
                    peak_key="memory")


def _dtype_key(dtype: torch.dtype) -> str:
    return {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}[dtype]


# ---- LLM-shaped decode step ---------------------------------------------------------------------
class _DecodeStep:
    """Batch-1 decode through random weights of a model's shape: per layer RMSNorm, QKV, O, RMSNorm,
    gate/up, SiLU*up, down; then the LM head and argmax. Attention over a one-token context is the
    V row itself, so the step is all GEMVs (weight streaming), as a real short-context decode is."""

    def __init__(self, shape: ModelShape, dtype: torch.dtype, device: torch.device):
        self.shape = shape
        q, kv = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
        self.q_size = q
        make = lambda rows, cols: _signed_random((rows, cols), dtype, device, 0.02)  # noqa: E731
        self.layers = [
            (make(q + 2 * kv, shape.hidden), make(shape.hidden, q), make(2 * shape.intermediate, shape.hidden),
             make(shape.hidden, shape.intermediate), torch.ones(shape.hidden, dtype=dtype, device=device))
            for _ in range(shape.layers)
        ]
        self.lm_head = make(shape.vocab, shape.hidden)
        self.x = _signed_random((1, shape.hidden), dtype, device, 1.0)
        self.bytes = shape.linear_params * (torch.finfo(dtype).bits // 8)

    @torch.no_grad()
    def __call__(self, _i: int = 0) -> torch.Tensor:
        hidden = self.x
        size = (self.shape.hidden,)
        for qkv, o, gate_up, down, norm in self.layers:
            mixed = F.linear(F.rms_norm(hidden, size, norm, 1e-6), qkv)
            hidden = hidden + F.linear(mixed[:, :self.q_size], o)
            gate, up = F.linear(F.rms_norm(hidden, size, norm, 1e-6), gate_up).chunk(2, dim=-1)
            hidden = hidden + F.linear(F.silu(gate) * up, down)
        return F.linear(hidden, self.lm_head).argmax(dim=-1)


def decode_step(timer: Timer, device: torch.device, dtype: torch.dtype, shape: ModelShape) -> Measured:
    """Tokens/s of the batch-1 decode step; peak = datasheet memory bandwidth / weight bytes.
    On CUDA the step is captured once as a CUDA graph (as serving engines do) so kernel launch
    overhead does not hide the GEMV time; eager mode is used if capture fails."""
    step = _DecodeStep(shape, dtype, device)
    run, graphed = step, False
    if device.type == "cuda":
        run, graphed = _cuda_graph(step, device)
    seconds = timer.time(run)
    return Measured("decode_step", f"decode step {shape.name} {_dtype_key(dtype)} batch 1", "tokens/s",
                    [1.0 / s for s in seconds],
                    {"model": shape.to_dict(), "dtype": _dtype_key(dtype), "weight_bytes": step.bytes,
                     "cuda_graph": graphed, "attention": "one-token context"},
                    peak_key="memory", peak_scale=1e9 / step.bytes)


def _cuda_graph(step: _DecodeStep, device: torch.device) -> tuple[Callable[[int], Any], bool]:
    # Capture on a stream of the weights' device, passed explicitly: without `stream=`, torch.cuda.graph uses
    # one class-wide stream made on whichever device was current at the first capture in the process, so a
    # later capture for cuda:1 records nothing ("The CUDA Graph is empty") and replays time an empty graph.
    with torch.cuda.device(device):
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            for _ in range(3):
                step()
        torch.cuda.current_stream(device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph, stream=side):
                token = step()
        except RuntimeError:
            return step, False

    def replay(_i: int) -> torch.Tensor:
        graph.replay()
        return token  # the graph's output, refilled by each replay

    return replay, True

