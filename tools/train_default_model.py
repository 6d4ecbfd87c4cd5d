#!/usr/bin/env python3
"""Train llmctl's embedded default model: a small Llama-architecture LM on tiny-shakespeare.

A tool, not part of the package: it needs torch, tokenizers and transformers >= 5 (a test extra);
llmctl itself never imports transformers. The output folder is a standard Hugging Face
checkpoint (config.json, bfloat16 model.safetensors, tokenizer.json, tokenizer_config.json,
generation_config.json) plus a model card README.md and metrics.json.

    python tools/train_default_model.py ../shared/data/tinyshakespeare.txt --out llmctl/default_model

A draft model for speculative decoding (`--speculative-config '{"model": "default-draft", ...}'`)
comes from the same script with `--draft-of`: it reuses that model's tokenizer (the same ids, which a
draft must share with its target) and context length, trains on the same corpus split, and defaults
to a much smaller shape (1 layer, hidden 128: under 2 MB):

    python tools/train_default_model.py ../shared/data/tinyshakespeare.txt --out llmctl/default_draft \
        --draft-of llmctl/default_model

Without the corpus argument it reads `$LLMCTL_TRAIN_CORPUS`, else `../shared/data/tinyshakespeare.txt`
beside the repository (`default_corpus_path()`; the tests and `.ci/run` use the same rule).

The last 10% of the corpus (by characters, contiguous) is held out for validation; the
tokenizer and the model only ever see the first 90%. Training stops at --max-steps or when
--time-budget-min runs out, whichever comes first; the learning rate follows a cosine curve over
whichever of the two is further along, so a run cut short by the clock still ends annealed.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import shlex
import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

BOS, EOS, IM_START, IM_END = "<|bos|>", "<|endoftext|>", "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = [EOS, BOS, IM_START, IM_END]
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
VAL_FRACTION = 0.1
SAMPLE_PROMPTS = [("ROMEO:\n", False), ("JULIET:\n", True), ("First Citizen:\n", True)]
CORPUS_SOURCE = "https://raw.githubusercontent.com/karpathy/char-rnn/master/data/tinyshakespeare/input.txt"
CORPUS_ENV = "LLMCTL_TRAIN_CORPUS"
REPO_ROOT = Path(__file__).resolve().parent.parent
# Architecture defaults of the default model and of a draft (--draft-of). The draft's 1 layer of hidden 128
# is ~0.45M parameters (0.9 MB in bf16, most of it the tied 2048 x 128 embedding), about a tenth of the
# target's compute per token, which is what makes its proposals cheap enough to pay off.
MODEL_DEFAULTS = {"hidden_size": 256, "layers": 5, "heads": 8, "kv_heads": 4, "intermediate_size": 768}
DRAFT_DEFAULTS = {"hidden_size": 128, "layers": 1, "heads": 4, "kv_heads": 2, "intermediate_size": 384}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def default_corpus_path() -> Path:
    """Where the training corpus is looked for: `$LLMCTL_TRAIN_CORPUS`, else `../shared/data/` beside the repo."""
    return Path(os.environ.get(CORPUS_ENV) or REPO_ROOT.parent / "shared" / "data" / "tinyshakespeare.txt")


@dataclass
class TrainResult:
    steps: int = 0
    seconds: float = 0.0
    best_val: float = float("inf")
    best_step: int = 0
    stopped_by: str = "max-steps"
    history: list = field(default_factory=list)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("corpus", type=Path, nargs="?", default=None,
                   help=f"plain-text training corpus (default: ${CORPUS_ENV}, else ../shared/data/tinyshakespeare.txt)")
    p.add_argument("--out", type=Path, required=True, help="output folder (created or overwritten)")
    p.add_argument("--draft-of", type=Path, default=None, metavar="FOLDER",
                   help="train a draft model for FOLDER's model: its tokenizer and context length, smaller "
                        "defaults (1 layer, hidden 128)")
    p.add_argument("--vocab-size", type=int, default=None, help="BPE vocabulary (default 2048; a draft: its target's)")
    p.add_argument("--hidden-size", type=int, default=None, help="default 256 (a draft: 128)")
    p.add_argument("--layers", type=int, default=None, help="default 5 (a draft: 1)")
    p.add_argument("--heads", type=int, default=None, help="default 8 (a draft: 4)")
    p.add_argument("--kv-heads", type=int, default=None, help="default 4 (a draft: 2)")
    p.add_argument("--intermediate-size", type=int, default=None, help="default 768 (a draft: 384)")
    p.add_argument("--max-position", type=int, default=None,
                   help="max_position_embeddings (default 512; a draft: its target's)")
    p.add_argument("--rope-theta", type=float, default=10000.0)
    p.add_argument("--seq-len", type=int, default=512, help="training window in tokens")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--min-lr-ratio", type=float, default=0.1)
    p.add_argument("--warmup-steps", type=int, default=100)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--max-steps", type=int, default=100_000)
    p.add_argument("--time-budget-min", type=float, default=20.0, help="training-loop wall-clock budget")
    p.add_argument("--eval-interval", type=int, default=50, help="steps between validation checks")
    p.add_argument("--eval-windows", type=int, default=16, help="validation windows per check")
    p.add_argument("--log-interval", type=int, default=10)
    p.add_argument("--chat-fraction", type=float, default=0.1,
                   help="share of training windows drawn from chat-formatted speech pairs")
    p.add_argument("--eval-seq-len", type=int, default=0, help="final eval window (0: --max-position)")
    p.add_argument("--slice-tokens", type=int, default=4096,
                   help="also report the loss on this many leading held-out tokens (non-overlapping windows)")
    p.add_argument("--sample-tokens", type=int, default=120, help="new tokens per model-card sample")
    p.add_argument("--seed", type=int, default=1337)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args(argv)
    args.corpus = args.corpus or default_corpus_path()
    if not args.corpus.is_file():
        p.error(f"training corpus not found at {args.corpus}: pass its path or set {CORPUS_ENV}")
    if args.draft_of is not None:
        apply_draft_target(p, args)
    for name, value in (DRAFT_DEFAULTS if args.draft_of is not None else MODEL_DEFAULTS).items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    args.vocab_size = args.vocab_size or 2048
    args.max_position = args.max_position or 512
    args.eval_seq_len = args.eval_seq_len or args.max_position
    return args


def apply_draft_target(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """A draft shares its target's tokenizer (so the vocabulary) and covers its context length."""
    missing = [n for n in ("config.json", *TOKENIZER_FILES) if not (args.draft_of / n).is_file()]
    if missing:
        p.error(f"--draft-of {args.draft_of}: not a model folder written by this script (missing {', '.join(missing)})")
    config = json.loads((args.draft_of / "config.json").read_text())
    if args.vocab_size is not None and args.vocab_size != config["vocab_size"]:
        p.error(f"--vocab-size {args.vocab_size} differs from the target's {config['vocab_size']}: a draft "
                "shares its target's tokenizer")
    args.vocab_size = config["vocab_size"]
    args.max_position = args.max_position or config["max_position_embeddings"]


def log(msg: str) -> None:
    print(msg, flush=True)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)


def split_corpus(text: str) -> tuple[str, str]:
    cut = int(len(text) * (1 - VAL_FRACTION))
    return text[:cut], text[cut:]


def train_tokenizer(text: str, vocab_size: int) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(text.splitlines(keepends=True), trainer=trainer)
    return tok


def load_tokenizer(args: argparse.Namespace, train_text: str) -> Tokenizer:
    """A new BPE from the training split, or with --draft-of the target's own (the same token ids)."""
    if args.draft_of is None:
        return train_tokenizer(train_text, args.vocab_size)
    return Tokenizer.from_file(str(args.draft_of / "tokenizer.json"))


def chat_text(text: str) -> str:
    """Consecutive speeches as user/assistant turns, so the model learns the chat template."""
    speeches = [s.strip() for s in text.split("\n\n") if s.strip()]
    pairs = zip(speeches[:-1], speeches[1:])
    chats = [[{"role": "user", "content": a}, {"role": "assistant", "content": b}] for a, b in pairs]
    return "".join(render_chat(c) for c in chats)


def render_chat(messages: list[dict]) -> str:
    return "".join(f"{IM_START}{m['role']}\n{m['content']}{IM_END}\n" for m in messages)


def encode(tok: Tokenizer, text: str) -> torch.Tensor:
    return torch.tensor(tok.encode(text).ids, dtype=torch.long)


def build_model(args: argparse.Namespace, tok: Tokenizer):
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=tok.get_vocab_size(),
        hidden_size=args.hidden_size,
        intermediate_size=args.intermediate_size,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        max_position_embeddings=args.max_position,
        rope_parameters={"rope_type": "default", "rope_theta": args.rope_theta},
        tie_word_embeddings=True,
        bos_token_id=tok.token_to_id(BOS),
        eos_token_id=tok.token_to_id(EOS),
        pad_token_id=tok.token_to_id(EOS),
    )
    model = LlamaForCausalLM(config)
    model.generation_config = GenerationConfig(
        bos_token_id=tok.token_to_id(BOS),
        eos_token_id=[tok.token_to_id(EOS), tok.token_to_id(IM_END)],
        pad_token_id=tok.token_to_id(EOS),
        do_sample=True,
        temperature=0.8,
        top_k=50,
        top_p=0.95,
        max_new_tokens=200,
    )
    return model


def count_params(model) -> int:
    return sum(p.numel() for p in model.parameters())


def sample_batch(streams: list[torch.Tensor], args, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    rows = []
    for _ in range(args.batch_size):
        use_chat = len(streams) > 1 and torch.rand(1, generator=gen).item() < args.chat_fraction
        data = streams[1] if use_chat else streams[0]
        start = torch.randint(0, len(data) - args.seq_len - 1, (1,), generator=gen).item()
        rows.append(data[start : start + args.seq_len + 1])
    batch = torch.stack(rows)
    return batch[:, :-1], batch[:, 1:]


def fixed_val_windows(val_ids: torch.Tensor, args) -> torch.Tensor:
    gen = torch.Generator().manual_seed(args.seed + 1)
    starts = torch.randint(0, len(val_ids) - args.seq_len - 1, (args.eval_windows,), generator=gen)
    return torch.stack([val_ids[s : s + args.seq_len + 1] for s in starts.tolist()])


def lm_loss(model, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    logits = model(input_ids=x).logits
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1))


@torch.no_grad()
def window_loss(model, windows: torch.Tensor) -> float:
    model.eval()
    losses = [lm_loss(model, w[None, :-1], w[None, 1:]).item() for w in windows]
    model.train()
    return sum(losses) / len(losses)


def lr_at(step: int, elapsed: float, args) -> float:
    if step < args.warmup_steps:
        return args.lr * (step + 1) / args.warmup_steps
    budget = args.time_budget_min * 60
    progress = min(1.0, max(step / args.max_steps, elapsed / budget if budget > 0 else 1.0))
    floor = args.lr * args.min_lr_ratio
    return floor + (args.lr - floor) * 0.5 * (1 + math.cos(math.pi * progress))


def make_optimizer(model, args) -> torch.optim.Optimizer:
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, 0.95), eps=1e-8)


def check_validation(model, windows, step: int, result: TrainResult, best_state: dict) -> None:
    val = window_loss(model, windows)
    result.history.append({"step": step, "val_loss": round(val, 4)})
    marker = ""
    if val < result.best_val:
        result.best_val, result.best_step = val, step
        best_state.clear()
        best_state.update({k: v.detach().clone() for k, v in model.state_dict().items()})
        marker = " (best)"
    log(f"step {step:6d} | val loss {val:.4f} | val ppl {math.exp(val):8.2f}{marker}")


def train(model, streams: list[torch.Tensor], val_ids: torch.Tensor, args) -> TrainResult:
    gen = torch.Generator().manual_seed(args.seed)
    windows = fixed_val_windows(val_ids, args)
    opt = make_optimizer(model, args)
    result, best_state = TrainResult(), {}
    start = time.monotonic()
    model.train()
    step = 0
    while True:
        elapsed = time.monotonic() - start
        if step >= args.max_steps or elapsed >= args.time_budget_min * 60:
            result.stopped_by = "max-steps" if step >= args.max_steps else "time-budget"
            break
        if step % args.eval_interval == 0:
            check_validation(model, windows, step, result, best_state)
        train_step(model, opt, sample_batch(streams, args, gen), lr_at(step, elapsed, args))
        step += 1
        if step % args.log_interval == 0:
            log_progress(step, model, opt, args, time.monotonic() - start)
    check_validation(model, windows, step, result, best_state)
    model.load_state_dict(best_state)
    result.steps, result.seconds = step, time.monotonic() - start
    log(f"stopped by {result.stopped_by} after {step} steps in {result.seconds / 60:.1f} min; "
        f"keeping step {result.best_step} (val loss {result.best_val:.4f})")
    return result


def train_step(model, opt, batch, lr: float) -> None:
    for group in opt.param_groups:
        group["lr"] = lr
    loss = lm_loss(model, *batch)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    model.last_loss = loss.item()


def log_progress(step: int, model, opt, args, elapsed: float) -> None:
    tok_s = step * args.batch_size * args.seq_len / max(elapsed, 1e-9)
    lr = opt.param_groups[0]["lr"]
    log(f"step {step:6d} | loss {model.last_loss:.4f} | lr {lr:.2e} | {tok_s:7.0f} tok/s | {elapsed / 60:5.1f} min")


def save_checkpoint(model, tok: Tokenizer, out: Path, args) -> None:
    out.mkdir(parents=True, exist_ok=True)
    model.to(torch.bfloat16).save_pretrained(out, safe_serialization=True)
    model.to(torch.float32)
    (out / "model.safetensors").chmod(0o644)
    add_legacy_config_keys(out / "config.json", args)
    if args.draft_of is not None:  # byte for byte the target's: the engine compares them
        for name in TOKENIZER_FILES:
            shutil.copyfile(args.draft_of / name, out / name)
        return
    tok.save(str(out / "tokenizer.json"))
    write_json(out / "tokenizer_config.json", tokenizer_config(tok, args))


def add_legacy_config_keys(path: Path, args) -> None:
    """Keys that pre-5.0 transformers and other loaders read (5.x reads `dtype`/`rope_parameters`)."""
    config = json.loads(path.read_text())
    config["architectures"] = ["LlamaForCausalLM"]
    config["torch_dtype"] = "bfloat16"
    config["dtype"] = "bfloat16"
    config["rope_theta"] = args.rope_theta
    write_json(path, config)


def tokenizer_config(tok: Tokenizer, args) -> dict:
    added = {
        str(tok.token_to_id(t)): {"content": t, "lstrip": False, "normalized": False, "rstrip": False,
                                  "single_word": False, "special": True}
        for t in SPECIAL_TOKENS
    }
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": EOS,
        "add_bos_token": False,
        "add_eos_token": False,
        "added_tokens_decoder": added,
        "additional_special_tokens": [IM_START, IM_END],
        "clean_up_tokenization_spaces": False,
        "model_max_length": args.max_position,
        "chat_template": CHAT_TEMPLATE,
    }


def write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n")


def load_saved_model(out: Path):
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM.from_pretrained(out).float().eval()


@torch.no_grad()
def evaluate_perplexity(model, val_ids: torch.Tensor, seq_len: int, stride: int) -> dict:
    """Mean NLL per token over sliding windows. With stride < seq_len every token after the first
    is scored once, with at least seq_len - stride tokens of context (except in the first window);
    with stride == seq_len the windows are disjoint and each window's first token is not scored."""
    total_nll, scored, prev_end = 0.0, 0, 1
    for begin in range(0, len(val_ids) - 1, stride):
        end = min(begin + seq_len, len(val_ids))
        window = val_ids[begin:end][None]
        logits = model(input_ids=window).logits[0, :-1].float()
        targets = window[0, 1:]
        nll = F.cross_entropy(logits, targets, reduction="none")[max(prev_end - begin - 1, 0) :]
        total_nll, scored, prev_end = total_nll + nll.sum().item(), scored + nll.numel(), end
        if end == len(val_ids):
            break
    loss = total_nll / scored
    return {"val_loss": loss, "val_ppl": math.exp(loss), "val_tokens": scored, "val_nll_sum": total_nll}


def generate_samples(model, tok: Tokenizer, args) -> list[dict]:
    samples = []
    for i, (prompt, sampled) in enumerate(SAMPLE_PROMPTS):
        torch.manual_seed(args.seed + i)
        ids = encode(tok, prompt)[None]
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=args.sample_tokens,
                             do_sample=sampled, temperature=0.8 if sampled else None,
                             top_k=50 if sampled else None, top_p=None)
        samples.append({"prompt": prompt, "mode": "sampled" if sampled else "greedy",
                        "text": tok.decode(out[0].tolist())})
    return samples


def folder_bytes(out: Path) -> int:
    return sum(f.stat().st_size for f in out.iterdir() if f.is_file())


def command_line(argv: list[str]) -> str:
    return shlex.join(["python", "tools/train_default_model.py", *argv])


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    seed_everything(args.seed)
    run_start = time.monotonic()
    text = args.corpus.read_text(encoding="utf-8")
    train_text, val_text = split_corpus(text)
    tok = load_tokenizer(args, train_text)
    streams = [encode(tok, train_text), encode(tok, chat_text(train_text))]
    val_ids = encode(tok, val_text)
    log(f"corpus {len(text):,} chars | train {len(streams[0]):,} tokens | chat {len(streams[1]):,} tokens"
        f" | val {len(val_ids):,} tokens | vocab {tok.get_vocab_size()}")
    model = build_model(args, tok)
    log(f"model: LlamaForCausalLM, {count_params(model):,} parameters")
    result = train(model, streams, val_ids, args)
    save_checkpoint(model, tok, args.out, args)
    saved = load_saved_model(args.out)
    metrics = evaluate_perplexity(saved, val_ids, args.eval_seq_len, args.eval_seq_len // 2)
    log(f"final (bf16 weights, fp32 compute): val loss {metrics['val_loss']:.4f} | val ppl {metrics['val_ppl']:.2f}")
    metrics["slice"] = evaluate_perplexity(saved, val_ids[: args.slice_tokens], args.eval_seq_len, args.eval_seq_len)
    samples = generate_samples(saved, tok, args)
    info = run_info(args, argv, result, metrics, count_params(saved), len(streams[0]), len(val_text))
    info["vocab"] = tok.get_vocab_size()
    info["run_seconds"] = time.monotonic() - run_start
    write_json(args.out / "metrics.json", metrics_json(info))
    (args.out / "README.md").write_text(model_card(info, samples))
    log(f"wrote {args.out} ({folder_bytes(args.out) / 1e6:.2f} MB) in {info['run_seconds'] / 60:.1f} min")
    return 0


def run_info(args, argv, result: TrainResult, metrics: dict, params: int, train_tokens: int, val_chars: int) -> dict:
    tokens_per_step = args.batch_size * args.seq_len
    return {
        "args": args, "command": command_line(argv), "result": result, "metrics": metrics, "params": params,
        "train_tokens": train_tokens, "tokens_per_step": tokens_per_step,
        "tokens_seen": tokens_per_step * result.steps, "val_chars": val_chars,
        "bits_per_char": metrics["val_nll_sum"] / math.log(2) / val_chars,
    }


def metrics_json(info: dict) -> dict:
    args, m, r = info["args"], info["metrics"], info["result"]
    return {
        "val_loss": round(m["val_loss"], 6),
        "val_ppl": round(m["val_ppl"], 4),
        "val_tokens": m["val_tokens"],
        "val_bits_per_char": round(info["bits_per_char"], 6),
        "eval": {
            "split": f"last {VAL_FRACTION:.0%} of the corpus by characters (contiguous), tokenized on its own",
            "weights": "saved bfloat16 model.safetensors, computed in float32",
            "seq_len": args.eval_seq_len,
            "stride": args.eval_seq_len // 2,
            "scoring": "every token after the first scored once; sliding windows give each >= seq_len - stride context",
            "bos_prepended": False,
        },
        "slice": slice_json(m["slice"], args),
        "train": {
            "steps": r.steps, "best_step": r.best_step, "stopped_by": r.stopped_by,
            "seconds": round(r.seconds, 1), "tokens_per_step": info["tokens_per_step"],
            "tokens_seen": info["tokens_seen"], "train_tokens": info["train_tokens"], "seq_len": args.seq_len,
            "batch_size": args.batch_size, "val_history": r.history,
        },
        "params": info["params"],
        "command": info["command"],
    }


def slice_json(sl: dict, args) -> dict:
    """A cheap fixed check for other implementations (e.g. llmctl's engine) to reproduce exactly."""
    return {
        "tokens": f"first {args.slice_tokens} tokens of the held-out split",
        "seq_len": args.eval_seq_len,
        "stride": args.eval_seq_len,
        "scoring": "non-overlapping windows; every token but each window's first is scored",
        "val_loss": round(sl["val_loss"], 6),
        "val_ppl": round(sl["val_ppl"], 4),
        "val_tokens": sl["val_tokens"],
    }


def model_card(info: dict, samples: list[dict]) -> str:
    if info["args"].draft_of is not None:
        return "\n".join([draft_card_header(info), card_training(info), card_eval(info), card_samples(samples),
                          draft_card_usage()])
    return "\n".join([card_header(info), card_training(info), card_eval(info), card_samples(samples), card_usage()])


def draft_card_header(info: dict) -> str:
    a, p = info["args"], info["params"]
    return f"""# llmctl default draft: tiny Shakespeare Llama draft model

A {p / 1e6:.2f}M-parameter `LlamaForCausalLM` trained from scratch by llmctl as the draft model for
speculative decoding with the embedded default model: `--speculative-config '{{"model": "default-draft",
"num_speculative_tokens": 4}}'` runs it beside the target, which verifies its proposals. It shares the
target's tokenizer (`tokenizer.json` and `tokenizer_config.json` are the target's, byte for byte, from
`{a.draft_of}`), its {a.max_position}-position context and its corpus split.

{card_architecture(info, f"{info['vocab']:,} tokens: the target's byte-level BPE")}
## Corpus and licence

tiny-shakespeare ({CORPUS_SOURCE}), public domain, not redistributed with llmctl; the draft saw only
its first 90%, like the target; the last 10% ({info['val_chars']:,} characters) is held out.
"""


def draft_card_usage() -> str:
    return """## Use

```bash
llmctl generate --speculative-config '{"model": "default-draft", "num_speculative_tokens": 4}' "ROMEO:"
```

Its acceptance rate and the speed-up it gives are measured by `benchmarks/spec_decode.py` (table in
`benchmarks/README.md`). On its own it is a weaker pastiche generator than the default model.
"""


def card_architecture(info: dict, vocabulary: str) -> str:
    a, p = info["args"], info["params"]
    return f"""## Architecture

| | |
|---|---|
| architecture | `LlamaForCausalLM` (RMSNorm, SwiGLU MLP, rotary position embeddings, grouped-query attention) |
| parameters | {p:,} (tied input/output embeddings) |
| layers | {a.layers} |
| hidden size | {a.hidden_size} |
| attention heads / key-value heads | {a.heads} / {a.kv_heads} (head dim {a.hidden_size // a.heads}) |
| MLP intermediate size | {a.intermediate_size} |
| vocabulary | {vocabulary} |
| context | {a.max_position} positions (`max_position_embeddings`), rope theta {a.rope_theta:g} |
| weights | `model.safetensors`, bfloat16 |
"""


def card_header(info: dict) -> str:
    a, p = info["args"], info["params"]
    return f"""# llmctl default model: tiny Shakespeare Llama

A {p / 1e6:.2f}M-parameter decoder-only language model with the Llama architecture
(`LlamaForCausalLM`), trained from scratch by llmctl and shipped inside the package so that
`llmctl generate` and `llmctl serve` work with no download. It writes Shakespeare-flavoured
pastiche; it knows nothing else and is not an assistant.

{card_architecture(info, f"{info['vocab']:,} byte-level BPE tokens (`tokenizers`), special tokens `{'`, `'.join(SPECIAL_TOKENS)}`")}
No BOS token is added to prompts (the model was trained on raw text windows). The chat template
(in `tokenizer_config.json`) is ChatML-style: `<|im_start|>role\\ncontent<|im_end|>\\n`; a share
of the training windows were consecutive speeches rendered as user/assistant turns, so replies end
with `<|im_end|>`. `generation_config.json` stops on `<|endoftext|>` or `<|im_end|>`.

## Corpus and licence

tiny-shakespeare ({CORPUS_SOURCE}), the ~1.1 MB
concatenation of Shakespeare plays from Andrej Karpathy's char-rnn. Shakespeare's works are in
the public domain. The corpus is not redistributed with llmctl; the tokenizer and the model saw
only its first 90%, the last 10% ({info['val_chars']:,} characters) is held out for validation.
"""


def card_training(info: dict) -> str:
    a, r = info["args"], info["result"]
    return f"""## Training

Produced by this exact command (from the repository root, with the corpus at `../shared/data/`):

```bash
{info['command']}
```

| | |
|---|---|
| hardware | CPU, torch.set_num_threads({a.threads}) (torch {torch.__version__}) |
| training time | {r.seconds / 60:.1f} min ({r.steps:,} steps, stopped by {r.stopped_by}); whole run {info['run_seconds'] / 60:.1f} min |
| tokens per step | {info['tokens_per_step']:,} ({a.batch_size} windows x {a.seq_len} tokens); {a.chat_fraction:.0%} of windows from chat-formatted speech pairs |
| tokens seen | {info['tokens_seen']:,} ({info['tokens_seen'] / info['train_tokens']:.1f} passes over {info['train_tokens']:,} training tokens) |
| optimiser | AdamW (betas 0.9/0.95, weight decay {a.weight_decay}), peak lr {a.lr:g}, {a.warmup_steps} warmup steps, cosine to {a.min_lr_ratio:g}x over the step or time budget, grad clip 1.0 |
| seed | {a.seed} |
| checkpoint | weights from step {r.best_step}, the best of the periodic validation checks ({a.eval_windows} windows every {a.eval_interval} steps) |
"""


def card_eval(info: dict) -> str:
    m, a = info["metrics"], info["args"]
    return f"""## Evaluation

On the whole held-out split ({m['val_tokens']:,} tokens), with the saved bfloat16 weights loaded
in float32, sliding windows of {a.eval_seq_len} tokens with stride {a.eval_seq_len // 2}, no BOS:

| | |
|---|---|
| validation loss | {m['val_loss']:.4f} nats/token |
| validation perplexity | {m['val_ppl']:.2f} |
| bits per character | {info['bits_per_char']:.3f} |

A cheaper fixed check, the first {a.slice_tokens:,} held-out tokens in non-overlapping
{a.eval_seq_len}-token windows ({m['slice']['val_tokens']:,} tokens scored), gives loss
{m['slice']['val_loss']:.4f} (perplexity {m['slice']['val_ppl']:.2f}). These numbers, the eval
settings and the validation-loss history are in `metrics.json`.
"""


def card_samples(samples: list[dict]) -> str:
    parts = ["## Sample outputs\n",
             "Generated with `transformers` from the saved weights (sampled: temperature 0.8, top-k 50).\n"]
    for s in samples:
        parts.append(f"**{s['mode']}**, prompt `{s['prompt'].strip()}`:\n\n```text\n{s['text']}\n```\n")
    return "\n".join(parts)


def card_usage() -> str:
    return """## Use

```bash
llmctl generate "ROMEO:"
```

```python
from transformers import AutoModelForCausalLM, AutoTokenizer
tok = AutoTokenizer.from_pretrained("llmctl/default_model")
model = AutoModelForCausalLM.from_pretrained("llmctl/default_model")
ids = tok("ROMEO:\\n", return_tensors="pt").input_ids
print(tok.decode(model.generate(ids, max_new_tokens=80, do_sample=False)[0]))
```

Limitations: tiny and trained for minutes on a CPU; output is locally plausible verse with
invented words, no facts, and no instruction following.
"""


if __name__ == "__main__":
    sys.exit(main())
