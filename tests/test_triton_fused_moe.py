"""The Triton fused-MoE kernel (engine/kernels/triton/fused_moe.py) against the torch experts: compiled on CUDA
where there is a GPU, else on CPU tensors under the Triton interpreter (tests/conftest.py sets TRITON_INTERPRET=1
before anything imports triton), and compiled for sm_90 without a GPU. Shapes that are no multiple of the tiles, experts no token chose, top-1 to top-4,
decode-sized and prefill-sized batches (both block sizes); and the alignment's invariants."""

from __future__ import annotations

import sys

import pytest
from triton_compile import assert_compiles_for_cuda
import torch
import torch.nn.functional as F

from llmctl.engine.layers.fused_moe.router import select_experts
from llmctl.engine.layers.fused_moe.torch_impl import fused_experts_torch

TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 3e-2}


@pytest.fixture(scope="module")
def fused_moe():
    pytest.importorskip("triton")
    from llmctl.engine.kernels.triton import interpreter_enabled

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cpu" and not interpreter_enabled():
        pytest.skip("no GPU, and triton was imported before TRITON_INTERPRET=1 could be set")
    from llmctl.engine.kernels.triton import fused_moe

    return fused_moe, device


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    size = gate_up.shape[-1] // 2
    return F.silu(gate_up[:, :size]) * gate_up[:, size:]


def problem(tokens, experts, top_k, hidden, inter, dtype, device, seed=0):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=generator)
    w13 = torch.randn(experts, 2 * inter, hidden, generator=generator) / hidden ** 0.5
    w2 = torch.randn(experts, hidden, inter, generator=generator) / inter ** 0.5
    logits = torch.randn(tokens, experts, generator=generator)
    logits[:, -1] = -1e9  # the last expert is never chosen: its blocks must not exist
    weights, ids = select_experts(logits, top_k, True, torch.float32)
    return [t.to(device) for t in (x.to(dtype), w13.to(dtype), w2.to(dtype), weights.to(dtype), ids)]


@pytest.mark.parametrize("tokens,experts,top_k,hidden,inter,dtype", [
    (1, 8, 2, 64, 32, torch.float32),     # batch-1 decode
    (5, 4, 1, 48, 40, torch.float32),     # hidden and inter no multiple of the tiles
    (37, 6, 3, 32, 72, torch.float32),    # more pairs than 16 per expert: BLOCK_M 64
    (9, 8, 4, 64, 48, torch.bfloat16),
])
def test_fused_experts_match_torch(fused_moe, tokens, experts, top_k, hidden, inter, dtype):
    kernels, device = fused_moe
    x, w13, w2, weights, ids = problem(tokens, experts, top_k, hidden, inter, dtype, device)
    got = kernels.fused_experts_triton(x, w13, w2, weights, ids, silu_and_mul)
    expected = fused_experts_torch(x.float(), w13.float(), w2.float(), weights.float(), ids, silu_and_mul)
    assert got.shape == x.shape and got.dtype == dtype
    torch.testing.assert_close(got.float(), expected, atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])


def test_alignment_groups_every_pair_once_in_its_experts_blocks(fused_moe):
    kernels, device = fused_moe
    generator = torch.Generator().manual_seed(3)
    experts, block_m = 5, 4
    ids = torch.randint(0, experts - 1, (13, 2), generator=generator).to(device)  # expert 4 unused
    sorted_ids, block_experts, num_padded = kernels.moe_align_block_size(ids, block_m, experts)
    flat, used = ids.flatten().cpu(), int(num_padded.item())
    assert used % block_m == 0 and used <= sorted_ids.numel()
    sorted_ids, block_experts = sorted_ids.cpu(), block_experts.cpu()
    real = sorted_ids[:used][sorted_ids[:used] < flat.numel()]
    assert sorted(real.tolist()) == list(range(flat.numel()))  # each pair exactly once
    assert (sorted_ids[used:] == flat.numel()).all()
    for block in range(used // block_m):
        pairs = sorted_ids[block * block_m:(block + 1) * block_m]
        pairs = pairs[pairs < flat.numel()]
        assert len(pairs) > 0 and (flat[pairs] == block_experts[block]).all()
    counts = torch.bincount(flat, minlength=experts)
    assert used == int(((counts + block_m - 1) // block_m * block_m).sum())


def test_pairs_held_by_another_expert_parallel_rank_add_nothing(fused_moe):
    """Expert parallelism: each rank's w13/w2 hold its block of experts and the other ranks' pairs carry the id
    past them; the kernel skips those pairs, and the two ranks' outputs sum to all experts' on one rank."""
    kernels, device = fused_moe
    x, w13, w2, weights, ids = problem(21, 6, 2, 48, 40, torch.float32, device, seed=5)
    halves = []
    for held in (range(0, 3), range(3, 6)):
        local = torch.where((ids >= held.start) & (ids < held.stop), ids - held.start, len(held))
        halves.append(kernels.fused_experts_triton(x, w13[held.start:held.stop], w2[held.start:held.stop],
                                                   weights, local, silu_and_mul))
        torch.testing.assert_close(halves[-1], fused_experts_torch(x, w13[held.start:held.stop],
                                                                   w2[held.start:held.stop], weights, local,
                                                                   silu_and_mul), atol=1e-4, rtol=1e-4)
    expected = fused_experts_torch(x, w13, w2, weights, ids, silu_and_mul)
    torch.testing.assert_close(halves[0] + halves[1], expected, atol=1e-4, rtol=1e-4)


def compile_for_cuda(capability: int) -> None:
    """Compile the grouped GEMM (bf16 with the router weight, fp32 IEEE without) for an sm_`capability` GPU: no GPU
    needed, run where TRITON_INTERPRET is unset. Exits 3 where this triton has not the compiler entry points."""
    try:
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource, compile
    except ImportError:
        sys.exit(3)
    from llmctl.engine.kernels.triton import fused_moe

    kernel = fused_moe._grouped_gemm_kernel
    names = kernel.arg_names
    for element, constants in (("*bf16", dict(PAIRS_PER_ROW=1, MUL_ROUTE=True, PRECISION=None)),
                               ("*fp32", dict(PAIRS_PER_ROW=2, MUL_ROUTE=False, PRECISION="ieee"))):
        constants.update(UPCAST=False, BLOCK_M=16, BLOCK_N=fused_moe.BLOCK_N, BLOCK_K=fused_moe.BLOCK_K)
        signature = {name: "constexpr" if name in constants else
                     "*i32" if name in ("sorted_ids_ptr", "block_experts_ptr", "num_padded_ptr") else
                     element if name.endswith("_ptr") else "i32" for name in names}
        source = ASTSource(fn=kernel, signature=signature,
                           constexprs={(names.index(name),): value for name, value in constants.items()})
        assert "cubin" in compile(source, target=GPUTarget("cuda", capability, 32), options={"num_warps": 4}).asm


def test_kernel_compiles_for_a_cuda_gpu(tmp_path):
    """The kernel the interpreter ran also compiles to a cubin for Hopper (sm_90) in a process without the
    interpreter: no interpreter-only construct slipped in."""
    assert_compiles_for_cuda("test_triton_fused_moe", tmp_path)
