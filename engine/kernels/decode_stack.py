"""`DecodeStack`: the native decode step (decode_step.c's `decode_stack_bf16`) bound to one model's operands.

The step's descriptors are declared once, in common.h; the ctypes `Structure`s here mirror them field for field
(`StackLinear`, `StackLayer`, `StackBuffers`, `StackModel`, `StackStep`), and `layout_mismatches` compares the two
through the library's `decode_stack_layout` (tests/test_native_decode_step.py runs it)."""

from __future__ import annotations

import ctypes
from array import array
from typing import Optional

import torch

from .quant import QuantRowOperand
from .tracing import profiled

_POINTER, _INT64 = ctypes.c_void_p, ctypes.c_int64


class StackLinear(ctypes.Structure):
    """A linear, or one part of a quantised weight in parts (chained by `next_part`, 0: the last)."""

    _fields_ = [("kind", _INT64), ("weight", _POINTER), ("scales", _POINTER), ("zeros", _POINTER), ("bits", _INT64),
                ("group", _INT64), ("quant_gemv", _POINTER), ("quant_share", _POINTER), ("rows", _INT64),
                ("next_part", _POINTER)]


class StackLayer(ctypes.Structure):
    """One decoder layer's operand addresses (linears: their first `StackLinear`; absent biases 0)."""

    _fields_ = [(name, _POINTER) for name in ("input_norm", "qkv", "qkv_bias", "o", "o_bias", "post_norm", "gate_up",
                                              "gate_up_bias", "down", "down_bias", "k_pool", "v_pool")]


class StackBuffers(ctypes.Structure):
    """The bf16 scratch rows the step writes, each for `max_tokens` rows."""

    _fields_ = [(name, _POINTER) for name in ("hidden", "residual", "normed", "qkv", "attended", "gate_up", "act",
                                              "logits", "cos", "sin", "last_x", "last_residual")]


class StackModel(ctypes.Structure):
    _fields_ = [(name, _INT64) for name in ("num_layers", "hidden", "heads", "kv_heads", "head_dim", "intermediate",
                                            "vocab", "num_blocks", "block_size", "window")] \
        + [("eps", ctypes.c_float), ("scale", ctypes.c_float)] \
        + [(name, _POINTER) for name in ("layers", "buffers", "embedding", "final_norm", "lm_head", "cos_table",
                                         "sin_table")]


class StackStep(ctypes.Structure):
    _fields_ = [("tokens", _INT64), ("token", _POINTER), ("position", _POINTER), ("slot", _POINTER),
                ("num_rows", _INT64), ("tables", _POINTER), ("table_width", _INT64), ("lens", _POINTER),
                ("starts", _POINTER), ("qlens", _POINTER), ("num_logits", _INT64), ("logits_rows", _POINTER)]


STRUCTURES = (StackLinear, StackLayer, StackBuffers, StackModel, StackStep)
KINDS = {"gemv": 0, "amx": 1, "quant": 2}  # common.h's STACK_GEMV, STACK_AMX, STACK_QUANT


class _LayoutEntry(ctypes.Structure):
    _fields_ = [("name", ctypes.c_char_p), ("offset", _INT64), ("size", _INT64)]


def layout_mismatches(library: ctypes.CDLL) -> list[str]:
    """How the ctypes mirrors differ from common.h's structs and kinds as the library was compiled (empty: none)."""
    function = library.decode_stack_layout
    function.argtypes, function.restype = [_POINTER, _INT64], _INT64
    count = function(None, 0)
    entries = (_LayoutEntry * count)()
    function(entries, count)
    native = {entry.name.decode(): (entry.offset, entry.size) for entry in entries}
    mirrored = {f"StackLinear.kind={name}": (value, 0) for name, value in KINDS.items()}
    for structure in STRUCTURES:
        mirrored[structure.__name__] = (0, ctypes.sizeof(structure))
        for name, kind in structure._fields_:
            mirrored[f"{structure.__name__}.{name}"] = (getattr(structure, name).offset, ctypes.sizeof(kind))
    return [f"{name}: C {native.get(name)}, ctypes {mirrored.get(name)}"
            for name in sorted(native.keys() | mirrored.keys()) if native.get(name) != mirrored.get(name)]


class DecodeStack:
    """`decode_stack_bf16` bound to one model's operands, checked once here: each call passes only the step's
    tokens, positions, slots and rows. It calls the kernels the model's forward calls, on the same operands,
    so its logits are bitwise that forward's; what it saves is the Python between them (benchmarks/
    decode_overhead.py). Steps of up to `MAX_TOKENS` tokens, more than one only where every linear's kernel is
    the AMX one (each of its output rows independent of the others; the quantised linears' forward for several
    rows may be another kernel than their GEMV)."""

    MAX_TOKENS = 16

    LAYER_FIELDS = tuple(name for name, _ in StackLayer._fields_)
    LINEARS = ("qkv", "o", "gate_up", "down")
    BIASES = frozenset({"qkv_bias", "o_bias", "gate_up_bias", "down_bias"})
    KINDS = KINDS

    def __init__(self, function, layers: list[dict[str, object]], embedding: torch.Tensor, final_norm: torch.Tensor,
                 lm_head: tuple[str, object], cos: torch.Tensor, sin: torch.Tensor, *, num_heads: int,
                 num_kv_heads: int, intermediate: int, eps: float, scale: float, window: Optional[int]):
        vocab, hidden = embedding.shape
        kv_heads, num_blocks, block_size, head_dim = layers[0]["k_pool"].shape
        if kv_heads != num_kv_heads or num_heads % num_kv_heads or block_size & (block_size - 1):
            raise ValueError("decode_stack: the pools' heads or block size do not fit the model")
        _check_operand("decode_stack: the embedding", embedding, (vocab, hidden))
        _check_operand("decode_stack: the final norm", final_norm, (hidden,))
        for table in (cos, sin):
            _check_operand("decode_stack: a RoPE table", table, (cos.shape[0], head_dim // 2))
        qkv_rows = (num_heads + 2 * num_kv_heads) * head_dim
        shapes = {"qkv": (qkv_rows, hidden), "o": (hidden, num_heads * head_dim), "gate_up": (2 * intermediate, hidden),
                  "down": (hidden, intermediate), "input_norm": (hidden,), "qkv_bias": (qkv_rows,), "o_bias": (hidden,),
                  "post_norm": (hidden,), "gate_up_bias": (2 * intermediate,), "down_bias": (hidden,),
                  "k_pool": (num_kv_heads, num_blocks, block_size, head_dim)}
        shapes["v_pool"] = shapes["k_pool"]
        linears = [("decode_stack: the lm_head", lm_head, (vocab, hidden))]
        for layer in layers:
            if set(layer) != set(self.LAYER_FIELDS):
                raise ValueError(f"decode_stack: a layer needs exactly {', '.join(self.LAYER_FIELDS)}")
            linears += [(f"decode_stack: {name}", layer[name], shapes[name]) for name in self.LINEARS]
        self._linears, first_parts = _linear_structs(linears)
        self._layers = (StackLayer * len(layers))()
        for index, layer in enumerate(layers):
            for name in self.LAYER_FIELDS:
                setattr(self._layers[index], name, first_parts[1 + 4 * index + self.LINEARS.index(name)]
                        if name in self.LINEARS else _tensor_address(name, layer[name], shapes[name], self.BIASES))
        self._function = function
        self._operands = (layers, embedding, final_norm, lm_head, cos, sin)  # alive while their addresses are used
        self.vocab, self.positions, self.pool_slots, self.num_blocks = vocab, cos.shape[0], num_blocks * block_size, num_blocks
        self.block_size = block_size
        self.kinds = frozenset(kind for kind, _ in [lm_head] + [layer[name] for layer in layers for name in self.LINEARS])
        self.max_tokens = self.MAX_TOKENS if self.kinds == {"amx"} else 1
        sizes = dict(hidden=hidden, residual=hidden, normed=hidden, qkv=qkv_rows, attended=num_heads * head_dim,
                     gate_up=2 * intermediate, act=intermediate, logits=vocab, cos=head_dim // 2, sin=head_dim // 2,
                     last_x=hidden, last_residual=hidden)
        self._scratch = {name: torch.empty(self.max_tokens * size, dtype=torch.bfloat16) for name, size in sizes.items()}
        self._buffers = StackBuffers(**{name: tensor.data_ptr() for name, tensor in self._scratch.items()})
        self._model = StackModel(len(layers), hidden, num_heads, num_kv_heads, head_dim, intermediate, vocab, num_blocks,
                                 block_size, window or 0, eps, scale, ctypes.addressof(self._layers),
                                 ctypes.addressof(self._buffers), embedding.data_ptr(), final_norm.data_ptr(),
                                 first_parts[0], cos.data_ptr(), sin.data_ptr())
        self._step = StackStep()
        self._addresses = (ctypes.addressof(self._model), ctypes.addressof(self._step))
        self._logits_buffer: Optional[torch.Tensor] = None  # [max_tokens, vocab] float32, once a step needs it
        self._logits: dict[int, torch.Tensor] = {}  # its leading rows, per logits row count: each call's output

    def can_run(self, query_lens: list[int], max_row_tokens: int) -> bool:
        """Whether a step of rows of `query_lens` new tokens fits (rows of at most `max_row_tokens`)."""
        return sum(query_lens) <= self.max_tokens and max(query_lens, default=0) <= max_row_tokens

    def _check_step(self, input_ids: array, positions: array, slot_mapping: array, block_tables: list[list[int]],
                    context_lens: list[int], query_lens: list[int], logits_indices: array) -> list[list[int]]:
        """The step's inputs checked against the bound model; returns each row's blocks its context needs."""
        if not all(isinstance(v, array) and v.typecode == "q"
                   for v in (input_ids, positions, slot_mapping, logits_indices)):
            raise ValueError("decode_stack: ids, positions, slots and logits indices must be int64 arrays")
        tokens = len(input_ids)
        if not 0 < tokens <= self.max_tokens or len(positions) != tokens or len(slot_mapping) != tokens \
                or sum(query_lens) != tokens or min(query_lens) < 1 or len(context_lens) != len(query_lens) \
                or len(block_tables) != len(query_lens) or any(q > c for q, c in zip(query_lens, context_lens)) \
                or len(logits_indices) > tokens:
            raise ValueError(f"decode_stack: {tokens} tokens in rows {query_lens} do not fit (at most {self.max_tokens})")
        needed = [table[: -(-length // self.block_size)] for table, length in zip(block_tables, context_lens)]
        blocks = [block for table in needed for block in table]
        if not (all(len(t) == -(-c // self.block_size) for t, c in zip(needed, context_lens))
                and 0 <= min(blocks) and max(blocks) < self.num_blocks
                and _within(input_ids, self.vocab) and _within(positions, self.positions)
                and _within(slot_mapping, self.pool_slots) and _within(logits_indices, tokens)):
            raise ValueError("decode_stack: a token, position, slot, logits row or block id lies outside its table")
        return needed

    def _logits_rows(self, rows: int) -> torch.Tensor:
        logits = self._logits.get(rows)
        if logits is None:
            with torch.inference_mode(False):  # plain tensors, whichever mode the first step ran in
                if self._logits_buffer is None:
                    self._logits_buffer = torch.empty(self.max_tokens, self.vocab, dtype=torch.float32)
                logits = self._logits[rows] = self._logits_buffer[:rows]
        return logits

    @profiled("decode_stack")
    def __call__(self, input_ids: array, positions: array, slot_mapping: array, block_tables: list[list[int]],
                 context_lens: list[int], query_lens: list[int], logits_indices: array
                 ) -> tuple[torch.Tensor, Optional[list[int]]]:
        """Float32 logits [len(logits_indices), vocab] of the step's tokens `input_ids` at `positions` (their K/V
        written at `slot_mapping`), in rows of `query_lens` consecutive tokens, row r on a context of
        `context_lens[r]` keys (its new tokens included) in `block_tables[r]`'s blocks; and each logits row's
        argmax where the step found them on the way (a one-token step in one parallel region), else None. The four
        vectors are int64 arrays (`array("q")`); the logits are the leading rows of this stack's one buffer,
        overwritten by the next call. No torch call but the logits' first allocation: after a step's weight stream
        each would run from cold caches."""
        needed = self._check_step(input_ids, positions, slot_mapping, block_tables, context_lens, query_lens,
                                  logits_indices)
        width = -(-max(context_lens) // self.block_size)
        # the block tables and the context lengths in one array
        tables_and_lens = array("q", [value for table in needed for value in table + [0] * (width - len(table))]
                                + context_lens)
        step, tokens, rows = self._step, len(input_ids), len(logits_indices)
        step.tokens, step.token, step.position = tokens, input_ids.buffer_info()[0], positions.buffer_info()[0]
        step.slot, step.num_rows, step.table_width = slot_mapping.buffer_info()[0], len(query_lens), width
        tables_address = tables_and_lens.buffer_info()[0]
        step.tables, step.lens = tables_address, tables_address + 8 * width * len(needed)
        ranges = None  # one token a row
        if tokens != len(query_lens):
            starts = [0]
            for length in query_lens[:-1]:
                starts.append(starts[-1] + length)
            ranges = (array("q", starts), array("q", query_lens))
        step.starts, step.qlens = (ranges[0].buffer_info()[0], ranges[1].buffer_info()[0]) if ranges else (None, None)
        step.num_logits, step.logits_rows = rows, logits_indices.buffer_info()[0]
        logits = self._logits_rows(rows)
        picked = array("q", [-1]) * rows
        if not self._function(*self._addresses, logits.data_ptr(), picked.buffer_info()[0], torch.get_num_threads()):
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


def _linear_fields(what: str, linear: object, out_features: int, in_features: int) -> list[tuple[int, ...]]:
    """A linear given as (kind, operand), its operand checked for the shape, as `StackLinear` fields without the
    next part: one tuple, or one per part of a quantised weight."""
    kind, operand = linear if isinstance(linear, tuple) and len(linear) == 2 else (None, None)
    if kind == "quant":
        if not isinstance(operand, QuantRowOperand) or (operand.weight.out_features, operand.weight.in_features) \
                != (out_features, in_features):
            raise ValueError(f"{what} must be a quantised weight [{out_features}, {in_features}]")
        return [(KINDS[kind], *fields) for fields in operand.stack_fields()]
    if kind not in KINDS:
        raise ValueError(f"{what} must be a (kind, operand) pair, kind one of {', '.join(KINDS)}")
    _check_operand(what, operand, _linear_operand_shape(kind, out_features, in_features))
    return [(KINDS[kind], operand.data_ptr(), 0, 0, 0, 0, 0, 0, out_features)]


def _linear_structs(linears: list[tuple[str, object, tuple[int, int]]]) -> tuple[ctypes.Array, list[int]]:
    """Every (what, linear, shape)'s `StackLinear`s in one array, each part naming the next by address; and the
    address of each linear's first."""
    parts = [_linear_fields(what, linear, *shape) for what, linear, shape in linears]
    structs = (StackLinear * sum(len(p) for p in parts))()
    base, size = ctypes.addressof(structs), ctypes.sizeof(StackLinear)
    firsts, index = [], 0
    for fields in parts:
        firsts.append(base + index * size)
        for number, values in enumerate(fields):
            structs[index] = StackLinear(*values, base + (index + 1) * size if number + 1 < len(fields) else None)
            index += 1
    return structs, firsts


def _tensor_address(name: str, tensor: Optional[torch.Tensor], shape: tuple[int, ...], optional: frozenset) -> int:
    """A layer tensor's address, checked for the shape (0 for an absent bias)."""
    if tensor is None and name in optional:
        return 0
    _check_operand(f"decode_stack: {name}", tensor, shape)
    return tensor.data_ptr()


def _check_operand(what: str, tensor: Optional[torch.Tensor], shape: tuple[int, ...]) -> None:
    if tensor is None or tensor.dtype != torch.bfloat16 or tuple(tensor.shape) != shape or not tensor.is_contiguous() \
            or tensor.device.type != "cpu":
        got = "None" if tensor is None else f"{tensor.dtype} {tuple(tensor.shape)}"
        raise ValueError(f"{what} must be a contiguous bfloat16 CPU tensor {shape}, got {got}")
