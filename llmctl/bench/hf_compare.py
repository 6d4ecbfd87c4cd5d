"""`--compare-hf`: the same offline workload through Hugging Face transformers `generate`.

transformers is imported only here, and only when the comparison is asked for. Its run follows
vLLM's `run_hf` baseline: prompts in order, padded (left) batches of `batch_size`, greedy, each
batch generating exactly its longest requested output (min_new_tokens = max_new_tokens), and
throughput counted from the requested output lengths, as for the engine.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from llmctl.bench.offline import PassTimes, Progress, Request
from llmctl.errors import UserError


@dataclass
class HfModel:
    model: Any
    device: Any
    pad_id: int
    version: str
    load_s: float


def load_hf(folder: Path, load_format: str, dtype: str, device: str, seed: int) -> HfModel:
    """The checkpoint (or, for --load-format dummy, random weights from config.json) in transformers."""
    try:
        import transformers
    except ImportError:
        raise UserError("--compare-hf needs transformers: pip install transformers") from None
    import torch

    transformers.logging.set_verbosity_error()  # generation-config chatter would interleave with our output
    transformers.logging.disable_progress_bar()  # its weight-loading bar would break piped output
    torch_dtype = getattr(torch, dtype)
    key = "dtype" if _version(transformers.__version__) >= (4, 56) else "torch_dtype"
    started = time.perf_counter()
    try:
        if load_format == "dummy":
            config = transformers.AutoConfig.from_pretrained(folder)
            torch.manual_seed(seed)
            model = transformers.AutoModelForCausalLM.from_config(config, **{key: torch_dtype})
        else:
            model = transformers.AutoModelForCausalLM.from_pretrained(folder, **{key: torch_dtype})
    except (OSError, ValueError, KeyError) as exc:
        raise UserError(f"transformers cannot load {folder}: {' '.join(str(exc).split())[:300]}") from None
    model = model.eval().to(device)
    config = model.config
    pad = config.pad_token_id if isinstance(getattr(config, "pad_token_id", None), int) else 0
    return HfModel(model, torch.device(device), pad, transformers.__version__, time.perf_counter() - started)


def _version(text: str) -> tuple[int, int]:
    parts = [int("".join(ch for ch in piece if ch.isdigit()) or 0) for piece in text.split(".")[:2]]
    return (parts + [0, 0])[0], (parts + [0, 0])[1]


def _generate(hf: HfModel, batch: list[Request]) -> int:
    """One padded batch; returns the tokens generated per row (all rows generate the same number)."""
    import torch

    width = max(len(r.prompt_token_ids) for r in batch)
    new = max(r.output_len for r in batch)
    ids = torch.tensor([[hf.pad_id] * (width - len(r.prompt_token_ids)) + r.prompt_token_ids for r in batch],
                       device=hf.device)
    mask = torch.tensor([[0] * (width - len(r.prompt_token_ids)) + [1] * len(r.prompt_token_ids) for r in batch],
                        device=hf.device)
    with torch.no_grad():
        out = hf.model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new,
                                do_sample=False, pad_token_id=hf.pad_id)
    produced = out.shape[1] - width
    if produced != new:
        raise RuntimeError(f"transformers generated {produced} tokens instead of {new}")
    return produced


def _sync(hf: HfModel) -> None:
    import torch

    if hf.device.type == "cuda":
        torch.cuda.synchronize(hf.device)


def hf_throughput(hf: HfModel, requests: list[Request], batch_size: int, repeats: int,
                  progress: Progress) -> PassTimes:
    _generate(hf, [Request(requests[0].prompt_token_ids[:8], 2)])  # warm-up, as for the engine
    batches = [requests[i:i + batch_size] for i in range(0, len(requests), batch_size)]
    seconds = []
    for repeat in range(repeats):
        phase = f"transformers pass {repeat + 1}/{repeats}"
        done = 0
        progress(phase, 0, len(requests))
        started = time.perf_counter()
        for batch in batches:
            _generate(hf, batch)
            done += len(batch)
            progress(phase, done, len(requests))
        _sync(hf)
        seconds.append(time.perf_counter() - started)
    return PassTimes(seconds, len(requests), sum(len(r.prompt_token_ids) for r in requests),
                     sum(r.output_len for r in requests))


def hf_latency(hf: HfModel, requests: list[Request], warmup_iters: int, iters: int,
               progress: Progress) -> list[float]:
    for i in range(warmup_iters):
        progress("transformers warm-up", i, warmup_iters)
        _generate(hf, requests)
    latencies = []
    for i in range(iters):
        progress("transformers timed", i, iters)
        started = time.perf_counter()
        _generate(hf, requests)
        _sync(hf)
        latencies.append(time.perf_counter() - started)
    progress("transformers timed", iters, iters)
    return latencies


def release(hf: HfModel) -> None:
    import gc

    hf.model = None
    gc.collect()

