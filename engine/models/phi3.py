"""Phi-3 / Phi-3.5 (`Phi3ForCausalLM`): the Llama tree (LongRoPE comes from engine/layers/rotary.py); its
checkpoints store q/k/v and gate/up already fused as `qkv_proj` and `gate_up_proj`, which are split here into
the per-projection tensors `stacked_params` maps, so each rank's weight loader takes its own shards."""

from __future__ import annotations

from typing import Iterator

import torch

from llmctl.engine.models.llama import LlamaForCausalLM


class Phi3ForCausalLM(LlamaForCausalLM):
    def checkpoint_tensors(self, name: str, tensor: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
        config = self.config
        q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
        fused = {".qkv_proj.": (("q_proj", q), ("k_proj", kv), ("v_proj", kv)),
                 ".gate_up_proj.": (("gate_proj", config.intermediate_size), ("up_proj", config.intermediate_size))}
        for fragment, parts in fused.items():
            if fragment in name:
                if tensor.shape[0] != sum(size for _, size in parts):
                    yield name, tensor  # the weight loader names the shape it expected
                    return
                for (part, _), piece in zip(parts, tensor.split([size for _, size in parts], dim=0)):
                    yield name.replace(fragment, f".{part}."), piece
                return
        yield name, tensor

