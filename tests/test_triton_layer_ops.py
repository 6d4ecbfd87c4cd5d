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
    from llmctl.engine.layers.quantization_cuda import fp8_linear, quantize_fp8, rowwise_fp8_runs

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
