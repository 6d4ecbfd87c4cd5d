"""GGUF files (`--model file.gguf`): a tiny random model converted by tests/gguf_writer.py (the gguf package's
writer, llama.cpp's names and q/k permutation) loads with its architecture from the metadata; greedy tokens
and logits match transformers running the dequantised weights; the tokenizer built from the metadata encodes
like the folder's; block decoders against the gguf package's dequantisers."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from conftest import TOKENIZER_TEXT, make_tiny_model, save_tiny_tokenizer
from gguf_writer import dequantize, quantize, reference_model, write_gguf
from test_compressed_tensors import check_against_reference
from test_generate_cli import run_cli
from test_parity import make_prompts, reference_logits
from test_quantization import run_greedy

from llmctl.engine import LLM
from llmctl.engine.errors import ModelLoadError
from llmctl.engine.kernels.quant import IQ4_CODES, IQ4_GRID, load_quant_kernels
from llmctl.engine.layers.quantization.gguf import GROUPED_DECODERS, grouped_weight
from llmctl.engine.layers.linear import LinearBase
from llmctl.engine.tokenizer import Tokenizer

# llama.cpp's Q4_K_M mix on two layers (Q6_K for the output, attn_v and ffn_down where it spends more bits), with
# one tensor in a type that has no grouped form (TQ2_0, ternary), which runs dequantised
Q4_K_M = {"output.weight": "Q6_K", "blk.0.attn_v.weight": "Q6_K", "blk.0.ffn_down.weight": "Q6_K",
          "blk.1.ffn_down.weight": "TQ2_0"}
# Q5_K_M: Q5_K with the same Q6_K tensors (and an IQ4_XS file's mix the same way)
Q5_K_M = {"output.weight": "Q6_K", "blk.0.attn_v.weight": "Q6_K", "blk.0.ffn_down.weight": "Q6_K"}


@pytest.fixture(scope="module")
def k_quant_model(tmp_path_factory):
    """K-quants need rows of 256 values: a llama of hidden 256 (no rope scaling: GGUF has no llama3 keys)."""
    import transformers

    config = transformers.LlamaConfig(hidden_size=256, intermediate_size=256, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=512,
                                      max_position_embeddings=1024, initializer_range=0.1)
    torch.manual_seed(0)
    folder = tmp_path_factory.mktemp("gguf-k") / "llama"
    transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(folder)
    return folder


def layouts(llm) -> dict[str, str]:
    model = llm.engine.executor.runner.model
    return {name: getattr(m, "quant_layout", "float") for name, m in model.named_modules() if isinstance(m, LinearBase)}


def grouped_forms(llm) -> dict[str, object]:
    """Per linear: (bits, group) of its grouped weight, or "float" where it runs dequantised."""
    model = llm.engine.executor.runner.model
    return {name: (m.quant_bits, m.quant_group_size) if hasattr(m, "quant_layout") else "float"
            for name, m in model.named_modules() if isinstance(m, LinearBase)}


# llama: untied lm_head, q/k rows permuted in the file; qwen2: tied lm_head, q/k/v biases; qwen3: q/k norms
# llama3: the llama3 rope scaling as the file's rope_freqs divisors
@pytest.mark.parametrize("arch, kind, layout", [("llama", "Q8_0", "dequant"), ("qwen2", "Q4_0", "int4pack"),
                                                ("llama", "Q4_1", "int4pack"), ("llama", "Q5_0", "dequant"),
                                                ("qwen2", "Q5_1", "dequant"), ("qwen2", "IQ4_NL", "dequant"),
                                                ("qwen3", "BF16", "float"),
                                                ("mistral", "F16", "float"), ("llama3", "F32", "float")])
def test_greedy_tokens_and_logits_match_the_dequantised_reference(tiny_models, tmp_path, arch, kind, layout):
    from transformers import AutoModelForCausalLM

    if arch == "llama":
        source = make_tiny_model(tmp_path / "llama", "llama", rope_scaling=None)
    else:
        source = tiny_models["llama" if arch == "llama3" else arch]
    path = tmp_path / f"model-{kind}.gguf"
    held = write_gguf(source, path, {}, default_type=kind)
    llm = LLM(str(path), skip_tokenizer_init=True, dtype="float32", device="cpu", max_model_len=400,
              max_num_batched_tokens=96)
    found = layouts(llm)
    assert {v for k, v in found.items() if k != "lm_head"} == {layout}
    unquantised = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).eval()
    check_against_reference(llm, reference_model(source, held), None if kind in ("F32", "F16", "BF16") else unquantised,
                            prompts=3)


def test_q4_k_m_mix_runs_grouped_with_q6_k_as_6_bit_codes(k_quant_model, tmp_path, caplog):
    from transformers import AutoModelForCausalLM

    path = tmp_path / "model-Q4_K_M.gguf"
    held = write_gguf(k_quant_model, path, Q4_K_M, default_type="Q4_K")
    with caplog.at_level("INFO", logger="llmctl"):
        llm = LLM(str(path), skip_tokenizer_init=True, dtype="float32", device="cpu", max_model_len=400,
                  max_num_batched_tokens=96)
    found = grouped_forms(llm)
    # layer 0: Q4_K q/k beside a Q6_K v make one 6-bit qkv in groups of 16; its Q6_K down_proj and the lm_head too
    assert found["model.layers.0.self_attn.qkv_proj"] == found["model.layers.0.mlp.down_proj"] == (6, 16)
    assert found["lm_head"] == (6, 16)
    assert found["model.layers.1.self_attn.qkv_proj"] == found["model.layers.0.mlp.gate_up_proj"] == (4, 32)
    assert found["model.layers.1.mlp.down_proj"] == "float"  # TQ2_0: no grouped form
    assert "GGUF TQ2_0 linears are dequantised to torch.float32" in caplog.text
    assert "Q6_K linears are dequantised" not in caplog.text and "Q4_K linears are dequantised" not in caplog.text
    assert "(gguf Q4_K, Q6_K, TQ2_0)" in caplog.text  # the start-up log names the file's types, most weights first
    unquantised = AutoModelForCausalLM.from_pretrained(k_quant_model, dtype=torch.float32).eval()
    check_against_reference(llm, reference_model(k_quant_model, held), unquantised, prompts=3)


@pytest.mark.parametrize("default_type, bits", [("Q5_K", 6), ("IQ4_XS", 8)])
def test_q5_k_m_and_iq4_xs_mixes_run_grouped(k_quant_model, tmp_path, default_type, bits):
    from transformers import AutoModelForCausalLM

    path = tmp_path / f"model-{default_type}.gguf"
    held = write_gguf(k_quant_model, path, Q5_K_M, default_type=default_type)
    llm = LLM(str(path), skip_tokenizer_init=True, dtype="bfloat16", device="cpu", max_model_len=400,
              max_num_batched_tokens=96)
    found = grouped_forms(llm)
    assert found["model.layers.1.self_attn.qkv_proj"] == found["model.layers.1.mlp.down_proj"] == (bits, 32)
    # layer 0's qkv: q/k of the default type beside a Q6_K v (6-bit codes in groups of 16)
    assert found["model.layers.0.self_attn.qkv_proj"] == (bits, 16) and found["lm_head"] == (6, 16)
    if default_type == "IQ4_XS" and load_quant_kernels() is not None:
        # the IQ4 layers' 8-bit codes all lie on the grid: the kernels keep them as 4-bit grid indices; layer 0's
        # qkv (Q6_K codes widened beside them) stays 8-bit
        kernel_formats = {name: [(p.bits, p.group_size) for p in m.kernel_parts.parts]
                          for name, m in llm.engine.executor.runner.model.named_modules() if hasattr(m, "kernel_parts")}
        assert kernel_formats["model.layers.1.self_attn.qkv_proj"] == [(IQ4_CODES, 32)]
        assert kernel_formats["model.layers.1.mlp.down_proj"] == [(IQ4_CODES, 32)]
    reference = reference_model(k_quant_model, held)
    for prompt, tokens, ours in run_greedy(llm, make_prompts(512)[:2]):  # bf16: the native decode step's kernels
        expected = reference_logits(reference, prompt, tokens)
        assert (ours.float() - expected).abs().max().item() < 0.05 * expected.abs().max().item() + 0.05
    float32 = LLM(str(path), skip_tokenizer_init=True, dtype="float32", device="cpu", max_model_len=400,
                  max_num_batched_tokens=96)
    unquantised = AutoModelForCausalLM.from_pretrained(k_quant_model, dtype=torch.float32).eval()
    check_against_reference(float32, reference, unquantised, prompts=3)


@pytest.mark.parametrize("kind", sorted(GROUPED_DECODERS))
def test_grouped_decoders_match_the_gguf_dequantiser(kind):
    rows = np.random.default_rng(0).normal(size=(32, 512)).astype(np.float32) * 0.05
    rows[3, :32] = 0.0  # an all-zero group
    blocks = quantize(rows, kind)
    weight = grouped_weight([(kind, blocks)])
    assert weight is not None and (weight.bits, weight.group_size) == GROUPED_DECODERS[kind][:2]
    expected = torch.from_numpy(dequantize(blocks, kind).reshape(rows.shape))
    assert torch.allclose(weight.dequantize(), expected, atol=1e-6, rtol=1e-5)
    assert (expected - torch.from_numpy(rows)).abs().max() < 0.02  # the packer quantised, not scrambled


def test_the_kernels_iq4_grid_is_ggmls():
    from gguf.quants import IQ4_NL

    assert IQ4_GRID == tuple(int(v) + 128 for v in IQ4_NL.kvalues)


def test_test_side_k_quant_packers_round_trip():
    rows = np.random.default_rng(1).normal(size=(4, 512)).astype(np.float32)
    for kind, tolerance in (("Q4_K", 0.35), ("Q5_K", 0.18), ("Q6_K", 0.08), ("IQ4_NL", 0.4), ("IQ4_XS", 0.4)):
        restored = dequantize(quantize(rows, kind), kind).reshape(rows.shape)
        assert np.abs(restored - rows).max() < tolerance, kind


def test_a_fused_layer_of_mixed_types_is_one_weight_of_the_widest_bits_and_smallest_group():
    rows = np.random.default_rng(2).normal(size=(16, 256)).astype(np.float32)

    def check(kinds, bits, group, has_zeros):
        shards = [(kind, quantize(rows, kind)) for kind in kinds]
        weight = grouped_weight(shards)
        assert weight is not None and (weight.bits, weight.group_size) == (bits, group)
        assert (weight.zeros is not None) == has_zeros
        expected = torch.cat([torch.from_numpy(dequantize(raw, kind).reshape(rows.shape)) for kind, raw in shards])
        assert torch.allclose(weight.dequantize(), expected, atol=1e-6, rtol=1e-5)
        return weight

    check(["Q8_0", "Q4_0"], 8, 32, False)  # Q4_0's codes widened: its midpoint 8 moves to 128 with them
    check(["Q5_0", "Q4_0"], 6, 32, False)  # ... and to 6 bits' 32
    check(["Q4_K", "Q4_K", "Q6_K"], 6, 16, True)  # Q4_K_M's q, k, v
    check(["Q5_0", "Q8_0", "Q5_1"], 8, 32, True)
    mixed = check(["Q4_0", "Q4_1"], 4, 32, True)
    assert torch.all(mixed.zeros[:16] == 8)
    assert grouped_weight([("Q4_K", quantize(rows, "Q4_K")), ("TQ2_0", quantize(rows, "TQ2_0"))]) is None


# ---- tokenizer from the metadata -----------------------------------------------------------------

@pytest.fixture(scope="module")
def chat_gguf(tiny_chat_model, tmp_path_factory):
    path = tmp_path_factory.mktemp("gguf-chat") / "chat.gguf"
    source = make_tiny_model(path.parent / "llama", "llama", rope_scaling=None, bos_token_id=0, eos_token_id=1)
    save_tiny_tokenizer(source)
    write_gguf(source, path, {}, tokenizer_folder=source, default_type="Q8_0")
    return path, source


def test_tokenizer_from_metadata_encodes_and_decodes_like_the_folder(chat_gguf):
    import gguf

    path, source = chat_gguf
    reader = gguf.GGUFReader(str(path))
    ours = Tokenizer.from_gguf({k: f.contents() for k, f in reader.fields.items()})
    folder = Tokenizer.from_pretrained(source)
    for text in TOKENIZER_TEXT + ["<|user|>hi</s>", "  two  spaces\n\nand 12345 digits"]:
        assert ours.encode(text) == folder.encode(text)
        assert ours.decode(folder.encode(text)) == folder.decode(folder.encode(text))
    assert (ours.bos_token_id, ours.eos_token_ids) == (folder.bos_token_id, folder.eos_token_ids)
    messages = [{"role": "user", "content": "hello"}]
    assert ours.encode_chat(messages) == folder.encode_chat(messages)


def test_default_model_tokenizer_survives_the_gguf_round_trip(tmp_path):
    import gguf
    from gguf_writer import write_tokenizer

    from llmctl.engine.llm_engine import default_model_path

    path = tmp_path / "tok.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    write_tokenizer(writer, default_model_path())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    ours = Tokenizer.from_gguf({k: f.contents() for k, f in gguf.GGUFReader(str(path)).fields.items()})
    folder = Tokenizer.from_pretrained(default_model_path())
    text = open(default_model_path() / "README.md").read()[:3000] + "".join(TOKENIZER_TEXT)
    assert ours.encode(text) == folder.encode(text)


def test_generate_runs_a_gguf_file_with_its_own_tokenizer(chat_gguf):
    path, source = chat_gguf
    proc = run_cli("generate", "To be, or not", "-m", str(path), "--max-tokens", "4", "--json", "--temperature", "0")
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout.splitlines()[-1])
    folder = Tokenizer.from_pretrained(source)
    assert result["prompt_tokens"] == len(folder.encode("To be, or not"))  # BOS + the BPE pieces
    assert result["completion_tokens"] == 4 and result["quantization"].startswith("gguf ")
    assert result["text"] == folder.decode(result["outputs"][0]["token_ids"])


def test_unsupported_tokenizer_model_is_refused_with_the_tokenizer_hint():
    with pytest.raises(ModelLoadError, match="GGUF tokenizer model 'bert' is not supported.*--tokenizer"):
        Tokenizer.from_gguf({"tokenizer.ggml.model": "bert", "tokenizer.ggml.tokens": ["a"]})
    with pytest.raises(ModelLoadError, match="needs one tokenizer.ggml.scores entry per token"):
        Tokenizer.from_gguf({"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": ["a"]})


def test_tokenizer_flag_overrides_the_metadata_and_quantization_is_refused(chat_gguf, tiny_chat_model):
    path, source = chat_gguf
    llm = LLM(str(path), tokenizer=str(tiny_chat_model), device="cpu", max_model_len=64, num_kv_blocks=8)
    assert llm.engine.tokenizer.encode("hello") == Tokenizer.from_pretrained(tiny_chat_model).encode("hello")
    with pytest.raises(Exception, match=r"already quantised \(GGUF\); drop --quantization int8"):
        LLM(str(path), device="cpu", max_model_len=64, num_kv_blocks=8, quantization="int8")


def test_unsupported_files_are_refused_by_name(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a gguf file at all")
    with pytest.raises(ModelLoadError, match="bad.gguf is not a readable GGUF file"):
        LLM(str(bad), device="cpu")
    import gguf

    path = tmp_path / "phi.gguf"
    writer = gguf.GGUFWriter(str(path), "phi2")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    with pytest.raises(ModelLoadError, match="GGUF architecture 'phi2' is not supported"):
        LLM(str(path), device="cpu")


def test_a_quantised_file_runs_in_bfloat16_by_default_and_tracks_the_reference(tiny_models, tmp_path):
    """dtype auto: a quantised GGUF computes in bfloat16 (the fast CPU kernels' activations)."""
    path = tmp_path / "model-Q8_0.gguf"
    held = write_gguf(tiny_models["qwen2"], path, {}, default_type="Q8_0")
    llm = LLM(str(path), skip_tokenizer_init=True, device="cpu", max_model_len=400)
    assert llm.engine.executor.runner.config.dtype is torch.bfloat16
    reference = reference_model(tiny_models["qwen2"], held)
    for prompt, tokens, ours in run_greedy(llm, make_prompts(512)[:3]):
        expected = reference_logits(reference, prompt, tokens)
        assert (ours.float() - expected).abs().max().item() < 0.05 * expected.abs().max().item() + 0.05


@pytest.mark.parametrize("embedding_type", ["Q8_0", "Q4_0", "Q5_0"])
def test_a_tied_files_lm_head_runs_on_the_embeddings_own_codes(tiny_models, tmp_path, embedding_type):
    """No output.weight: the lm_head is token_embd's blocks in the quantised kernel's layout (llama.cpp writes a
    tied SmolLM's token_embd as Q8_0 in its Q4_0 file: rows of 576 are no multiple of 256), the embedding
    lookup the gguf package's dequantised table; both hold the same values."""
    path = tmp_path / "model.gguf"
    held = write_gguf(tiny_models["qwen2"], path, {"token_embd.weight": embedding_type}, default_type="Q4_0")
    llm = LLM(str(path), skip_tokenizer_init=True, dtype="bfloat16", device="cpu", max_model_len=400)
    model = llm.engine.executor.runner.model
    head, table = model.lm_head, model.model.embed_tokens.weight
    assert head.quant_layout == "native" and head.quant_bits == {"Q8_0": 8, "Q4_0": 4, "Q5_0": 6}[embedding_type]
    assert head.weight.dtype == torch.uint8 and head.weight.data_ptr() != table.data_ptr()
    expected = torch.from_numpy(held["model.embed_tokens.weight"])
    assert torch.equal(table, expected.bfloat16())
    (part,) = head.kernel_parts.parts
    assert torch.equal(head.quant_kernels.dequantize(part), table)
    reference = reference_model(tiny_models["qwen2"], held)  # tied: its lm_head is the dequantised table
    for prompt, tokens, ours in run_greedy(llm, make_prompts(512)[:2]):
        expected = reference_logits(reference, prompt, tokens)
        assert (ours.float() - expected).abs().max().item() < 0.05 * expected.abs().max().item() + 0.05


def test_a_tied_file_with_a_float_embedding_keeps_the_lm_head_tied(tiny_models, tmp_path):
    path = tmp_path / "model.gguf"
    write_gguf(tiny_models["qwen2"], path, {"token_embd.weight": "F16"}, default_type="Q4_0")
    llm = LLM(str(path), skip_tokenizer_init=True, dtype="bfloat16", device="cpu", max_model_len=400)
    assert llm.engine.executor.runner.config.model_config.tie_word_embeddings
    assert getattr(llm.engine.executor.runner.model.lm_head, "quant_layout", None) is None


def sentencepiece_style_gguf_metadata():
    """A SentencePiece-style BPE (byte fallback, "▁" for spaces) trained with tokenizers, written as llama.cpp's
    "llama" vocabulary: tokens by id, scores ranking each merged piece by its merge's rank, token types."""
    from tokenizers import Tokenizer as Backend
    from tokenizers import decoders, models, normalizers, trainers

    backend = Backend(models.BPE(byte_fallback=True, fuse_unk=True, unk_token="<unk>"))
    backend.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")])
    backend.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
                                         decoders.Strip(content=" ", left=1, right=0)])
    bytes_ = [f"<0x{i:02X}>" for i in range(256)]
    trainer = trainers.BpeTrainer(vocab_size=700, special_tokens=["<unk>", "<s>", "</s>", *bytes_])
    backend.train_from_iterator(TOKENIZER_TEXT * 20, trainer)
    model = json.loads(backend.to_str())["model"]
    tokens = [t for t, _ in sorted(model["vocab"].items(), key=lambda item: item[1])]
    rank = {"".join(m if isinstance(m, list) else m.split(" ")): r for r, m in enumerate(model["merges"])}
    metadata = {
        "tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.scores": [-float(rank[t]) if t in rank else -1e6 for t in tokens],
        "tokenizer.ggml.token_type": [2 if t == "<unk>" else 3 if t in ("<s>", "</s>") else 6 if t in bytes_ else 1
                                      for t in tokens],
        "tokenizer.ggml.unknown_token_id": 0, "tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.eos_token_id": 2,
        "tokenizer.ggml.add_bos_token": True,
    }
    return metadata, backend


def test_sentencepiece_vocabulary_from_scores_encodes_like_its_merges():
    metadata, reference = sentencepiece_style_gguf_metadata()
    ours = Tokenizer.from_gguf(metadata)
    texts = TOKENIZER_TEXT + ["  two  spaces\nnew line", "unseen ☃ Ω≈ç√ and 12345"]
    for text in texts:
        ids = ours.encode(text, add_special_tokens=False)
        assert ids == reference.encode(text, add_special_tokens=False).ids
        assert ours.decode(ids) == text
    assert ours.encode("hi")[0] == 1 and ours.eos_token_ids == frozenset({2})
    assert any(t.startswith("<0x") for t in (metadata["tokenizer.ggml.tokens"][i] for i in ours.encode("☃")))


def test_serve_answers_the_openai_client_from_a_gguf_file(chat_gguf):
    import openai
    from server_helpers import running_server

    path, source = chat_gguf
    with running_server(path, engine_options={"max_model_len": 128}) as server:
        client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0)
        model = client.models.list().data[0].id
        completion = client.completions.create(model=model, prompt="To be, or not", max_tokens=4, temperature=0)
        assert completion.usage.prompt_tokens == len(Tokenizer.from_pretrained(source).encode("To be, or not"))
        assert completion.usage.completion_tokens == 4
        chat = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}],
                                              max_tokens=3, temperature=0)
        assert chat.usage.completion_tokens == 3  # the chat template came from the file's metadata
