"""`CpuKernels`: the typed entry points of the CPU library (attention.c, elementwise.c, linear_bf16.c, decode_step.c),
every call's tensors checked before any pointer is passed. CPU attention for decodes and short rows (speculative
verify rows) reads the paged KV pool directly instead of gathering it, and bf16 linears run on AMX tiles where the
CPU has them (`gemm_amx`, the weight in `pack_amx`'s layout)."""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import Optional

import torch

from .decode_stack import DecodeStack
from .tracing import profiled

_SUFFIX = {torch.bfloat16: "bf16", torch.float32: "f32"}
# q, q row stride, k_pool, v_pool, tables, table stride, lens, starts, qlens, out, 6 sizes, scale, window, threads
_POINTER, _INT64 = ctypes.c_void_p, ctypes.c_int64
_PAGED_ARGTYPES = [_POINTER, _INT64, _POINTER, _POINTER, _POINTER, _INT64] + [_POINTER] * 4 + [_INT64] * 6 \
    + [ctypes.c_float, _INT64, ctypes.c_int]


class CpuKernels:
    """Typed entry points of the built library; arguments are checked before any pointer is passed."""

    dtypes = tuple(_SUFFIX)
    max_group = 16  # MAX_GROUP in cpu_internal.h

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
        self._decode_stack.argtypes = [_POINTER] * 4 + [ctypes.c_int]  # model, step, logits, their argmax; threads
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
        decode step's weight stream a torch.empty and a tolist run from cold caches."""
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



def _check_rows(name: str, x: torch.Tensor, width: int, functions: dict) -> None:
    if x.dtype not in functions or not x.is_contiguous() or x.dim() < 1 or x.shape[-1] != width or width == 0:
        raise ValueError(f"{name}: expected a contiguous float32/bfloat16 tensor with last dimension {width}, "
                         f"got {x.dtype} {tuple(x.shape)}")

