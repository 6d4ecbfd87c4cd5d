"""Model shapes for the LLM-shaped decode step: built-in ones and any `config.json`.

Only the sizes matter (random weights are used), so a shape is the handful of numbers that
decide the per-token GEMVs: hidden, intermediate, layers, heads, KV heads, head dim, vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from llmctl.errors import UserError


@dataclass(frozen=True)
class ModelShape:
    name: str
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int

    @property
    def linear_params(self) -> int:
        """Weights read per decoded token: every layer's projections plus the LM head
        (the embedding row lookup and the norms are negligible)."""
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        per_layer = self.hidden * (q + 2 * kv) + q * self.hidden + 3 * self.hidden * self.intermediate
        return self.layers * per_layer + self.vocab * self.hidden

    def to_dict(self) -> dict:
        return {"name": self.name, "hidden": self.hidden, "intermediate": self.intermediate, "layers": self.layers,
                "heads": self.heads, "kv_heads": self.kv_heads, "head_dim": self.head_dim, "vocab": self.vocab,
                "params": self.linear_params}


BUILTIN: dict[str, ModelShape] = {s.name: s for s in (
    ModelShape("llama-3-8b", 4096, 14336, 32, 32, 8, 128, 128256),
    ModelShape("mistral-7b", 4096, 14336, 32, 32, 8, 128, 32000),
    ModelShape("qwen2.5-7b", 3584, 18944, 28, 28, 4, 128, 152064),
    ModelShape("qwen2.5-0.5b", 896, 4864, 24, 14, 2, 64, 151936),
    ModelShape("smollm-135m", 576, 1536, 30, 9, 3, 64, 49152),
)}


def resolve_shape(value: str) -> ModelShape:
    """A built-in shape name, or a model folder whose config.json gives the sizes."""
    if value in BUILTIN:
        return BUILTIN[value]
    path = Path(value)
    if not path.exists():
        raise UserError(f"--model {value!r} is neither a folder nor a built-in shape "
                        f"({', '.join(BUILTIN)})")
    from llmctl.engine.model_config import ModelConfig

    config = ModelConfig.from_pretrained(path if path.is_dir() else path.parent)
    return ModelShape(path.name if path.is_dir() else path.parent.name, config.hidden_size,
                      config.intermediate_size, config.num_layers, config.num_heads, config.num_kv_heads,
                      config.head_dim, config.vocab_size)
