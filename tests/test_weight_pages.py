"""The CPU weights and KV pools in transparent huge pages (engine/weight_pages.py): one 2 MiB-aligned mapping
advised MADV_HUGEPAGE holds every weight storage, views still share memory, the quantised kernels' cached
pointers follow, and the engine's outputs are bitwise those of the same engine in 4 KiB pages."""

from __future__ import annotations

import pytest
import torch
from gguf_writer import write_gguf
from test_gguf import Q5_K_M, k_quant_model  # noqa: F401 (a fixture)
from test_parity import make_prompts
from test_quantization import run_greedy

from llmctl.engine import LLM
from llmctl.engine import weight_pages
from llmctl.engine.layers.linear import LinearBase

needs_thp = pytest.mark.skipif(not weight_pages.huge_pages_available(),
                               reason="no transparent huge pages here (Linux, THP always/madvise)")


def mapping_flags(address: int) -> set[str]:
    """VmFlags of the mapping holding `address` (/proc/self/smaps)."""
    start = None
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            head = line.split()[0]
            if "-" in head and all(c in "0123456789abcdef-" for c in head):
                low, high = (int(v, 16) for v in head.split("-"))
                start = low <= address < high
            elif start and line.startswith("VmFlags:"):
                return set(line.split()[1:])
    return set()


def engine(folder, quantization, monkeypatch, huge: bool) -> LLM:
    monkeypatch.setenv(weight_pages.ENV, "1" if huge else "0")
    return LLM(str(folder), skip_tokenizer_init=True, dtype="bfloat16", device="cpu", quantization=quantization,
               max_model_len=256, num_threads=2)


def move_everything(monkeypatch) -> None:
    """The tiny models' storages are far under the thresholds a real model passes: move all of them here."""
    monkeypatch.setattr(weight_pages, "MIN_TOTAL_BYTES", 0)
    monkeypatch.setattr(weight_pages, "MIN_STORAGE_BYTES", 1)


def assert_same_greedy_outputs(huge: LLM, plain: LLM) -> None:
    prompts = make_prompts(512)[:3]
    for (_, tokens, logits), (_, tokens_plain, logits_plain) in zip(run_greedy(huge, prompts),
                                                                   run_greedy(plain, prompts)):
        assert tokens == tokens_plain and torch.equal(logits, logits_plain)


@needs_thp
@pytest.mark.parametrize("arch, quantization", [("llama", "int4-g32"), ("qwen2", "int8"), ("llama", None)])
def test_weights_move_into_one_huge_page_mapping_and_outputs_stay_bitwise(tiny_models, monkeypatch, arch,
                                                                         quantization):
    folder = tiny_models[arch]  # qwen2: tied lm_head (one storage, two modules), q/k/v biases
    plain = engine(folder, quantization, monkeypatch, huge=False)
    move_everything(monkeypatch)
    huge = engine(folder, quantization, monkeypatch, huge=True)
    runner = huge.engine.executor.runner
    linears = [m for m in runner.model.modules() if isinstance(m, LinearBase)]
    storages = {p.untyped_storage().data_ptr() for m in linears for p in m.parameters()}
    assert len(storages) == 1  # every linear's parameters: one mapping
    (arena,) = storages
    assert arena % weight_pages.HUGE_PAGE == 0 and "hg" in mapping_flags(arena)
    for layer in linears:
        parts = getattr(layer, "kernel_parts", None)
        for part in parts.parts if parts is not None else ():  # views of the flat storage, pointers rebound
            assert part.codes.untyped_storage().data_ptr() == arena
            assert part.arguments[:2] == (part.codes.data_ptr(), part.scales.data_ptr())
    pool = runner.kv_caches[0]
    assert pool.data_ptr() % weight_pages.HUGE_PAGE == 0 and "hg" in mapping_flags(pool.data_ptr())
    # the reported bytes are the storages' own, each rounded up to 64 (not the mapping's 2 MiB pages)
    assert 0 <= huge.engine.model_info.weight_bytes - plain.engine.model_info.weight_bytes < 64 * 100
    assert_same_greedy_outputs(huge, plain)


@needs_thp
def test_a_gguf_files_mixed_k_quants_move_and_run_bitwise(k_quant_model, tmp_path, monkeypatch):  # noqa: F811
    """Q5_K with Q6_K tensors (6-bit codes, groups of 16 and 32 in one fused qkv; a Q6_K lm_head)."""
    path = tmp_path / "model-Q5_K_M.gguf"
    write_gguf(k_quant_model, path, Q5_K_M, default_type="Q5_K")
    plain = engine(path, None, monkeypatch, huge=False)
    move_everything(monkeypatch)
    huge = engine(path, None, monkeypatch, huge=True)
    model = huge.engine.executor.runner.model
    parts = [part for m in model.modules() if hasattr(m, "kernel_parts") for part in m.kernel_parts.parts]
    assert parts and len({part.codes.untyped_storage().data_ptr() for part in parts}) == 1
    assert all(part.arguments[0] == part.codes.data_ptr() for part in parts)
    assert_same_greedy_outputs(huge, plain)


def test_nothing_moves_when_turned_off_or_under_the_threshold(tiny_models, monkeypatch):
    llm = engine(tiny_models["llama"], "int4-g32", monkeypatch, huge=False)
    model = llm.engine.executor.runner.model
    assert not weight_pages.huge_pages_available()
    assert weight_pages.move_weights_to_huge_pages(model) == 0
    assert weight_pages.huge_page_zeros((8 << 20,), torch.bfloat16) is None
    monkeypatch.setenv(weight_pages.ENV, "1")
    before = {p.data_ptr() for p in model.parameters()}
    assert weight_pages.move_weights_to_huge_pages(model) == 0  # a tiny model: under MIN_TOTAL_BYTES
    assert {p.data_ptr() for p in model.parameters()} == before


@needs_thp
def test_huge_page_zeros_are_zero_and_aligned():
    pool = weight_pages.huge_page_zeros((2, 3, 1 << 20, 4), torch.bfloat16)
    assert pool.shape == (2, 3, 1 << 20, 4) and pool.dtype is torch.bfloat16 and pool.is_contiguous()
    assert pool.data_ptr() % weight_pages.HUGE_PAGE == 0 and not pool.any()
    assert "hg" in mapping_flags(pool.data_ptr())
