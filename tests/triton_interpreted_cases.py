"""The Triton layer kernels (engine/kernels/triton: RMSNorm, residual add + RMSNorm, SiLU*mul, RoPE) against
torch over shapes and dtypes, and tiny Llama / Qwen3 models built with them giving transformers' greedy tokens.

Run by tests/test_triton_layer_ops.py in a subprocess with TRITON_INTERPRET=1 (Triton's interpreter runs the
kernels on CPU tensors; the variable must be set before triton is first imported, which in the suite's own
process some other test may already have done). The interpreter rounds float32 to bfloat16 by truncation
(a GPU rounds to nearest), hence bf16 tolerances of a couple of ulps.
"""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from llmctl.engine.layers.rotary import rotate

if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("run through tests/test_triton_layer_ops.py (needs TRITON_INTERPRET=1 before triton is imported)",
                allow_module_level=True)
pytest.importorskip("triton", reason="the Triton kernels need the triton package")

from llmctl.engine.kernels.triton import activation, norm, rope  # noqa: E402 - after the checks above
from llmctl.engine.layers.fused_ops import TritonLayerOps  # noqa: E402

TOLERANCE = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.float16: dict(rtol=2e-3, atol=2e-3),
             torch.bfloat16: dict(rtol=2e-2, atol=2e-2)}
dtypes = st.sampled_from(list(TOLERANCE))
rows = st.integers(1, 17)
FEW = settings(max_examples=6, deadline=None, derandomize=True)


@pytest.fixture(scope="module")
def interpreted():
    return SimpleNamespace(norm=norm, activation=activation, rope=rope, ops=TritonLayerOps(torch.device("cpu")))


def close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    torch.testing.assert_close(actual, expected, **TOLERANCE[expected.dtype])


@FEW
@given(rows=rows, size=st.sampled_from([576, 896, 4096, 64]), dtype=dtypes, seed=st.integers(0, 2**16))
def test_rms_norm_and_fused_add_match_torch(interpreted, rows, size, dtype, seed):
    generator = torch.Generator().manual_seed(seed)
    x, residual = (torch.randn(rows, size, generator=generator).to(dtype) for _ in range(2))
    weight = torch.randn(size, generator=generator).to(dtype)
    close(interpreted.norm.rms_norm(x, weight, 1e-6), F.rms_norm(x, (size,), weight, 1e-6))
    updated = residual.clone()
    normed, returned = interpreted.norm.fused_add_rms_norm(x, updated, weight, 1e-5)
    expected_residual = residual + x
    assert returned is updated  # the residual stream is updated in place
    close(updated, expected_residual)
    close(normed, F.rms_norm(expected_residual, (size,), weight, 1e-5))


@FEW
@given(tokens=rows, heads=st.integers(1, 6), head_dim=st.sampled_from([64, 96, 128]), dtype=dtypes)
def test_rms_norm_of_strided_heads_matches_torch(interpreted, tokens, heads, head_dim, dtype):
    """Qwen3's q/k norm: [tokens, heads, head_dim] views into a fused qkv output, normalised per head."""
    qkv = torch.randn(tokens, 3 * heads * head_dim).to(dtype)
    q = qkv[:, : heads * head_dim].view(tokens, heads, head_dim)
    weight = torch.randn(head_dim).to(dtype)
    out = interpreted.norm.rms_norm(q, weight, 1e-6)
    assert out.shape == q.shape and out.is_contiguous()
    close(out, F.rms_norm(q, (head_dim,), weight, 1e-6))


@FEW
@given(rows=rows, size=st.sampled_from([576, 896, 1500, 4864]), dtype=dtypes, seed=st.integers(0, 2**16))
def test_silu_and_mul_matches_torch(interpreted, rows, size, dtype, seed):
    gate_up = (4 * torch.randn(rows, 2 * size, generator=torch.Generator().manual_seed(seed))).to(dtype)
    gate, up = gate_up.chunk(2, dim=-1)
    close(interpreted.activation.silu_and_mul(gate_up), F.silu(gate) * up)


@FEW
@given(tokens=rows, heads=st.integers(1, 9), kv_heads=st.integers(1, 3), head_dim=st.sampled_from([64, 96, 128]),
       dtype=dtypes)
def test_rotary_in_place_on_fused_qkv_matches_torch(interpreted, tokens, heads, kv_heads, head_dim, dtype):
    """q and k rotated where they lie in the qkv output; v (after them) left untouched."""
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim).to(dtype)
    angles = torch.rand(tokens, 1, head_dim // 2) * 100
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    rotated_heads = heads + kv_heads
    expected = rotate(qkv[:, : rotated_heads * head_dim].view(tokens, rotated_heads, head_dim), cos, sin)
    x = qkv.clone()
    out = interpreted.ops.rotary(x, rotated_heads, head_dim, cos, sin)
    assert out.data_ptr() == x.data_ptr() and out.shape == (tokens, rotated_heads, head_dim)
    close(out, expected)
    assert torch.equal(x[:, rotated_heads * head_dim:], qkv[:, rotated_heads * head_dim:])


def test_kernels_refuse_what_they_cannot_address(interpreted):
    with pytest.raises(ValueError, match="rms_norm: needs a 2-D or 3-D tensor"):
        interpreted.norm.rms_norm(torch.randn(8), torch.randn(8), 1e-6)
    with pytest.raises(ValueError, match="silu_and_mul"):
        interpreted.activation.silu_and_mul(torch.randn(4, 7))
    with pytest.raises(ValueError, match="rotary_"):
        interpreted.rope.rotary_(torch.randn(2, 64), 2, 64, torch.randn(2, 32), torch.randn(2, 32))


def greedy_tokens(model, prompt: list[int], new_tokens: int) -> tuple[list[int], torch.Tensor]:
    """The engine model's greedy continuation (prefill, then one-token decodes through the torch attention
    backend's paged pool) and the prefill's last logits row."""
    from llmctl.engine.layers.attention import CommonAttentionMetadata
    from llmctl.engine.layers.attention.torch_backend import TorchAttention

    config = model.config
    backend = TorchAttention(config.num_heads, config.num_kv_heads, config.head_dim, None, dtype=torch.float32)
    block_size, blocks = 16, 4
    kv_caches = [torch.zeros(2, *backend.kv_cache_shape(blocks, block_size)) for _ in model.model.layers]
    tokens, first_logits, done = list(prompt), None, 0
    with torch.inference_mode():
        while len(tokens) < len(prompt) + new_tokens:
            step = tokens[done:]
            positions = torch.arange(done, len(tokens))
            batch = CommonAttentionMetadata(seq_ids=[0], query_lens=[len(step)], context_lens=[len(tokens)],
                                            block_tables=[list(range(blocks))], slot_mapping=positions.clone(),
                                            block_size=block_size)
            logits = model(torch.tensor(step), positions, kv_caches, backend.build_metadata(batch), backend,
                           torch.tensor([len(step) - 1]))
            first_logits = logits[0] if first_logits is None else first_logits
            done = len(tokens)
            tokens.append(int(logits[0].argmax()))
    return tokens[len(prompt):], first_logits


@pytest.fixture(scope="module")
def tiny_pair(tmp_path_factory):
    """The two tiny checkpoints these cases need (conftest's `tiny_models` saves all four)."""
    from conftest import make_tiny_model

    root = tmp_path_factory.mktemp("tiny-triton")
    return {arch: make_tiny_model(root / arch, arch) for arch in ("llama", "qwen3")}


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_tiny_model_with_triton_ops_matches_transformers(interpreted, tiny_pair, arch):
    from transformers import AutoModelForCausalLM

    from llmctl.engine.layers.linear import UnquantizedLinearMethod
    from llmctl.engine.loader import build_model
    from llmctl.engine.model_config import ModelConfig

    folder = tiny_pair[arch]
    model = build_model(ModelConfig.from_pretrained(folder), folder, max_positions=64, dtype=torch.float32,
                        device=torch.device("cpu"), load_format="auto", seed=0,
                        linear_method=UnquantizedLinearMethod(), ops=interpreted.ops)
    prompt = [(37 * i + 11) % 500 for i in range(12)]
    tokens, prefill_logits = greedy_tokens(model, prompt, 8)
    reference = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        expected = reference.generate(torch.tensor([prompt]), max_new_tokens=8, min_new_tokens=8,
                                      do_sample=False)[0, len(prompt):]
        expected_logits = reference(torch.tensor([prompt])).logits[0, -1].float()
    assert tokens == expected.tolist()
    assert (prefill_logits - expected_logits).abs().max().item() < 1e-3


@FEW
@given(rows=rows, size=st.sampled_from([576, 896, 4096]), dtype=dtypes, seed=st.integers(0, 2**16))
def test_per_token_fp8_quant_matches_torch(rows, size, dtype, seed):
    """Scales bitwise `quantize_fp8`'s; codes too, but where the interpreter's float32 -> e4m3 conversion is not
    a GPU's: it rounds ties away from zero (a GPU: to even), drops the carry when rounding reaches a power of two
    and truncates subnormals."""
    from llmctl.engine.kernels.triton.quant import per_token_quant_fp8
    from llmctl.engine.layers.quantization.fp8 import quantize_fp8

    x = (3 * torch.randn(rows, size, generator=torch.Generator().manual_seed(seed))).to(dtype)
    x[rows // 2] = 0  # an all-zero row keeps the smallest positive scale
    codes, scales = per_token_quant_fp8(x)
    expected_codes, expected_scales = quantize_fp8(x, per_channel=True)
    assert codes.dtype == torch.float8_e4m3fn and torch.equal(scales, expected_scales)
    scaled, ours, theirs = x.float() / expected_scales, codes.float(), expected_codes.float()
    tie = (scaled - ours).abs() == (scaled - theirs).abs()
    carry = (theirs.abs() > scaled.abs()) & (torch.frexp(theirs)[0].abs() == 0.5)
    subnormal = scaled.abs() < 2**-6  # e4m3's smallest normal
    differ = ours != theirs
    assert torch.all(~differ | tie | carry | subnormal) and differ.float().mean() < 0.1
