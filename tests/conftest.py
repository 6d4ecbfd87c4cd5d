"""Shared fixtures: tiny random-weight Hugging Face checkpoints built with `transformers`."""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

import pytest
import torch


def _interpret_triton_without_a_gpu() -> None:
    """Without a GPU Triton kernels run only interpreted, and triton reads TRITON_INTERPRET once, when it is first
    imported (its own library's jit functions are fixed then): set it before any test can import triton."""
    if "triton" not in sys.modules and not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")


_interpret_triton_without_a_gpu()
# litellm (a conformance client) otherwise fetches its model price map from the network at import
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")

@pytest.fixture(autouse=True)
def _restore_llmctl_logger():
    """In-process CLI runs call `configure_logging`, which gives the "llmctl" logger a handler on the
    runner's (soon closed) stderr and stops propagation; without this, later tests' `caplog` sees no
    engine records and logging prints "--- Logging error ---" for every line."""
    logger = logging.getLogger("llmctl")
    saved = (logger.handlers[:], logger.level, logger.propagate)
    yield
    logger.handlers[:], logger.level, logger.propagate = saved[0], saved[1], saved[2]


def cpu_kernels_while(monkeypatch, enabled: bool):
    """Set LLMCTL_DISABLE_CPU_KERNELS for the engines this test builds; returns the cache clear to call at the end."""
    from llmctl.engine.kernels import DISABLE_ENV, load_cpu_kernels

    if enabled:
        monkeypatch.delenv(DISABLE_ENV, raising=False)
    else:
        monkeypatch.setenv(DISABLE_ENV, "1")
    load_cpu_kernels.cache_clear()  # the loader caches its answer per process
    return load_cpu_kernels.cache_clear


@pytest.fixture
def cpu_kernels_off(monkeypatch):
    """Engines built in this test run without the native CPU kernels (LLMCTL_DISABLE_CPU_KERNELS=1): CPU
    decode attention takes the torch path over the kept decode K/V."""
    clear = cpu_kernels_while(monkeypatch, False)
    yield
    clear()


@pytest.fixture(params=["native", "torch"])
def cpu_decode_path(request, monkeypatch):
    """Each test twice: with the native CPU kernels (a test skips itself where they do not serve its model)
    and with LLMCTL_DISABLE_CPU_KERNELS=1 (the torch decode path)."""
    clear = cpu_kernels_while(monkeypatch, request.param == "native")
    yield request.param
    clear()


def skip_unless_native_decode(llm) -> None:
    if llm.engine.executor.runner.attention.label == "torch":
        pytest.skip("the native CPU decode kernel does not serve this model here (compiler, AVX-512 or head_dim)")


ARCH_CONFIGS = {
    "llama": ("LlamaConfig", dict(tie_word_embeddings=False,
                                  rope_scaling={"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0,
                                                "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
                                  rope_theta=50000.0)),
    "mistral": ("MistralConfig", dict(tie_word_embeddings=False, sliding_window=None, head_dim=16)),
    "qwen2": ("Qwen2Config", dict(tie_word_embeddings=True, head_dim=32)),  # 32: the native CPU decode kernel's
    "qwen3": ("Qwen3Config", dict(tie_word_embeddings=True, head_dim=32)),
}


def make_tiny_model(folder: Path, arch: str, *, vocab_size: int = 512, seed: int = 0, **overrides) -> Path:
    """Save a tiny random model of `arch` (float32) with transformers' own save_pretrained; `arch` is a key of
    ARCH_CONFIGS or a transformers config class name."""
    import transformers

    config_name, extra = ARCH_CONFIGS.get(arch, (arch, {}))
    config = getattr(transformers, config_name)(**{
        "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "vocab_size": vocab_size, "max_position_embeddings": 1024,
        "initializer_range": 0.1, **extra, **overrides})
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny-models")
    return {arch: make_tiny_model(root / arch, arch) for arch in ARCH_CONFIGS}


CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{{ eos_token }}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
TOKENIZER_TEXT = [
    "To be, or not to be, that is the question: whether 'tis nobler in the mind to suffer",
    "The slings and arrows of outrageous fortune, or to take arms against a sea of troubles.",
    "Héllo wörld — naïve café; emoji 🙂🚀 and CJK 漢字かな mixed with ASCII text.",
    "ROMEO: But, soft! what light through yonder window breaks? It is the east, and Juliet is the sun.",
]


def save_tiny_tokenizer(folder: Path, vocab_size: int = 512) -> None:
    """A byte-level BPE tokenizer (tokenizers library) with BOS/EOS and a chat template."""
    import json

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    specials = ["<s>", "</s>", "<|user|>", "<|assistant|>", "<|system|>"]
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(TOKENIZER_TEXT * 20, trainer)
    tokenizer.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    tokenizer.save(str(folder / "tokenizer.json"))
    config = {"bos_token": "<s>", "eos_token": "</s>", "tokenizer_class": "PreTrainedTokenizerFast",
              "chat_template": CHAT_TEMPLATE}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))


@pytest.fixture(scope="session")
def tiny_chat_model(tmp_path_factory) -> Path:
    folder = make_tiny_model(tmp_path_factory.mktemp("tiny-chat") / "llama", "llama", bos_token_id=0, eos_token_id=1)
    save_tiny_tokenizer(folder)
    return folder
