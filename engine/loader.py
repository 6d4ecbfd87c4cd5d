"""Load a Hugging Face checkpoint folder (or a GGUF file, through engine/gguf_loader.py) into our model, or
fill it with dummy weights.

Reads `model.safetensors`, sharded `model.safetensors.index.json`, or `pytorch_model*.bin`/`.pt`
(through `torch.load(weights_only=True)`, never arbitrary unpickling). Every failure is a
`ModelLoadError` naming the file or tensor; a half-loaded model is dropped before raising.
"""

from __future__ import annotations

import gc
import hashlib
import json
import logging
import traceback
from pathlib import Path
from typing import Iterator

import torch

from llmctl.engine.errors import ModelLoadError
from llmctl.engine.gguf_loader import GGUFFile, is_gguf
from llmctl.engine.layers.fused_ops import LayerOps
from llmctl.engine.layers.linear import LinearBase, LinearMethod, WeightShapeError, default_weight_loader
from llmctl.engine.layers.rotary import RotaryEmbedding
from llmctl.engine.model_config import ModelConfig
from llmctl.engine.models.llama import LlamaForCausalLM, RMSNorm
from llmctl.engine.models.registry import model_class
from llmctl.engine.parallel import PipelineParallel, TensorParallel

logger = logging.getLogger(__name__)

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")
MANIFEST = "SHA256SUMS"
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def find_weight_files(folder: Path) -> list[Path]:
    """The checkpoint's weight files, preferring safetensors; errors name what was found instead."""
    for index_name in ("model.safetensors.index.json", "pytorch_model.bin.index.json"):
        index = folder / index_name
        if index.is_file():
            return _files_from_index(index)
    safetensors = sorted(folder.glob("*.safetensors"))
    if safetensors:
        return safetensors
    pickled = sorted(p for p in folder.iterdir() if p.suffix in (".bin", ".pt", ".pth") and p.is_file())
    if pickled:
        return pickled
    others = sorted(p.name for p in folder.iterdir() if p.is_file() and p.suffix not in (".json", ".txt", ".md", ".jinja", ".model"))
    found = f"; found {', '.join(others[:5])}" if others else ""
    raise ModelLoadError(f"no weight files in {folder} (expected .safetensors, .bin or .pt{found})")


def _files_from_index(index: Path) -> list[Path]:
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
    except (json.JSONDecodeError, KeyError, TypeError) as exc:
        raise ModelLoadError(f"{index} is not a valid checkpoint index: {exc}") from None
    files = [index.parent / name for name in sorted(set(weight_map.values()))]
    missing = [f.name for f in files if not f.is_file()]
    if missing:
        raise ModelLoadError(f"{index.name} lists missing shard(s): {', '.join(missing)}")
    return files


def verify_checksums(folder: Path, files: list[Path]) -> None:
    """Check each weight file against the folder's `SHA256SUMS` (the format `sha256sum` writes)."""
    manifest = folder / MANIFEST
    if not manifest.is_file():
        raise ModelLoadError(f"--verify needs {MANIFEST} in {folder} (create it with: sha256sum *.safetensors > {MANIFEST})")
    expected = {}
    for line in manifest.read_text().splitlines():
        parts = line.strip().split(maxsplit=1)
        if len(parts) == 2:
            expected[parts[1].lstrip("*")] = parts[0].lower()
    for path in files:
        want = expected.get(path.name)
        if want is None:
            raise ModelLoadError(f"{MANIFEST} has no entry for {path.name}")
        digest = hashlib.sha256()
        with path.open("rb") as handle:
            for chunk in iter(lambda: handle.read(1 << 22), b""):
                digest.update(chunk)
        if digest.hexdigest() != want:
            raise ModelLoadError(f"checksum mismatch for {path.name}: file is corrupt or was modified")


def iterate_tensors(path: Path) -> Iterator[tuple[str, torch.Tensor]]:
    if path.suffix == ".safetensors":
        yield from _safetensors(path)
    elif path.suffix in (".bin", ".pt", ".pth"):
        yield from _pickled(path)
    else:
        raise ModelLoadError(f"unknown weight file extension {path.suffix!r} ({path.name}); use .safetensors, .bin or .pt")


def _safetensors(path: Path) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import SafetensorError, safe_open

    try:
        handle = safe_open(str(path), framework="pt")
        names = list(handle.keys())
    except (SafetensorError, OSError, ValueError) as exc:
        raise ModelLoadError(f"{path.name} is truncated or corrupt: {exc}") from None
    for name in names:
        try:
            tensor = handle.get_tensor(name)
        except (SafetensorError, OSError, ValueError, RuntimeError) as exc:
            raise ModelLoadError(f"{path.name}: cannot read tensor {name!r}: {exc}") from None
        yield name, tensor


def _pickled(path: Path) -> Iterator[tuple[str, torch.Tensor]]:
    try:
        try:
            state = torch.load(str(path), map_location="cpu", weights_only=True, mmap=True)
        except RuntimeError as exc:
            if "mmap can only be used" not in str(exc):
                raise
            # Legacy (pre-zipfile, torch < 1.6) checkpoints cannot be memory-mapped: read them whole.
            state = torch.load(str(path), map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - torch raises many types for bad pickles
        message = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise ModelLoadError(f"{path.name} cannot be loaded safely (weights_only): {message}") from None
    if not isinstance(state, dict):
        raise ModelLoadError(f"{path.name} does not hold a state dict")
    state = state.get("state_dict", state) if isinstance(state.get("state_dict"), dict) else state
    for name, tensor in state.items():
        if isinstance(tensor, torch.Tensor):
            yield name, tensor


class WeightLoader:
    """Maps checkpoint names to (parameter, shard id) and hands each tensor to that parameter's
    `weight_loader`; tracks the shards filled so a missing tensor is named, not left uninitialised."""

    def __init__(self, model: LlamaForCausalLM):
        self.model = model
        self.params = dict(model.named_parameters())
        self.filled: set[tuple[str, object]] = set()

    def load(self, name: str, tensor: torch.Tensor) -> None:
        for part, piece in self.model.checkpoint_tensors(name, tensor):
            self._load_one(part, piece)

    def _load_one(self, name: str, tensor: torch.Tensor) -> None:
        if name.endswith(IGNORED_SUFFIXES):
            return
        if name == "lm_head.weight" and self.model.config.tie_word_embeddings:
            return
        target, shard = self._target(name)
        param = self.params.get(target)
        if param is None:
            logger.debug("ignoring unexpected tensor %s", name)
            return
        weight_loader = getattr(param, "weight_loader", default_weight_loader)
        try:
            weight_loader(param, tensor, shard)
        except WeightShapeError as exc:
            raise ModelLoadError(f"tensor {name!r} has shape {exc.got}, expected {exc.expected}") from None
        self.filled.add((target, shard))

    def _target(self, name: str) -> tuple[str, object]:
        experts = getattr(self.model, "expert_names", None)  # a mixture-of-experts model's per-expert tensors
        found = experts.target(name) if experts is not None else None
        if found is not None:
            return found
        for fragment, (fused, shard) in self.model.stacked_params.items():
            if f".{fragment}." in name:
                return name.replace(f".{fragment}.", f".{fused}."), shard
        return name, None

    def check_complete(self) -> None:
        for name, param in self.params.items():
            for shard in getattr(param, "shard_ids", (None,)):
                if (name, shard) not in self.filled:
                    raise ModelLoadError(f"checkpoint is missing tensor {self._hf_name(name, shard)!r} "
                                         f"(shape {tuple(param.shape)})")

    def _hf_name(self, target: str, shard: object) -> str:
        experts = getattr(self.model, "expert_names", None)
        found = experts.checkpoint_name(target, shard) if experts is not None else None
        if found is not None:
            return found
        for fragment, (fused, shard_id) in self.model.stacked_params.items():
            if shard is not None and shard_id == shard and f".{fused}." in target:
                return target.replace(f".{fused}.", f".{fragment}.")
        return target


def build_model(config: ModelConfig, folder: Path | None, *, max_positions: int, dtype: torch.dtype,
                device: torch.device, load_format: str, seed: int, linear_method: LinearMethod,
                ops: LayerOps | None = None, verify: bool = False, lm_head_method: LinearMethod | None = None,
                tp: TensorParallel = TensorParallel.single(),
                pp: PipelineParallel = PipelineParallel()) -> LlamaForCausalLM:
    """Build the model on `device` with its linear method(s) and layer ops (this rank's shard of it with
    several tensor-parallel ranks: every rank reads the whole checkpoint and keeps its part), fill it
    (checkpoint or dummy) and let each linear prepare its weights (packing); frees it on failure."""
    model = None
    try:
        with torch.device(device):
            model = model_class(config)(config, max_positions, dtype=dtype, linear_method=linear_method,
                                     ops=ops, lm_head_method=lm_head_method, tp=tp, pp=pp)
        if load_format == "dummy":
            _fill_dummy(model, seed)
        else:
            _fill_from_checkpoint(model, folder, verify)
        for module in model.modules():
            if isinstance(module, RotaryEmbedding):  # Gemma 3 has a second one, for its sliding layers
                module.build_tables()
            elif isinstance(module, (LinearBase, RMSNorm)):
                module.process_weights_after_loading()
    except BaseException as exc:
        model = None
        _release_frames(exc)
        gc.collect()
        raise
    return model.eval().requires_grad_(False)


def _release_frames(exc: BaseException) -> None:
    """Clear the locals of the finished frames that the error's traceback (and its chained errors) keep
    alive: they hold the half-loaded model, which would otherwise live as long as the error object."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        traceback.clear_frames(current.__traceback__)
        current = current.__cause__ or current.__context__


def _fill_from_checkpoint(model: LlamaForCausalLM, folder: Path, verify: bool) -> None:
    """`folder`: a Hugging Face checkpoint folder, or a GGUF file (checked against SHA256SUMS beside it)."""
    gguf = is_gguf(folder)
    files = [folder] if gguf else find_weight_files(folder)
    if verify:
        verify_checksums(folder.parent if gguf else folder, files)
    loader = WeightLoader(model)
    tensors = GGUFFile(folder).iterate_tensors() if gguf else (item for path in files for item in iterate_tensors(path))
    for name, tensor in tensors:
        loader.load(name, tensor)
    loader.check_complete()


# vLLM's dummy-weight range: activations stay finite through a deep model in bfloat16 / float16
DUMMY_WEIGHT_RANGE = 1e-3


@torch.no_grad()
def _fill_dummy(model: LlamaForCausalLM, seed: int) -> None:
    """Norms 1, biases 0, every other weight uniform in +-DUMMY_WEIGHT_RANGE, drawn where the parameter
    lives from a generator seeded on that device (an 8B model's weights made on the host would take a
    minute of CPU randn, then a copy); the same seed on the same device gives the same weights."""
    generators: dict[torch.device, torch.Generator] = {}
    for name, param in model.named_parameters():
        if name.endswith("norm.weight"):
            param.fill_(1.0)
        elif name.endswith(".bias"):
            param.zero_()
        elif not param.is_floating_point():
            raise ModelLoadError(f"--load-format dummy cannot fill {name} ({param.dtype}): it holds "
                                 "quantised codes, not weights")
        else:
            if param.device not in generators:
                generators[param.device] = torch.Generator(device=param.device).manual_seed(seed)
            param.uniform_(-DUMMY_WEIGHT_RANGE, DUMMY_WEIGHT_RANGE, generator=generators[param.device])
