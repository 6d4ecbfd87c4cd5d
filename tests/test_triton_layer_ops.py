"""Which layer ops a model gets, and the Triton kernels' cases (tests/triton_interpreted_cases.py) run in
Triton's interpreter in a subprocess: TRITON_INTERPRET=1 must be set before triton is first imported, and set
here it would leak into every later test of this process."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from llmctl.engine.layers.fused_ops import NativeCpuLayerOps, TorchLayerOps, select_layer_ops, triton_layer_ops

CASES = Path(__file__).with_name("triton_interpreted_cases.py")


def test_layer_ops_selection():
    cpu = torch.device("cpu")
    assert isinstance(select_layer_ops(cpu), TorchLayerOps) and triton_layer_ops(cpu) is None
    marker = object()
    native = select_layer_ops(cpu, marker)
    assert isinstance(native, NativeCpuLayerOps) and native.kernels is marker


def test_triton_kernels_in_the_interpreter():
    pytest.importorskip("triton", reason="the Triton kernels need the triton package")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(CASES)], env=env,
                         cwd=CASES.parent.parent, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-2000:]
    assert " passed" in run.stdout and "skipped" not in run.stdout, run.stdout[-2000:]


def test_fp8_linear_quantises_rows_with_the_given_quantizer():
    from llmctl.engine.layers.quantization.fp8 import fp8_linear, quantize_fp8, rowwise_fp8_runs

    if not rowwise_fp8_runs(torch.device("cpu"), torch.bfloat16):
        pytest.skip(f"this torch's CPU _scaled_mm takes per-tensor scales only (torch {torch.__version__})")
    seen = []

    def quantize_rows(x):
        seen.append(tuple(x.shape))
        return quantize_fp8(x, per_channel=True)

    x, weight = torch.randn(3, 32).to(torch.bfloat16), torch.randn(16, 32)
    codes, scale = quantize_fp8(weight, per_channel=True)
    out = fp8_linear(x, codes, scale, True, quantize_rows=quantize_rows)
    assert seen == [(3, 32)] and torch.equal(out, fp8_linear(x, codes, scale, True))
    fp8_linear(x, codes.view(16, 32), quantize_fp8(weight, per_channel=False)[1], False, quantize_rows=quantize_rows)
    assert seen == [(3, 32)]  # per-tensor scales: the whole tensor's, not the rows' quantiser


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_triton_ops_compile_and_match_torch_on_cuda(dtype):
    """The kernels compiled for a real GPU (rounding to nearest there, so 16-bit results within an ulp of torch's)
    at Llama-3-8B's sizes: hidden 4096, 32 query and 8 KV heads of 128, intermediate 14336."""
    device = torch.device("cuda")
    ops = triton_layer_ops(device)
    if ops is None:
        pytest.skip("triton does not import or does not compile for this GPU (sm80+)")
    reference, eps = TorchLayerOps(), 1e-5
    tolerance = dict(rtol=1e-5, atol=1e-5) if dtype is torch.float32 else dict(rtol=1e-2, atol=1e-2)
    x, residual = (torch.randn(13, 4096, device=device, dtype=dtype) for _ in range(2))
    weight = torch.randn(4096, device=device, dtype=dtype)
    torch.testing.assert_close(ops.rms_norm(x, weight, eps), reference.rms_norm(x, weight, eps), **tolerance)
    normed, updated = ops.add_rms_norm(x, residual.clone(), weight, eps)
    expected_normed, expected_residual = reference.add_rms_norm(x, residual, weight, eps)
    torch.testing.assert_close(updated, expected_residual, **tolerance)
    torch.testing.assert_close(normed, expected_normed, **tolerance)
    gate_up = torch.randn(13, 2 * 14336, device=device, dtype=dtype)
    torch.testing.assert_close(ops.silu_and_mul(gate_up), reference.silu_and_mul(gate_up), **tolerance)
    qkv = torch.randn(13, (32 + 2 * 8) * 128, device=device, dtype=dtype)
    head_weight = torch.randn(128, device=device, dtype=dtype)
    q = qkv[:, : 32 * 128].view(13, 32, 128)  # Qwen3's q norm: strided heads
    torch.testing.assert_close(ops.rms_norm(q, head_weight, eps), reference.rms_norm(q, head_weight, eps), **tolerance)
    angles = torch.rand(13, 1, 64, device=device) * 1000
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    expected = reference.rotary(qkv, 40, 128, cos, sin)
    torch.testing.assert_close(ops.rotary(qkv.clone(), 40, 128, cos, sin), expected, **tolerance)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
                    reason="needs a CUDA GPU with fp8 (sm_89+)")
def test_triton_fp8_row_quantizer_is_bitwise_torchs_on_cuda():
    from llmctl.engine.layers.quantization.fp8 import quantize_fp8, triton_row_quantizer

    quantize_rows = triton_row_quantizer(torch.device("cuda"))
    if quantize_rows is None:
        pytest.skip("triton does not import")
    x = 3 * torch.randn(13, 4096, device="cuda", dtype=torch.bfloat16)
    codes, scales = quantize_rows(x)
    expected_codes, expected_scales = quantize_fp8(x, per_channel=True)
    assert torch.equal(scales, expected_scales)
    assert torch.equal(codes.view(torch.uint8), expected_codes.view(torch.uint8))
