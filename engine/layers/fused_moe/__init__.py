"""Mixture-of-experts layers: the router (`router.py`), the fused expert weights and their loading
(`layer.py`), the torch reference / CPU path (`torch_impl.py`) and, on CUDA, the Triton grouped GEMM
(engine/kernels/triton/fused_moe.py); `config.py` reads the MoE facts of a checkpoint's config.json."""

from llmctl.engine.layers.fused_moe.config import MoEConfig
from llmctl.engine.layers.fused_moe.layer import CHECKPOINT_EXPERT_NAMES, ExpertNames, FusedMoE, ReplicatedGate

__all__ = ["CHECKPOINT_EXPERT_NAMES", "ExpertNames", "FusedMoE", "MoEConfig", "ReplicatedGate"]
