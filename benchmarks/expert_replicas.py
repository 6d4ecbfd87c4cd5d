"""Experts dealt over data-parallel replicas (`-dp D --enable-expert-parallel`, vLLM's attention-DP + EP) against
replicas that each hold every expert (`-dp D`), on the same requests in the same run: output tokens/s with every
replica busy and with one busy (the others then run idle steps, their experts serving its tokens), and what each
replica's weights occupy.

    python benchmarks/expert_replicas.py [--replicas 2] [--requests 16] [--new-tokens 32] [--hidden 1024]
                                         [--experts 32] [--top-k 4] [--layers 4] [--json]

The model is a random-weight Qwen3-MoE shape (--load-format dummy) with every layer sparse, on the CPU; each
replica gets the host's cores divided between the replicas (llmctl serve's split). Requests are 64-token random
prompts with `--new-tokens` forced greedy tokens, sent at once, round-robin over the busy replicas; throughput is
output tokens over the wall time from the first submission to the last token.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import threading
import time
from pathlib import Path

from llmctl.engine import EngineArgs, SamplingParams
from llmctl.server.replicas import load_replicas


def _model_folder(root: Path, hidden: int, experts: int, top_k: int, layers: int) -> Path:
    config = {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": hidden,
              "intermediate_size": 3 * hidden, "moe_intermediate_size": hidden // 2, "num_experts": experts,
              "num_experts_per_tok": top_k, "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [],
              "num_hidden_layers": layers, "num_attention_heads": hidden // 64, "num_key_value_heads": hidden // 128,
              "head_dim": 64, "vocab_size": 4096, "max_position_embeddings": 512, "rms_norm_eps": 1e-6,
              "rope_theta": 10000.0, "tie_word_embeddings": False, "torch_dtype": "float32"}
    (root / "config.json").write_text(json.dumps(config))
    return root


def _start(replicas) -> None:
    """At once, as the server does: replicas in lockstep warm up together."""
    threads = [threading.Thread(target=replica.start) for replica in replicas]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()


def _throughput(targets, requests: int, new_tokens: int) -> float:
    """Output tokens/s of `requests` greedy requests sent at once round-robin over `targets`."""
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)

    async def one(index: int) -> int:
        prompt = [(31 * index + 7 * j) % 4000 for j in range(64)]
        out = None
        async for out in targets[index % len(targets)].generate(prompt, params, request_id=f"b{index}"):
            pass
        return len(out.outputs[0].token_ids)

    async def every() -> int:
        return sum(await asyncio.gather(*(one(i) for i in range(requests))))

    start = time.perf_counter()
    tokens = asyncio.run(every())
    return tokens / (time.perf_counter() - start)


def measure(folder: Path, replicas: int, expert_parallel: bool, requests: int, new_tokens: int) -> dict:
    engines = load_replicas(EngineArgs(model=str(folder), load_format="dummy", data_parallel_size=replicas,
                                       enable_expert_parallel=expert_parallel, dtype="float32", device="cpu",
                                       max_model_len=256, max_num_seqs=requests, skip_tokenizer_init=True))
    try:
        _start(engines)
        every = _throughput(engines, requests, new_tokens)
        one = _throughput(engines[:1], requests // replicas, new_tokens)
        return {"expert_parallel": expert_parallel, "every_busy_tok_s": every, "one_busy_tok_s": one,
                "weight_mib_per_replica": engines[0].model_info.weight_bytes / 2**20,
                "placement": [list(p) for p in engines[0].model_info.expert_placement]}
    finally:
        for engine in engines:
            engine.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--experts", type=int, default=32)
    parser.add_argument("--top-k", type=int, default=4)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as root:
        folder = _model_folder(Path(root), args.hidden, args.experts, args.top_k, args.layers)
        rows = [measure(folder, args.replicas, ep, args.requests, args.new_tokens) for ep in (False, True)]
    if args.json:
        print(json.dumps(rows, indent=2))
        return
    print(f"{args.replicas} replicas, {args.requests} requests x {args.new_tokens} tokens, hidden {args.hidden}, "
          f"{args.experts} experts top-{args.top_k}, {args.layers} layers, float32")
    print(f"{'experts':<28}{'every busy tok/s':>18}{'one busy tok/s':>16}{'weights/replica':>17}")
    for row in rows:
        label = f"over the replicas ({len(row['placement'])})" if row["expert_parallel"] else "all on every replica"
        print(f"{label:<28}{row['every_busy_tok_s']:>18.1f}{row['one_busy_tok_s']:>16.1f}"
              f"{row['weight_mib_per_replica']:>13.1f} MiB")
    print(f"ratio (over / all): every busy {rows[1]['every_busy_tok_s'] / rows[0]['every_busy_tok_s']:.2f}x, "
          f"one busy {rows[1]['one_busy_tok_s'] / rows[0]['one_busy_tok_s']:.2f}x")


if __name__ == "__main__":
    main()
