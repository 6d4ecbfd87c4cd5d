"""Shared fixtures: tiny random-weight Hugging Face checkpoints built with `transformers`."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

ARCH_CONFIGS = {
    "llama": ("LlamaConfig", dict(tie_word_embeddings=False,
                                  rope_scaling={"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0,
                                                "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
                                  rope_theta=50000.0)),
    "mistral": ("MistralConfig", dict(tie_word_embeddings=False, sliding_window=None, head_dim=16)),
    "qwen2": ("Qwen2Config", dict(tie_word_embeddings=True)),
    "qwen3": ("Qwen3Config", dict(tie_word_embeddings=True, head_dim=32)),
}


def make_tiny_model(folder: Path, arch: str, *, vocab_size: int = 512, seed: int = 0, **overrides) -> Path:
    """Save a tiny random model of `arch` (float32) with transformers' own save_pretrained."""
    import transformers

    config_name, extra = ARCH_CONFIGS[arch]
    config = getattr(transformers, config_name)(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=vocab_size, max_position_embeddings=1024, initializer_range=0.1, **{**extra, **overrides},
    )
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny-models")
    return {arch: make_tiny_model(root / arch, arch) for arch in ARCH_CONFIGS}
