"""Native CPU kernels (`cpu_kernels.c`), built on first use with the host's C compiler.

The engine runs without them (the torch paths stay correct everywhere); with them (`cpu_kernels_for`,
handed to the model and its linear method when they are built), CPU attention for decodes and short
rows (speculative verify rows) reads the paged KV pool directly instead of gathering it, and bf16 linears run on AMX tiles
where the CPU has them (`gemm_amx`, the weight in `pack_amx`'s layout). The build
takes about a second and is cached per source, compiler and CPU (it uses `-march=native`) under
`$LLMCTL_CACHE_DIR` or `~/.cache/llmctl`. No compiler, a failed build, a CPU without AVX-512, or
`LLMCTL_DISABLE_CPU_KERNELS=1` means `load_cpu_kernels()` returns None and the torch path is used.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from array import array
from dataclasses import dataclass
from functools import lru_cache, wraps
from pathlib import Path
from typing import Callable, Optional, TypeVar

import torch

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("cpu_kernels.c")
FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c11")
DISABLE_ENV = "LLMCTL_DISABLE_CPU_KERNELS"
_SUFFIX = {torch.bfloat16: "bf16", torch.float32: "f32"}
# q, q row stride, k_pool, v_pool, tables, table stride, lens, starts, qlens, out, 6 sizes, scale, window, threads
_POINTER, _INT64 = ctypes.c_void_p, ctypes.c_int64
_PAGED_ARGTYPES = [_POINTER, _INT64, _POINTER, _POINTER, _POINTER, _INT64] + [_POINTER] * 4 + [_INT64] * 6 \
    + [ctypes.c_float, _INT64, ctypes.c_int]


_Function = TypeVar("_Function", bound=Callable)


def profiled(name: str) -> Callable[[_Function], _Function]:
    """Label a native entry point `llmctl::<name>` in torch.profiler traces, which cannot see inside a C
    call (`llmctl profile torch` would show the time under no op at all). Checked per call: 0.06 us when
    no profiler runs, against 9 us for an unconditional `record_function`."""
    label = f"llmctl::{name}"

    def wrap(function: _Function) -> _Function:
        @wraps(function)
        def traced(*args, **kwargs):
            if not torch.autograd._profiler_enabled():
                return function(*args, **kwargs)
            with torch.profiler.record_function(label):
                return function(*args, **kwargs)
        return traced  # type: ignore[return-value]

    return wrap


class CpuKernels:
    """Typed entry points of the built library; arguments are checked before any pointer is passed."""

    dtypes = tuple(_SUFFIX)
    max_group = 16  # MAX_GROUP in the C source

    def __init__(self, library: ctypes.CDLL):
        def bind(name: str, argtypes: list) -> dict:
            functions = {}
            for dtype, suffix in _SUFFIX.items():
                function = getattr(library, f"{name}_{suffix}")
                function.argtypes, function.restype = argtypes, None
                functions[dtype] = function
            return functions

        self._paged = bind("paged_attention", _PAGED_ARGTYPES)
        self._rms_norm = bind("rms_norm", [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 2 + [ctypes.c_float, ctypes.c_int])
        self._silu_and_mul = bind("silu_and_mul", [ctypes.c_void_p] * 2 + [ctypes.c_int64] * 2 + [ctypes.c_int])
        self._write_kv = bind("write_kv", [ctypes.c_void_p, ctypes.c_int64] * 2 + [ctypes.c_void_p] * 3
                              + [ctypes.c_int64] * 4 + [ctypes.c_int])
        self._gemv = library.gemv_bf16
        self._gemv.argtypes = [_POINTER] * 4 + [_INT64] * 2 + [ctypes.c_int]
        self._gemv.restype = ctypes.c_int
        probe, probe_out = torch.zeros(1, 32, dtype=torch.bfloat16), torch.zeros(1, dtype=torch.bfloat16)
        # 0 where the CPU lacks the bf16 dot product (the library was built without it)
        self.has_gemv = bool(self._gemv(probe.data_ptr(), probe.data_ptr(), None, probe_out.data_ptr(), 1, 32, 1))
        self._amx = library.gemm_amx_bf16
        self._amx.argtypes = [_POINTER] * 4 + [_INT64] * 3 + [ctypes.c_int]
        self._amx.restype = ctypes.c_int
        # 0 without AMX tiles in the build, or where Linux refuses the tile state (older kernels, some VMs)
        self.has_amx = self.has_gemv and bool(library.amx_enable())
        self._rotary = bind("rotary", [ctypes.c_void_p] + [ctypes.c_int64] * 4 + [ctypes.c_void_p] * 2 + [ctypes.c_int])
        self._decode_stack = library.decode_stack_bf16
        # layers, sizes, buffers, embedding, final norm, lm_head, cos, sin; tokens, token, position, slot; rows,
        # tables, width, lens, starts, qlens; logits rows (count, ids); eps, scale, logits, their argmax, threads
        self._decode_stack.argtypes = [_POINTER] * 8 + [_INT64] + [_POINTER] * 3 + [_INT64, _POINTER, _INT64] \
            + [_POINTER] * 3 + [_INT64, _POINTER, ctypes.c_float, ctypes.c_float, _POINTER, _POINTER, ctypes.c_int]
        self._decode_stack.restype = ctypes.c_int
        self._argmax = library.argmax_f32
        self._argmax.argtypes, self._argmax.restype = [_POINTER, _INT64, _INT64, _POINTER], None

    def write_kv(self, k: torch.Tensor, v: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                 slot_mapping: torch.Tensor) -> None:
        """Store each token's keys and values [tokens, kv_heads, head_dim] (views into a fused qkv
        output are fine) at its slot of the head-major pools [kv_heads, blocks, block_size, head_dim]."""
        tokens, kv_heads, head_dim = k.shape
        pool_slots = k_pool.shape[1] * k_pool.shape[2]
        if (k_pool.shape != v_pool.shape or k_pool.shape[0] != kv_heads or k_pool.shape[3] != head_dim
                or v.shape != k.shape or not k_pool.is_contiguous() or not v_pool.is_contiguous()):
            raise ValueError("write_kv: keys, values and the pools disagree on shape")
        if {t.dtype for t in (k, v, k_pool, v_pool)} != {k.dtype} or k.dtype not in self._write_kv:
            raise ValueError("write_kv: keys, values and pools must share one float32/bfloat16 dtype")
        if k.stride()[1:] != (head_dim, 1) or v.stride()[1:] != (head_dim, 1):
            raise ValueError("write_kv: keys and values must be rows of contiguous heads")
        if slot_mapping.dtype != torch.int64 or slot_mapping.shape != (tokens,) or not slot_mapping.is_contiguous():
            raise ValueError("write_kv: slot_mapping must be a contiguous int64 [tokens]")
        if tokens and not 0 <= int(slot_mapping.min()) <= int(slot_mapping.max()) < pool_slots:
            raise ValueError("write_kv: a slot lies outside the pool")
        self._write_kv[k.dtype](k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0), k_pool.data_ptr(),
                                v_pool.data_ptr(), slot_mapping.data_ptr(), tokens, kv_heads, head_dim, pool_slots,
                                torch.get_num_threads())

    @profiled("gemv_bf16")
    def gemv(self, weight: torch.Tensor, x: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
        """x [1, K] @ weight[N, K].T (+ bias) in bfloat16, one streaming pass over the weight."""
        n, k = weight.shape
        if not self.has_gemv or weight.dtype != torch.bfloat16 or x.dtype != torch.bfloat16 or x.shape != (1, k) \
                or not weight.is_contiguous() or not x.is_contiguous():
            raise ValueError("gemv: needs a contiguous bf16 weight [N, K] and input [1, K] on a CPU with AVX512-BF16")
        if bias is not None and (bias.shape != (n,) or bias.dtype != torch.bfloat16 or not bias.is_contiguous()):
            raise ValueError("gemv: the bias must be a contiguous bf16 [N]")
        out = x.new_empty(1, n)
        self._gemv(weight.data_ptr(), x.data_ptr(), bias.data_ptr() if bias is not None else None, out.data_ptr(),
                   n, k, torch.get_num_threads())
        return out

    @staticmethod
    def pack_amx(weight: torch.Tensor) -> torch.Tensor:
        """A bf16 weight [N, K] in `gemm_amx`'s layout: N padded to 64, K to 32, then AMX B tiles (16 pairs of
        inputs x 16 outputs) [N / 32, K / 32, 2, 16, 16, 2], a 32-output pair's two tiles side by side."""
        n, k = weight.shape
        n_pad, k_pad = -(-n // 64) * 64, -(-k // 32) * 32
        padded = torch.nn.functional.pad(weight, (0, k_pad - k, 0, n_pad - n))
        return padded.view(n_pad // 32, 2, 16, k_pad // 32, 16, 2).permute(0, 3, 1, 4, 2, 5).contiguous()

    @profiled("gemm_amx_bf16")
    def gemm_amx(self, packed: torch.Tensor, x: torch.Tensor, out_features: int,
                 bias: Optional[torch.Tensor] = None) -> torch.Tensor:
        """x [M, K] @ W.T (+ bias) in bfloat16 on AMX tiles, W given as `pack_amx(W)`. Each output element
        depends only on its row of x (the same value whatever M is), so a verify row's linears equal
        one-token decodes' and a row's result does not depend on the rest of its batch."""
        m, k = x.shape if x.dim() == 2 else (0, -1)
        n = out_features
        if not self.has_amx or x.dtype != torch.bfloat16 or packed.dtype != torch.bfloat16 or not x.is_contiguous() \
                or packed.shape != (-(-n // 64) * 2, -(-k // 32), 2, 16, 16, 2) or not packed.is_contiguous():
            raise ValueError("gemm_amx: needs AMX, a contiguous bf16 input [M, K] and its weight from pack_amx")
        if bias is not None and (bias.shape != (n,) or bias.dtype != torch.bfloat16 or not bias.is_contiguous()):
            raise ValueError("gemm_amx: the bias must be a contiguous bf16 [N]")
        out = x.new_empty(m, n)
        if m and not self._amx(packed.data_ptr(), x.data_ptr(), bias.data_ptr() if bias is not None else None,
                               out.data_ptr(), m, n, k, torch.get_num_threads()):
            raise MemoryError("gemm_amx: no memory for the padded input")
        return out

    # ---- fused elementwise ops (any row count; torch's rounding in bf16) ---------------------------
    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float,
                 residual: Optional[torch.Tensor] = None) -> torch.Tensor:
        """RMSNorm(x) * weight over the last dimension; with `residual`, first `residual += x` in place
        and normalise that (one pass instead of an add and a norm)."""
        _check_rows("rms_norm", x, weight.shape[-1], self._rms_norm)
        if weight.dtype != x.dtype or not weight.is_contiguous():
            raise ValueError("rms_norm: the weight must be contiguous and of the input's dtype")
        if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype
                                     or not residual.is_contiguous()):
            raise ValueError("rms_norm: the residual must be a contiguous tensor like the input")
        out = torch.empty_like(x)
        self._rms_norm[x.dtype](x.data_ptr(), residual.data_ptr() if residual is not None else None,
                                weight.data_ptr(), out.data_ptr(), x.numel() // x.shape[-1], x.shape[-1], eps,
                                torch.get_num_threads())
        return out

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up for rows laid out as [gate | up]."""
        size = gate_up.shape[-1] // 2
        _check_rows("silu_and_mul", gate_up, 2 * size, self._silu_and_mul)
        out = gate_up.new_empty(*gate_up.shape[:-1], size)
        self._silu_and_mul[gate_up.dtype](gate_up.data_ptr(), out.data_ptr(), gate_up.numel() // (2 * size), size,
                                          torch.get_num_threads())
        return out

    def rotary_(self, x: torch.Tensor, heads: int, head_dim: int, cos: torch.Tensor, sin: torch.Tensor) -> None:
        """Rotate-half RoPE in place on the first `heads` heads of each row of the 2-D `x` (rows may be
        strided, as in a fused qkv output); cos/sin hold one row of head_dim/2 values per token."""
        if x.dim() != 2 or x.stride(1) != 1 or x.dtype not in self._rotary or heads * head_dim > x.shape[1] \
                or head_dim % 2:
            raise ValueError("rotary_: x must be [tokens, >= heads * head_dim] with unit stride in its last dim")
        half = head_dim // 2
        tables = [t.reshape(x.shape[0], half) for t in (cos, sin)]
        if any(t.dtype != x.dtype or not t.is_contiguous() for t in tables):
            raise ValueError("rotary_: cos/sin must be contiguous [tokens, head_dim / 2] in x's dtype")
        self._rotary[x.dtype](x.data_ptr(), x.shape[0], x.stride(0), heads, head_dim, tables[0].data_ptr(),
                              tables[1].data_ptr(), torch.get_num_threads())

    def supports_decode(self, dtype: torch.dtype, num_heads: int, num_kv_heads: int, head_dim: int) -> bool:
        return dtype in self._paged and head_dim % 16 == 0 and num_heads // num_kv_heads <= self.max_group

    def tiled_attention(self, dtype: torch.dtype) -> bool:
        """`paged_attention` runs on AMX tiles here in `dtype` (bf16 where the tile state is granted): a prefill
        row then costs about what SDPA's does (benchmarks/verify_attention.py --prefill), each query still
        exactly its one-token decode; elsewhere (float32, no AMX) a long row costs 2-3x SDPA's."""
        return dtype == torch.bfloat16 and self.has_amx

    def paged_decode_attention(self, q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                               block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
                               window: Optional[int] = None) -> torch.Tensor:
        """Attention of one new token per sequence over its paged K/V.

        q [seqs, heads, head_dim]; pools [kv_heads, blocks, block_size, head_dim]; block_tables
        [seqs, width] int64; context_lens [seqs] int64 (the new token included). Returns [seqs, heads, head_dim].
        """
        rows = self.paged_rows(block_tables, context_lens, k_pool.shape[2])
        return self.paged_attention(q, k_pool, v_pool, rows, scale, window)

    def paged_rows(self, block_tables: torch.Tensor, context_lens: torch.Tensor, block_size: int,
                   query_starts: Optional[torch.Tensor] = None,
                   query_lens: Optional[torch.Tensor] = None) -> "PagedRows":
        """A step's rows for `paged_attention`, checked once (every layer's call reuses them).

        block_tables [rows, width] int64; context_lens [rows] int64 (each row's new tokens included). Row
        r's queries are tokens query_starts[r] .. + query_lens[r] - 1 of q (both int64 [rows]; without them
        row r is token r alone), query j seeing the first context_lens[r] - query_lens[r] + j + 1 keys.
        """
        rows = block_tables.shape[0] if block_tables.dim() == 2 else -1
        if block_tables.dtype != torch.int64 or context_lens.dtype != torch.int64 or rows < 0 \
                or context_lens.shape != (rows,):
            raise ValueError("paged_attention: block_tables [rows, width] and context_lens [rows] must be int64")
        if block_size < 1 or block_size & (block_size - 1):
            raise ValueError(f"paged_attention: block size {block_size} is not a power of two")
        shortest, longest = (int(v) for v in torch.aminmax(context_lens)) if rows else (1, 0)
        if longest > block_tables.shape[1] * block_size:
            raise ValueError("paged_attention: a context is longer than its block table")
        if shortest < 1:
            raise ValueError("paged_attention: every context holds at least the new token")
        lowest, highest = (int(v) for v in torch.aminmax(block_tables)) if block_tables.numel() else (0, -1)
        if lowest < 0:
            raise ValueError("paged_attention: a block id lies outside the pool")
        if (query_starts is None) != (query_lens is None):
            raise ValueError("paged_attention: query_starts and query_lens come together")
        tokens = rows
        if query_lens is not None:
            if query_starts.dtype != torch.int64 or query_lens.dtype != torch.int64 \
                    or query_starts.shape != (rows,) or query_lens.shape != (rows,):
                raise ValueError("paged_attention: query_starts and query_lens must be int64 [rows]")
            if rows and (int(query_lens.min()) < 1 or int(query_starts.min()) < 0):
                raise ValueError("paged_attention: every row has a query token at a token index >= 0")
            if rows and bool((query_lens > context_lens).any()):
                raise ValueError("paged_attention: a row has more query tokens than its context")
            tokens = int((query_starts + query_lens).max()) if rows else 0
            query_starts, query_lens = query_starts.contiguous(), query_lens.contiguous()
        return PagedRows(block_tables.contiguous(), context_lens.contiguous(), block_size, query_starts, query_lens,
                         tokens, highest)

    @profiled("paged_attention")
    def paged_attention(self, q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, rows: "PagedRows",
                        scale: float, window: Optional[int] = None, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Causal attention of `rows`' query tokens over their paged K/V, each query computed exactly as a
        one-token decode at its position (bitwise: a verify row's outputs are its one-by-one decodes').

        q [tokens, heads, head_dim]; pools [kv_heads, blocks, block_size, head_dim]. Written into `out`
        (contiguous, q's shape and dtype; only the rows' tokens) when given; returns it.
        """
        tokens, heads, head_dim = q.shape
        kv_heads, num_blocks, block_size, pool_dim = k_pool.shape
        if q.dtype not in self._paged or k_pool.dtype != q.dtype or v_pool.dtype != q.dtype:
            raise ValueError(f"paged_attention: unsupported dtypes {q.dtype}/{k_pool.dtype}/{v_pool.dtype}")
        if pool_dim != head_dim or heads % kv_heads or v_pool.shape != k_pool.shape:
            raise ValueError("paged_attention: q and the pools disagree on heads or head_dim")
        if block_size != rows.block_size:
            raise ValueError(f"paged_attention: the rows are of block size {rows.block_size}, the pool's {block_size}")
        if not self.supports_decode(q.dtype, heads, kv_heads, head_dim):
            raise ValueError(f"paged_attention: head_dim {head_dim} or group {heads // kv_heads} not supported")
        if rows.highest_block >= num_blocks:
            raise ValueError("paged_attention: a block id lies outside the pool")
        if rows.num_tokens > tokens or (rows.query_lens is None and rows.num_tokens != tokens):
            raise ValueError(f"paged_attention: the rows' query tokens do not fit q's {tokens}")
        if q.stride(2) != 1 or q.stride(1) != head_dim:  # rows may be apart (a view into qkv), heads not
            q = q.contiguous()
        k_pool, v_pool = k_pool.contiguous(), v_pool.contiguous()
        if out is None:
            out = q.new_empty(tokens, heads, head_dim)
        elif out.shape != (tokens, heads, head_dim) or out.dtype != q.dtype or not out.is_contiguous():
            raise ValueError("paged_attention: out must be a contiguous tensor of q's shape and dtype")
        count = rows.block_tables.shape[0]
        if count:
            ranges = rows.query_starts, rows.query_lens
            self._paged[q.dtype](
                q.data_ptr(), q.stride(0), k_pool.data_ptr(), v_pool.data_ptr(), rows.block_tables.data_ptr(),
                rows.block_tables.shape[1], rows.context_lens.data_ptr(),
                *(r.data_ptr() if r is not None else None for r in ranges), out.data_ptr(), count, heads, kv_heads,
                head_dim, num_blocks, block_size, scale, window or 0, torch.get_num_threads())
        return out

    def argmax(self, values: torch.Tensor) -> list[int]:
        """`values.argmax(dim=-1).tolist()` of a contiguous float32 CPU tensor [rows, width >= 1] (the first
        maximum, or a row's first NaN). Into a ctypes array, not a tensor: the sampler wants a list, and after a
        decode step's weight stream a torch.empty and a tolist cost ~40 us of cold caches."""
        if values.dtype != torch.float32 or values.dim() != 2 or values.shape[1] < 1 or not values.is_contiguous() \
                or not values.is_cpu:
            raise ValueError("argmax: needs a contiguous float32 CPU tensor [rows, width >= 1]")
        rows, width = values.shape
        out = (ctypes.c_int64 * rows)()
        self._argmax(values.data_ptr(), rows, width, out)
        return list(out)

    def decode_stack(self, layers: list[dict[str, object]], embedding: torch.Tensor, final_norm: torch.Tensor,
                     lm_head: tuple[str, object], cos: torch.Tensor, sin: torch.Tensor, *, num_heads: int,
                     num_kv_heads: int, intermediate: int, eps: float, scale: float,
                     window: Optional[int]) -> Optional["DecodeStack"]:
        """The whole batch-1 decode step of a Llama-family model as one native call (`DecodeStack`), or None
        where this CPU lacks a linear kind's kernel. `layers`: per decoder layer the entries named in
        `DecodeStack.LAYER_FIELDS` (biases may be None): bf16 norm weights, each linear as (kind, operand)
        (`"gemv"`: the plain [out, in] bf16 weight; `"amx"`: its `pack_amx` tiles; `"quant"`: a
        `quant.QuantRowOperand`), the layer's K and V pools [kv_heads, blocks, block_size, head_dim]; `lm_head`
        (kind, operand) likewise; `cos`/`sin`: RoPE tables [positions, head_dim / 2]."""
        available = {"gemv": self.has_gemv, "amx": self.has_amx, "quant": self.has_gemv}
        linears = [lm_head] + [layer.get(name) for layer in layers for name in DecodeStack.LINEARS]
        kinds = {linear[0] for linear in linears if isinstance(linear, tuple) and len(linear) == 2}
        if not all(available.get(kind, True) for kind in kinds):  # unknown kinds: refused by DecodeStack
            return None
        if not self.supports_decode(torch.bfloat16, num_heads, num_kv_heads, layers[0]["k_pool"].shape[-1]):
            raise ValueError("decode_stack: heads or head_dim the paged attention kernel does not take")
        return DecodeStack(self._decode_stack, layers, embedding, final_norm, lm_head, cos, sin, num_heads=num_heads,
                           num_kv_heads=num_kv_heads, intermediate=intermediate, eps=eps, scale=scale, window=window)


@dataclass(frozen=True)
class PagedRows:
    """A step's rows for `CpuKernels.paged_attention`, from `CpuKernels.paged_rows` (checked there)."""

    block_tables: torch.Tensor  # [rows, width] int64, contiguous
    context_lens: torch.Tensor  # [rows] int64
    block_size: int
    query_starts: Optional[torch.Tensor]  # [rows] int64, or None: row r is token r
    query_lens: Optional[torch.Tensor]
    num_tokens: int  # q must hold at least this many tokens
    highest_block: int  # the pool must hold more blocks than this


class DecodeStack:
    """`decode_stack_bf16` bound to one model's operands, checked once here: each call passes only the step's
    tokens, positions, slots and rows. It calls the kernels the model's forward calls, on the same operands,
    so its logits are bitwise that forward's; what it saves is the Python between them (thread CPU time per
    batch-1 step, SmolLM-135M shape, one thread, in benchmarks/decode_overhead.py). Steps of up to
    `MAX_TOKENS` tokens in rows of up to `MAX_ROW_TOKENS` (the torch backend's native-kernel rows), more than
    one token only where every linear's kernel is the AMX one (each of its output rows independent of the
    others; the quantised linears' forward for several rows may be another kernel than their GEMV)."""

    MAX_TOKENS = 16

    LAYER_FIELDS = ("input_norm", "qkv", "qkv_bias", "o", "o_bias", "post_norm", "gate_up", "gate_up_bias", "down",
                    "down_bias", "k_pool", "v_pool")
    LINEARS = ("qkv", "o", "gate_up", "down")
    BIASES = frozenset({"qkv_bias", "o_bias", "gate_up_bias", "down_bias"})

    KINDS = {"gemv": 0, "amx": 1, "quant": 2}  # STACK_GEMV, STACK_AMX, STACK_QUANT in the C source

    def __init__(self, function, layers: list[dict[str, object]], embedding: torch.Tensor, final_norm: torch.Tensor,
                 lm_head: tuple[str, object], cos: torch.Tensor, sin: torch.Tensor, *, num_heads: int,
                 num_kv_heads: int, intermediate: int, eps: float, scale: float, window: Optional[int]):
        vocab, hidden = embedding.shape
        kv_heads, num_blocks, block_size, head_dim = layers[0]["k_pool"].shape
        qkv_rows = (num_heads + 2 * num_kv_heads) * head_dim
        linear_shapes = {"qkv": (qkv_rows, hidden), "o": (hidden, num_heads * head_dim),
                         "gate_up": (2 * intermediate, hidden), "down": (hidden, intermediate)}
        expected = {"input_norm": (hidden,), "qkv_bias": (qkv_rows,), "o_bias": (hidden,), "post_norm": (hidden,),
                    "gate_up_bias": (2 * intermediate,), "down_bias": (hidden,),
                    "k_pool": (num_kv_heads, num_blocks, block_size, head_dim)}
        expected["v_pool"] = expected["k_pool"]
        if kv_heads != num_kv_heads or num_heads % num_kv_heads or block_size & (block_size - 1):
            raise ValueError("decode_stack: the pools' heads or block size do not fit the model")
        # one or more per linear (a quantised weight's parts: the first, then the others, each naming the next by
        # index here and by address below), the lm_head's last
        descriptors: list[list[int]] = []
        entries: list[tuple[str, int]] = []  # per layer field: ("address", value) or ("linear", descriptor index)

        def add_linear(what: str, linear: object, out_features: int, in_features: int) -> int:
            parts = _linear_descriptors(what, linear, out_features, in_features)
            first = len(descriptors)
            for index, part in enumerate(parts):
                descriptors.append([*part, first + index + 1 if index + 1 < len(parts) else -1])
            return first

        for layer in layers:
            if set(layer) != set(self.LAYER_FIELDS):
                raise ValueError(f"decode_stack: a layer needs exactly {', '.join(self.LAYER_FIELDS)}")
            for name in self.LAYER_FIELDS:
                tensor = layer[name]
                if name in linear_shapes:
                    entries.append(("linear", add_linear(f"decode_stack: {name}", tensor, *linear_shapes[name])))
                elif tensor is None and name in self.BIASES:
                    entries.append(("address", 0))
                else:
                    _check_operand(f"decode_stack: {name}", tensor, expected[name])
                    entries.append(("address", tensor.data_ptr()))
        _check_operand("decode_stack: the embedding", embedding, (vocab, hidden))
        _check_operand("decode_stack: the final norm", final_norm, (hidden,))
        lm_head_index = add_linear("decode_stack: the lm_head", lm_head, vocab, hidden)
        for table in (cos, sin):
            _check_operand("decode_stack: a RoPE table", table, (cos.shape[0], head_dim // 2))
        self._function = function
        self._operands = (layers, embedding, final_norm, lm_head, cos, sin)  # alive while their addresses are used
        self.vocab, self.positions, self.pool_slots, self.num_blocks = vocab, cos.shape[0], num_blocks * block_size, num_blocks
        self.block_size = block_size
        self._descriptors = torch.tensor(descriptors, dtype=torch.int64)  # [descriptors, STACK_LINEAR_FIELDS]

        def descriptor_address(index: int) -> int:
            return self._descriptors[index].data_ptr()

        for index, descriptor in enumerate(descriptors):  # STACK_NEXT_PART: the next part's address, or 0
            self._descriptors[index, -1] = descriptor_address(descriptor[-1]) if descriptor[-1] >= 0 else 0

        self._layers = torch.tensor([descriptor_address(value) if what == "linear" else value
                                     for what, value in entries], dtype=torch.int64)
        self._sizes = torch.tensor([len(layers), hidden, num_heads, num_kv_heads, head_dim, intermediate, vocab,
                                    num_blocks, block_size, window or 0], dtype=torch.int64)
        self.kinds = frozenset(kind for kind, _ in [lm_head] + [layer[name] for layer in layers for name in self.LINEARS])
        self.max_tokens = self.MAX_TOKENS if self.kinds == {"amx"} else 1
        sizes = (hidden, hidden, hidden, qkv_rows, num_heads * head_dim, 2 * intermediate, intermediate, vocab,
                 head_dim // 2, head_dim // 2, hidden, hidden)
        self._scratch = [torch.empty(self.max_tokens * size, dtype=torch.bfloat16) for size in sizes]
        self._scratch_addresses = (ctypes.c_void_p * len(sizes))(*(t.data_ptr() for t in self._scratch))
        self._fixed = (self._layers.data_ptr(), self._sizes.data_ptr(), self._scratch_addresses, embedding.data_ptr(),
                       final_norm.data_ptr(), descriptor_address(lm_head_index), cos.data_ptr(), sin.data_ptr())
        self._eps, self._scale = eps, scale
        self._logits_buffer: Optional[torch.Tensor] = None  # [max_tokens, vocab] float32, once a step needs it
        self._logits: dict[int, torch.Tensor] = {}  # its leading rows, per logits row count: each call's output

    def can_run(self, query_lens: list[int], max_row_tokens: int) -> bool:
        """Whether a step of rows of `query_lens` new tokens fits (rows of at most `max_row_tokens`)."""
        return sum(query_lens) <= self.max_tokens and max(query_lens, default=0) <= max_row_tokens

    @profiled("decode_stack")
    def __call__(self, input_ids: array, positions: array, slot_mapping: array, block_tables: list[list[int]],
                 context_lens: list[int], query_lens: list[int], logits_indices: array
                 ) -> tuple[torch.Tensor, Optional[list[int]]]:
        """Float32 logits [len(logits_indices), vocab] of the step's tokens `input_ids` at `positions` (their K/V
        written at `slot_mapping`), in rows of `query_lens` consecutive tokens, row r on a context of
        `context_lens[r]` keys (its new tokens included) in `block_tables[r]`'s blocks; and each logits row's
        argmax (`argmax`'s answer) where the step found them on the way (a one-token step in one parallel region:
        each thread in the slice it wrote), else None. The four vectors are int64 arrays (`array("q")`); the
        logits are the leading rows of this stack's one buffer, overwritten by the next call.

        No torch call but the logits' first allocation: after a batch-1 step's weight stream each runs from cold
        caches (SmolLM-135M int4-g32, two threads, Zen 4: this Python ~69 -> ~40 us a step, where tensors came in
        and the logits were a new one)."""
        if not all(isinstance(v, array) and v.typecode == "q"
                   for v in (input_ids, positions, slot_mapping, logits_indices)):
            raise ValueError("decode_stack: ids, positions, slots and logits indices must be int64 arrays")
        tokens = len(input_ids)
        if not 0 < tokens <= self.max_tokens or len(positions) != tokens or len(slot_mapping) != tokens \
                or sum(query_lens) != tokens or min(query_lens) < 1 or len(context_lens) != len(query_lens) \
                or len(block_tables) != len(query_lens) or any(q > c for q, c in zip(query_lens, context_lens)) \
                or len(logits_indices) > tokens:
            raise ValueError(f"decode_stack: {tokens} tokens in rows {query_lens} do not fit (at most {self.max_tokens})")
        width = -(-max(context_lens) // self.block_size)
        needed = [table[: -(-length // self.block_size)] for table, length in zip(block_tables, context_lens)]
        blocks = [block for table in needed for block in table]
        if not (all(len(t) == -(-c // self.block_size) for t, c in zip(needed, context_lens))
                and 0 <= min(blocks) and max(blocks) < self.num_blocks
                and _within(input_ids, self.vocab) and _within(positions, self.positions)
                and _within(slot_mapping, self.pool_slots) and _within(logits_indices, tokens)):
            raise ValueError("decode_stack: a token, position, slot, logits row or block id lies outside its table")
        # the block tables and the context lengths in one array
        tables_and_lens = array("q", [value for table in needed for value in table + [0] * (width - len(table))]
                                + context_lens)
        tables_address = tables_and_lens.buffer_info()[0]
        lens_address = tables_address + 8 * width * len(needed)
        ranges = (None, None)  # one token a row
        if tokens != len(query_lens):
            starts = [0]
            for length in query_lens[:-1]:
                starts.append(starts[-1] + length)
            ranges = (array("q", starts), array("q", query_lens))
        rows = len(logits_indices)
        logits = self._logits.get(rows)
        if logits is None:
            with torch.inference_mode(False):  # plain tensors, whichever mode the first step ran in
                if self._logits_buffer is None:
                    self._logits_buffer = torch.empty(self.max_tokens, self.vocab, dtype=torch.float32)
                logits = self._logits[rows] = self._logits_buffer[:rows]
        picked = array("q", [-1]) * rows
        if not self._function(*self._fixed, tokens, input_ids.buffer_info()[0], positions.buffer_info()[0],
                              slot_mapping.buffer_info()[0], len(query_lens), tables_address, width, lens_address,
                              *(r.buffer_info()[0] if r is not None else None for r in ranges), rows,
                              logits_indices.buffer_info()[0], self._eps, self._scale, logits.data_ptr(),
                              picked.buffer_info()[0], torch.get_num_threads()):
            raise MemoryError("decode_stack: no memory for a linear kernel's prepared input")
        argmax = picked.tolist()
        return logits, (argmax if argmax and min(argmax) >= 0 else None)


def _within(values: array, size: int) -> bool:
    """Every entry of the int64 array in [0, size)."""
    return not values or (0 <= min(values) and max(values) < size)


def _linear_operand_shape(kind: str, out_features: int, in_features: int) -> tuple[int, ...]:
    """The shape of a linear's bf16 weight operand for a `DecodeStack` kind: plain, or `CpuKernels.pack_amx`'s tiles."""
    if kind == "amx":
        return (-(-out_features // 64) * 2, -(-in_features // 32), 2, 16, 16, 2)
    return (out_features, in_features)


def _linear_descriptors(what: str, linear: object, out_features: int, in_features: int) -> list[tuple[int, ...]]:
    """decode_stack_bf16's descriptors of a linear given as (kind, operand), its operand checked for the shape:
    one, or one per part of a quantised weight; without the last field (the next part)."""
    from llmctl.engine.kernels.quant import QuantRowOperand

    kind, operand = linear if isinstance(linear, tuple) and len(linear) == 2 else (None, None)
    if kind == "quant":
        if not isinstance(operand, QuantRowOperand) or (operand.weight.out_features, operand.weight.in_features) \
                != (out_features, in_features):
            raise ValueError(f"{what} must be a quantised weight [{out_features}, {in_features}]")
        return [(DecodeStack.KINDS[kind], *fields) for fields in operand.stack_fields()]
    if kind not in DecodeStack.KINDS:
        raise ValueError(f"{what} must be a (kind, operand) pair, kind one of {', '.join(DecodeStack.KINDS)}")
    _check_operand(what, operand, _linear_operand_shape(kind, out_features, in_features))
    return [(DecodeStack.KINDS[kind], operand.data_ptr(), 0, 0, 0, 0, 0, 0, out_features)]


def _check_operand(what: str, tensor: Optional[torch.Tensor], shape: tuple[int, ...]) -> None:
    if tensor is None or tensor.dtype != torch.bfloat16 or tuple(tensor.shape) != shape or not tensor.is_contiguous() \
            or tensor.device.type != "cpu":
        got = "None" if tensor is None else f"{tensor.dtype} {tuple(tensor.shape)}"
        raise ValueError(f"{what} must be a contiguous bfloat16 CPU tensor {shape}, got {got}")


def _check_rows(name: str, x: torch.Tensor, width: int, functions: dict) -> None:
    if x.dtype not in functions or not x.is_contiguous() or x.dim() < 1 or x.shape[-1] != width or width == 0:
        raise ValueError(f"{name}: expected a contiguous float32/bfloat16 tensor with last dimension {width}, "
                         f"got {x.dtype} {tuple(x.shape)}")


def _cache_dir() -> Path:
    explicit = os.environ.get("LLMCTL_CACHE_DIR")
    if explicit:
        return Path(explicit) / "kernels"
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "llmctl" / "kernels"


def _cpu_signature() -> str:
    """The CPU's feature flags: a library built with -march=native must not run on another CPU."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    import platform

    return platform.processor() or platform.machine()


def _build(compiler: str, source: Path = SOURCE, flags: tuple[str, ...] = FLAGS) -> Path:
    """The shared library built from `source` with `flags` (cached per source, flags, compiler and CPU)."""
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30).stdout
    key = hashlib.sha256("\0".join([source.read_text(), " ".join(flags), version, _cpu_signature()]).encode())
    target = _cache_dir() / f"{source.stem}-{key.hexdigest()[:16]}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # Build beside the target and rename: concurrent engines never load a half-written library.
    handle, partial = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(handle)
    try:
        result = subprocess.run([compiler, *flags, "-o", partial, str(source)], capture_output=True, text=True,
                                timeout=120)
        if result.returncode != 0:
            raise RuntimeError(result.stderr.strip().splitlines()[-1] if result.stderr.strip() else "compiler failed")
        os.replace(partial, target)
    finally:
        if os.path.exists(partial):
            os.unlink(partial)
    return target


def disabled() -> bool:
    """`LLMCTL_DISABLE_CPU_KERNELS=1`: every native kernel off (the torch paths run)."""
    return os.environ.get(DISABLE_ENV, "") not in ("", "0")


def find_compiler() -> Optional[str]:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def build_library(source: Path, flags: tuple[str, ...], what: str) -> Optional[ctypes.CDLL]:
    """`source` built with `flags` and loaded, or None (logged, naming `what` falls back) when the kernels are
    disabled, there is no compiler, or the build or load fails."""
    if disabled():
        return None
    compiler = find_compiler()
    if compiler is None:
        logger.warning("no C compiler found: %s", what)
        return None
    try:
        return ctypes.CDLL(str(_build(compiler, source, flags)))
    except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
        logger.warning("native kernels unavailable (%s): %s", exc, what)
        return None


@lru_cache(maxsize=1)
def load_cpu_kernels() -> Optional[CpuKernels]:
    """The built kernels, or None (logged once) when they cannot be used here."""
    library = build_library(SOURCE, FLAGS, "CPU decode attention uses the slower torch path")
    if library is None:
        return None
    try:
        if library.kernel_vector_bits() != 512:
            logger.info("CPU kernels need AVX-512: using the torch paths")
            return None
        return CpuKernels(library)
    except AttributeError as exc:
        logger.warning("CPU kernels unavailable (%s): using the torch path", exc)
        return None


def cpu_kernels_for(device: torch.device, dtype: torch.dtype) -> Optional[CpuKernels]:
    """The kernels a model on `device` in `dtype` is built with: None off CPU or for a dtype they lack."""
    if device.type != "cpu":
        return None
    kernels = load_cpu_kernels()
    return kernels if kernels is not None and dtype in kernels.dtypes else None
