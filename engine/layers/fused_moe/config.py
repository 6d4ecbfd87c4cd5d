"""`MoEConfig`: a mixture-of-experts checkpoint's routing facts, read from its config.json (Mixtral,
Qwen2-MoE, Qwen3-MoE key names), validated here."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from llmctl.engine.errors import ModelLoadError

MOE_ARCHITECTURES = ("MixtralForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM")


@dataclass(frozen=True)
class MoEConfig:
    num_experts: int
    top_k: int  # experts per token
    intermediate_size: int  # of each routed expert
    renormalize: bool  # the top-k routing weights rescaled to sum to 1
    shared_expert_intermediate_size: int  # Qwen2-MoE's always-on expert; 0: none
    sparse_layers: tuple[int, ...]  # the decoder layers whose MLP is the MoE block (the others are dense)

    @classmethod
    def from_dict(cls, raw: dict[str, Any], architecture: str, num_layers: int, source: str) -> Optional["MoEConfig"]:
        """None for a dense architecture."""
        if architecture not in MOE_ARCHITECTURES:
            return None
        try:
            config = cls._read(raw, architecture, num_layers)
        except KeyError as exc:
            raise ModelLoadError(f"{source} lacks required key {exc.args[0]!r} ({architecture})") from None
        except (TypeError, ValueError) as exc:
            raise ModelLoadError(f"{source} has an invalid mixture-of-experts field: {exc}") from None
        config._validate(source)
        return config

    @classmethod
    def _read(cls, raw: dict[str, Any], architecture: str, num_layers: int) -> "MoEConfig":
        if architecture == "MixtralForCausalLM":  # softmax over the top-k logits = softmax, top-k, renormalise
            return cls(int(raw["num_local_experts"]), int(raw["num_experts_per_tok"]), int(raw["intermediate_size"]),
                       True, 0, tuple(range(num_layers)))
        experts = int(raw["num_experts"] if "num_experts" in raw else raw["num_local_experts"])
        step = int(raw.get("decoder_sparse_step", 1) or 1)
        dense = {int(i) for i in raw.get("mlp_only_layers") or ()}
        sparse = tuple(i for i in range(num_layers) if i not in dense and experts > 0 and (i + 1) % step == 0)
        shared = int(raw.get("shared_expert_intermediate_size", 0) or 0) if architecture == "Qwen2MoeForCausalLM" else 0
        return cls(experts, int(raw["num_experts_per_tok"]), int(raw["moe_intermediate_size"]),
                   bool(raw.get("norm_topk_prob", False)), shared, sparse)

    def _validate(self, source: str) -> None:
        if self.num_experts < 1 or not 1 <= self.top_k <= self.num_experts:
            raise ModelLoadError(f"{source}: num_experts_per_tok {self.top_k} must be in 1..{self.num_experts} "
                                 "(the number of experts)")
        if self.intermediate_size < 1:
            raise ModelLoadError(f"{source}: the experts' intermediate size must be positive, got "
                                 f"{self.intermediate_size}")
