"""Pipeline parallelism's steady-state decode throughput: one engine with --pipeline-parallel-size P, its
micro-batches in flight (one per stage, the engine's way) against the same ranks running one batch at a time
(every stage but one idle in each step), on the same batch of decoding sequences, in the same run.

    python benchmarks/pipeline.py [--stages 2] [--seqs 128] [--new-tokens 32] [--hidden 2048] [--layers 4] [--dtype float32] [--json]

The model is a random-weight Llama (--load-format dummy) of the given size, on the CPU over gloo; each
rank gets the host's cores divided between the ranks. Throughput counts the decode tokens after every
prompt's prefill. The bubble share is estimated from the two runs: one batch at a time keeps each stage
busy 1/P of the time (ideally), so micro-batches that run at `speedup` times its rate leave each stage idle
1 - speedup / P of the time.

The defaults give each stage a batch whose time grows with its rows (128 sequences, two micro-batches of 64 on a
2048-wide model): there a stage's step costs about half as much at half the rows, and micro-batching can approach
P times one batch at a time. At a few rows a CPU stage is bound by reading its weights, which two micro-batches
read twice per round where one batch reads them once, and the speedup shrinks towards 1 (pipeline parallelism
is for models that do not fit one device, not for small batches).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from llmctl.engine import EngineArgs, SamplingParams
from llmctl.engine.executor.multiproc_executor import multiproc_executor_for
from llmctl.engine.llm_engine import LLMEngine


class OneBatchAtATime:
    """The pipeline executor with one batch in flight: the engine steps it as it does a single rank."""

    max_concurrent_batches = 1

    def __init__(self, inner):
        self._inner = inner

    def __getattr__(self, name):
        return getattr(self._inner, name)


def _model_folder(root: Path, hidden: int, layers: int, dtype: str = "float32") -> Path:
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": hidden,
              "intermediate_size": 3 * hidden, "num_hidden_layers": layers, "num_attention_heads": hidden // 64,
              "num_key_value_heads": hidden // 128, "vocab_size": 4096, "max_position_embeddings": 512,
              "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "tie_word_embeddings": False, "torch_dtype": dtype}
    (root / "config.json").write_text(json.dumps(config))
    return root


def _decode_rate(engine: LLMEngine, seqs: int, new_tokens: int) -> float:
    """Decode tokens per second once every sequence has its first token."""
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    for i in range(seqs):
        engine.add_request(str(i), [(7 * i + j) % 4000 for j in range(16)], params)
    started: set[str] = set()
    start = None
    while engine.has_unfinished_requests():
        outputs = engine.step().outputs
        if start is None:
            started.update(o.request_id for o in outputs)
            if len(started) == seqs:
                start = time.perf_counter()
    # tokens decoded after `start`: every sequence's new tokens but the first
    return seqs * (new_tokens - 1) / (time.perf_counter() - start)


def _run(args: EngineArgs, pipelined: bool, seqs: int, new_tokens: int) -> float:
    build = multiproc_executor_for(args.parallel, args.num_threads)
    engine = LLMEngine(args, executor_class=build if pipelined else (lambda config: OneBatchAtATime(build(config))))
    try:
        _decode_rate(engine, 2, 4)  # warm-up
        return _decode_rate(engine, seqs, new_tokens)
    finally:
        engine.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--stages", type=int, default=2)
    parser.add_argument("--seqs", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--json", action="store_true")
    opts = parser.parse_args()
    with tempfile.TemporaryDirectory() as root:
        args = EngineArgs(model=str(_model_folder(Path(root), opts.hidden, opts.layers, opts.dtype)),
                          load_format="dummy", device="cpu", dtype=opts.dtype, skip_tokenizer_init=True, max_model_len=256,
                          max_num_seqs=opts.seqs, pipeline_parallel_size=opts.stages)
        one_at_a_time = _run(args, False, opts.seqs, opts.new_tokens)
        micro_batched = _run(args, True, opts.seqs, opts.new_tokens)
    speedup = micro_batched / one_at_a_time
    result = {"stages": opts.stages, "seqs": opts.seqs, "hidden": opts.hidden, "layers": opts.layers, "dtype": opts.dtype,
              "one_batch_at_a_time_tok_s": round(one_at_a_time, 1), "micro_batched_tok_s": round(micro_batched, 1),
              "speedup": round(speedup, 2), "bubble_share": round(max(0.0, 1 - speedup / opts.stages), 3)}
    if opts.json:
        print(json.dumps(result))
    else:
        for key, value in result.items():
            print(f"{key:28s} {value}")


if __name__ == "__main__":
    main()
