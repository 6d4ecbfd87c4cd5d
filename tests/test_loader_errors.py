"""Every kind of bad checkpoint gives a `ModelLoadError` naming the problem; good variants (sharded,
pytorch_model.bin, --verify, dtypes, dummy weights) load; a failed load leaves no model behind."""

from __future__ import annotations

import gc
import hashlib
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from llmctl.engine import LLM, SamplingParams
from llmctl.engine.errors import EngineArgsError, ModelLoadError
from llmctl.engine.model_config import SUPPORTED_ARCHITECTURES

PROMPT = [5, 17, 42, 7, 99, 3]
GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)


def load(folder, **kwargs) -> LLM:
    return LLM(str(folder), skip_tokenizer_init=True, device="cpu", max_model_len=64, num_kv_blocks=8, **kwargs)


def load_error(folder, **kwargs) -> str:
    with pytest.raises(ModelLoadError) as info:
        load(folder, **kwargs)
    return str(info.value)


@pytest.fixture(scope="module")
def reference_tokens(tiny_models) -> list[int]:
    return load(tiny_models["llama"]).generate([PROMPT], GREEDY)[0].outputs[0].token_ids


@pytest.fixture
def ckpt(tiny_models, tmp_path) -> Path:
    """A private copy of the tiny llama checkpoint (config.json + model.safetensors) to damage."""
    folder = tmp_path / "ckpt"
    folder.mkdir()
    source = tiny_models["llama"]
    for name in ("config.json", "model.safetensors"):
        shutil.copy(source / name, folder / name)
    return folder


def edit_config(folder: Path, **changes) -> None:
    config = json.loads((folder / "config.json").read_text())
    config.update(changes)
    (folder / "config.json").write_text(json.dumps(config))


# ---- folder and config ----------------------------------------------------------------------------

def test_missing_folder(tmp_path):
    assert "does not exist" in load_error(tmp_path / "nope")


def test_folder_without_config(ckpt):
    (ckpt / "config.json").unlink()
    assert "no config.json" in load_error(ckpt)


def test_unsupported_architecture_lists_the_supported_ones(ckpt):
    edit_config(ckpt, architectures=["GPT2LMHeadModel"], model_type="gpt2")
    message = load_error(ckpt)
    assert "unsupported architecture GPT2LMHeadModel" in message
    for arch in SUPPORTED_ARCHITECTURES:
        assert arch in message


def test_config_that_is_not_json(ckpt):
    (ckpt / "config.json").write_text("{not json")
    assert "config.json is not valid JSON" in load_error(ckpt)


# ---- weight files ---------------------------------------------------------------------------------

def test_unknown_weight_file_extension(ckpt):
    (ckpt / "model.safetensors").rename(ckpt / "model.gguf")
    message = load_error(ckpt)
    assert "no weight files" in message and "model.gguf" in message


def test_truncated_safetensors(ckpt):
    path = ckpt / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    message = load_error(ckpt)
    assert "model.safetensors" in message and "truncated or corrupt" in message


def test_corrupt_safetensors_header(ckpt):
    path = ckpt / "model.safetensors"
    data = bytearray(path.read_bytes())
    header_len = int.from_bytes(data[:8], "little")
    data[8:8 + header_len] = b"#" * header_len  # same length, not JSON
    path.write_bytes(bytes(data))
    message = load_error(ckpt)
    assert "model.safetensors" in message and "truncated or corrupt" in message


def test_safetensors_header_length_beyond_the_file(ckpt):
    path = ckpt / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes((1 << 40).to_bytes(8, "little") + data[8:])
    assert "truncated or corrupt" in load_error(ckpt)


@pytest.mark.parametrize("name", ["model.layers.1.mlp.down_proj.weight", "model.layers.0.self_attn.k_proj.weight",
                                  "model.norm.weight", "lm_head.weight"])
def test_missing_tensor_is_named(ckpt, name):
    path = ckpt / "model.safetensors"
    state = load_file(path)
    del state[name]
    save_file(state, path)
    message = load_error(ckpt)
    assert "missing tensor" in message and repr(name) in message


def test_misshaped_tensor_names_it_and_both_shapes(ckpt):
    path = ckpt / "model.safetensors"
    state = load_file(path)
    name = "model.layers.0.self_attn.v_proj.weight"
    expected = tuple(state[name].shape)
    state[name] = torch.zeros(expected[0] + 3, expected[1])
    save_file(state, path)
    message = load_error(ckpt)
    assert repr(name) in message
    assert str((expected[0] + 3, expected[1])) in message and str(expected) in message


def write_shards(folder: Path) -> list[str]:
    state = load_file(folder / "model.safetensors")
    (folder / "model.safetensors").unlink()
    names = sorted(state)
    shards = {"model-00001-of-00002.safetensors": names[: len(names) // 2],
              "model-00002-of-00002.safetensors": names[len(names) // 2:]}
    weight_map = {}
    for shard, keys in shards.items():
        save_file({k: state[k] for k in keys}, folder / shard)
        weight_map.update({k: shard for k in keys})
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return list(shards)


def test_sharded_checkpoint_loads(ckpt, reference_tokens):
    write_shards(ckpt)
    assert load(ckpt).generate([PROMPT], GREEDY)[0].outputs[0].token_ids == reference_tokens


def test_sharded_index_pointing_to_a_missing_shard(ckpt):
    shards = write_shards(ckpt)
    (ckpt / shards[1]).unlink()
    message = load_error(ckpt)
    assert "missing shard" in message and shards[1] in message


def test_corrupt_shard_index(ckpt):
    write_shards(ckpt)
    (ckpt / "model.safetensors.index.json").write_text('{"no_weight_map": 1}')
    assert "not a valid checkpoint index" in load_error(ckpt)


# ---- pytorch_model.bin: weights_only, never arbitrary unpickling ----------------------------------

def test_pytorch_bin_loads(ckpt, reference_tokens):
    state = load_file(ckpt / "model.safetensors")
    (ckpt / "model.safetensors").unlink()
    torch.save(state, ckpt / "pytorch_model.bin")
    assert load(ckpt).generate([PROMPT], GREEDY)[0].outputs[0].token_ids == reference_tokens


def test_legacy_non_zip_pytorch_bin_loads(ckpt, reference_tokens):
    state = load_file(ckpt / "model.safetensors")
    (ckpt / "model.safetensors").unlink()
    torch.save(state, ckpt / "pytorch_model.bin", _use_new_zipfile_serialization=False)  # torch < 1.6 format
    assert load(ckpt).generate([PROMPT], GREEDY)[0].outputs[0].token_ids == reference_tokens


class Exploit:
    """Unpickling this runs `Path.touch(marker)`; weights_only loading must refuse it."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def test_pytorch_bin_with_a_pickled_object_is_refused(ckpt, tmp_path):
    state = load_file(ckpt / "model.safetensors")
    (ckpt / "model.safetensors").unlink()
    marker = tmp_path / "pwned"
    state["model.embed_tokens.weight"] = Exploit(marker)  # type: ignore[assignment]
    torch.save(state, ckpt / "pytorch_model.bin")
    message = load_error(ckpt)
    assert "pytorch_model.bin" in message and "weights_only" in message
    assert not marker.exists(), "the pickled object was executed"


def test_pytorch_bin_that_is_not_a_state_dict(ckpt):
    (ckpt / "model.safetensors").unlink()
    torch.save([torch.zeros(2)], ckpt / "pytorch_model.bin")
    assert "does not hold a state dict" in load_error(ckpt)


# ---- --verify -------------------------------------------------------------------------------------

def test_verify_with_a_good_manifest(ckpt, reference_tokens):
    digest = hashlib.sha256((ckpt / "model.safetensors").read_bytes()).hexdigest()
    (ckpt / "SHA256SUMS").write_text(f"{digest}  model.safetensors\n")
    assert load(ckpt, verify=True).generate([PROMPT], GREEDY)[0].outputs[0].token_ids == reference_tokens


def test_verify_with_a_bad_manifest(ckpt):
    (ckpt / "SHA256SUMS").write_text(f"{'0' * 64}  model.safetensors\n")
    message = load_error(ckpt, verify=True)
    assert "checksum mismatch for model.safetensors" in message
    load(ckpt)  # without --verify the (intact) file loads


def test_verify_detects_a_modified_file(ckpt):
    digest = hashlib.sha256((ckpt / "model.safetensors").read_bytes()).hexdigest()
    (ckpt / "SHA256SUMS").write_text(f"{digest} *model.safetensors\n")
    path = ckpt / "model.safetensors"
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF  # one flipped byte inside a tensor: still loadable, but not what was shipped
    path.write_bytes(bytes(data))
    assert "checksum mismatch" in load_error(ckpt, verify=True)


def test_verify_without_a_manifest(ckpt):
    assert "SHA256SUMS" in load_error(ckpt, verify=True)


# ---- the CLI path -----------------------------------------------------------------------------------

def test_cli_bad_checkpoint_exits_2_with_one_line(ckpt, tiny_chat_model, capsys):
    from llmctl.cli import run

    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny_chat_model / name, ckpt / name)
    path = ckpt / "model.safetensors"
    path.write_bytes(path.read_bytes()[:1000])
    code = run(["generate", "hi", "-m", str(ckpt), "--device", "cpu"])  # (auto would add a CPU warning line)
    captured = capsys.readouterr()
    assert code == 2
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1, captured.err
    assert lines[0].startswith("llmctl: error:") and "model.safetensors" in lines[0]
    assert "Traceback" not in captured.err


# ---- dtype, dummy weights, device ------------------------------------------------------------------

def model_dtype(llm: LLM) -> torch.dtype:
    return next(llm.engine.executor.runner.model.parameters()).dtype


def test_dtypes(ckpt, reference_tokens):
    assert model_dtype(load(ckpt, dtype="auto")) is torch.float32  # the checkpoint says float32
    assert model_dtype(load(ckpt, dtype="float32")) is torch.float32
    bf16 = load(ckpt, dtype="bfloat16")
    assert model_dtype(bf16) is torch.bfloat16
    assert bf16.engine.executor.runner.kv_caches[0].dtype is torch.bfloat16
    assert len(bf16.generate([PROMPT], GREEDY)[0].outputs[0].token_ids) == 4
    edit_config(ckpt, torch_dtype="bfloat16", dtype="bfloat16")
    assert model_dtype(load(ckpt, dtype="auto")) is torch.bfloat16


def test_bad_dtype_is_an_engine_args_error(ckpt):
    with pytest.raises(EngineArgsError, match="dtype"):
        load(ckpt, dtype="float8")


def test_dummy_weights_need_only_config_json(ckpt):
    (ckpt / "model.safetensors").unlink()
    llm = load(ckpt, load_format="dummy")
    out = llm.generate([PROMPT], GREEDY)[0].outputs[0]
    assert len(out.token_ids) == 4
    names = dict(llm.engine.executor.runner.model.named_parameters())
    assert all(torch.isfinite(p).all() for p in names.values())
    # Real shapes from config.json, and the same seed gives the same weights.
    again = load(ckpt, load_format="dummy")
    assert again.generate([PROMPT], GREEDY)[0].outputs[0].token_ids == out.token_ids


def test_dummy_weights_are_small_uniform_values_drawn_in_place(ckpt, monkeypatch):
    def no_host_randn(*args, **kwargs):
        raise AssertionError("dummy weights made with randn on the host")

    monkeypatch.setattr(torch, "randn", no_host_randn)
    params = dict(load(ckpt, load_format="dummy", dtype="bfloat16").engine.executor.runner.model.named_parameters())
    weights = [p for name, p in params.items() if not name.endswith(("norm.weight", ".bias"))]
    assert all(p.float().abs().max() <= 1e-3 for p in weights) and all(p.float().std() > 2e-4 for p in weights)
    assert all(bool((p == 1).all()) for name, p in params.items() if name.endswith("norm.weight"))


@pytest.mark.parametrize("quantization", ["int8", "int4-g32"])
def test_dummy_weights_feed_on_the_fly_quantisation(ckpt, quantization):
    out = load(ckpt, load_format="dummy", quantization=quantization).generate([PROMPT], GREEDY)[0].outputs[0]
    assert len(out.token_ids) == 4


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a machine without CUDA")
@pytest.mark.parametrize("device", ["cuda", "cuda:1"])
def test_cuda_on_a_cpu_only_machine_is_a_clear_error(ckpt, device):
    with pytest.raises(EngineArgsError, match="CUDA is not available"):
        LLM(str(ckpt), skip_tokenizer_init=True, device=device)


def test_unknown_device_is_an_engine_args_error(ckpt):
    with pytest.raises(EngineArgsError, match="device"):
        LLM(str(ckpt), skip_tokenizer_init=True, device="tpu")


# ---- a failed load frees the half-loaded model ---------------------------------------------------------

@pytest.mark.parametrize("damage", ["missing", "misshaped", "truncated"])
def test_failed_load_frees_the_half_loaded_model(ckpt, damage, monkeypatch):
    import weakref

    from llmctl.engine import loader

    built: list[weakref.ref] = []

    class Tracked(loader.LlamaForCausalLM):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            built.append(weakref.ref(self))

    monkeypatch.setattr(loader, "model_class", lambda config: Tracked)
    path = ckpt / "model.safetensors"
    if damage == "truncated":
        # Keep the header and most tensors, cut the last one: fails after loading some weights.
        path.write_bytes(path.read_bytes()[:-16])
    else:
        state = load_file(path)
        if damage == "missing":
            del state["model.layers.1.mlp.up_proj.weight"]
        else:
            state["model.layers.1.mlp.up_proj.weight"] = torch.zeros(1, 1)
        save_file(state, path)
    errors = []
    try:
        load(ckpt)
    except ModelLoadError as exc:
        errors.append(exc)  # keep the error around, as a server logging it would
    assert len(errors) == 1 and len(built) == 1
    gc.collect()
    assert built[0]() is None, "the half-loaded model is still referenced after the ModelLoadError"
