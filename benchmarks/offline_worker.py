"""One system's side of benchmarks/offline_throughput.py, run in its own process (and, for vLLM,
its own Python). Prints `FIRST_TOKEN` as soon as the first token exists and one `RESULT {json}`
line per workload (llmctl's one-request runs add `decode_tokens` and `decode_seconds`: first token to last). Standalone on purpose: vLLM's venv does not have llmctl installed."""

from __future__ import annotations

import argparse
import json
import random
import sys
import time


def make_workloads(vocab: int, num_prompts: int, output_len: int, seed: int) -> dict[str, list[list[int]]]:
    rng = random.Random(seed)
    batched = [[rng.randrange(vocab) for _ in range(rng.randint(32, 256))] for _ in range(num_prompts)]
    single = [[rng.randrange(vocab) for _ in range(128)]]
    return {"batched": batched, "single": single}


def run_ours(args, workloads):
    from llmctl.engine import LLM, SamplingParams

    llm = LLM(args.model, dtype=args.dtype, skip_tokenizer_init=True, enable_prefix_caching=False,
              max_model_len=1024, max_num_seqs=args.num_prompts, num_threads=args.threads, device=args.device,
              quantization=args.quantization, quantization_batch_cache=args.quantization_batch_cache)
    first = llm.generate([workloads["single"][0][:8]], SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
    assert first[0].outputs[0].token_ids
    print("FIRST_TOKEN", flush=True)

    def run(prompts):
        params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
        outputs = llm.generate(prompts, params)
        tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
        if len(outputs) != 1:
            return tokens
        # one request: its decode alone (first token to the last), the time per output token without the prefill
        metrics = outputs[0].metrics
        return tokens, {"decode_tokens": tokens - 1, "decode_seconds": metrics.finished_time - metrics.first_token_time}

    return run


def run_transformers(args, workloads):
    import torch
    from transformers import AutoModelForCausalLM

    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[args.dtype]
    device = "cuda" if args.device == "auto" and torch.cuda.is_available() else args.device
    device = "cpu" if device == "auto" else device
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype).eval().to(device)
    print("FIRST_TOKEN", flush=True)

    def run(prompts):
        produced = 0
        for start in range(0, len(prompts), 16):  # batches of 16 with left padding: its usual use
            batch = prompts[start:start + 16]
            width = max(len(p) for p in batch)
            ids = torch.tensor([[0] * (width - len(p)) + p for p in batch], device=device)
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch], device=device)
            with torch.no_grad():
                out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=args.output_len,
                                     min_new_tokens=args.output_len, do_sample=False, pad_token_id=0)
            produced += (out.shape[1] - width) * len(batch)
        return produced

    return run


def run_vllm(args, workloads):
    from vllm import LLM, SamplingParams

    llm = LLM(model=args.model, dtype=args.dtype, skip_tokenizer_init=True, enable_prefix_caching=False,
              max_model_len=1024, max_num_seqs=args.num_prompts, seed=0)
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True, detokenize=False)
    llm.generate([{"prompt_token_ids": workloads["single"][0][:8]}], params, use_tqdm=False)
    print("FIRST_TOKEN", flush=True)

    def run(prompts):
        sp = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True, detokenize=False)
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
        return sum(len(o.outputs[0].token_ids) for o in outputs)

    return run


SYSTEMS = {"ours": run_ours, "transformers": run_transformers, "vllm": run_vllm}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--system", choices=sorted(SYSTEMS), required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--dtype", required=True)
    parser.add_argument("--vocab", type=int, required=True)
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--workloads", default="batched,single")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--quantization", default=None, help="ours only: --quantization (int8, int4-g32, ...)")
    parser.add_argument("--quantization-batch-cache", action="store_true",
                        help="ours only: quantised linears keep a bf16 copy for batches of 16+ rows")
    args = parser.parse_args()
    workloads = make_workloads(args.vocab, args.num_prompts, args.output_len, args.seed)
    run = SYSTEMS[args.system](args, workloads)
    run(workloads["single"][:1])  # warm-up at the real shapes
    for name in args.workloads.split(","):
        for repeat in range(args.repeats):
            start = time.perf_counter()
            tokens = run(workloads[name])  # or (tokens, decode-only figures) where the system reports them
            seconds = time.perf_counter() - start
            tokens, decode = tokens if isinstance(tokens, tuple) else (tokens, {})
            print("RESULT " + json.dumps({"system": args.system, "dtype": args.dtype, "workload": name,
                                          "repeat": repeat, "tokens": tokens, "seconds": seconds,
                                          "tokens_per_s": tokens / seconds, **decode}), flush=True)


if __name__ == "__main__":
    sys.exit(main())
