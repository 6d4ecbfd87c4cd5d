"""The embedded default model (issue 3): the training script, and the shipped Hugging Face folder.

Checked with transformers and tokenizers only; the engine's own tests live elsewhere.
The training-script tests run on a small synthetic play; the tests of the shipped model against
tiny-shakespeare find it through `$LLMCTL_TRAIN_CORPUS` (default ../shared/data/ beside the
repository) and skip when it is absent; `.ci/run` refuses to run without it, so CI never skips them.
"""

from __future__ import annotations

import hashlib
import json
import os
import math
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch
from jinja2.sandbox import ImmutableSandboxedEnvironment
from safetensors import safe_open
from tokenizers import Tokenizer

from corpus import load_trainer, real_corpus, synthetic_play

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "tools" / "train_default_model.py"
SHIPPED = ROOT / "llmctl" / "default_model"
HF_FILES = ["config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "generation_config.json"]
CARD_FILES = ["README.md", "metrics.json"]
TINY_ARGS = [
    "--vocab-size", "320", "--hidden-size", "32", "--layers", "1", "--heads", "2", "--kv-heads", "1",
    "--intermediate-size", "64", "--max-position", "64", "--seq-len", "32", "--batch-size", "4",
    "--max-steps", "20", "--eval-interval", "10", "--eval-windows", "2", "--warmup-steps", "5",
    "--sample-tokens", "16", "--log-interval", "5",
]
SPEAKER_LINE = re.compile(r"^[A-Z][A-Za-z]*(?: [A-Z][A-Za-z]*)*:$", re.MULTILINE)


def corpus_text() -> str:
    return real_corpus().read_text(encoding="utf-8")


def val_text(text: str) -> str:
    return text[int(len(text) * 0.9) :]


def run_trainer(corpus: Path, out: Path, *extra: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, str(SCRIPT), str(corpus), "--out", str(out), *TINY_ARGS, *extra]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=ROOT)


def read_json(path: Path) -> dict:
    return json.loads(path.read_text(encoding="utf-8"))


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def folder_bytes(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())


def load_hf(folder: Path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(folder)
    return model, AutoTokenizer.from_pretrained(folder)


def greedy_ids(model, ids: list[int], new_tokens: int) -> list[int]:
    inputs = torch.tensor([ids])
    out = model.generate(inputs, attention_mask=torch.ones_like(inputs), max_new_tokens=new_tokens,
                         do_sample=False, temperature=None, top_k=None, top_p=None)
    return out[0, len(ids) :].tolist()


@torch.no_grad()
def sliding_window_loss(model, ids: torch.Tensor, seq_len: int, stride: int) -> tuple[float, int]:
    """Mean NLL per token; each token after the first scored once, in the latest window holding it."""
    nll, count, scored_to = 0.0, 0, 1
    for begin in range(0, len(ids) - 1, stride):
        end = min(begin + seq_len, len(ids))
        logits = model(input_ids=ids[None, begin:end]).logits[0, :-1].float()
        losses = torch.nn.functional.cross_entropy(logits, ids[begin + 1 : end], reduction="none")
        fresh = losses[max(scored_to - begin - 1, 0) :]
        nll, count, scored_to = nll + fresh.sum().item(), count + fresh.numel(), end
        if end == len(ids):
            break
    return nll / count, count


def unigram_loss(train_ids: list[int], val_ids: list[int], vocab: int) -> float:
    """Cross-entropy of an add-one unigram model of the training tokens on the validation tokens."""
    counts, total = Counter(train_ids), len(train_ids) + vocab
    return -sum(math.log((counts[i] + 1) / total) for i in val_ids) / len(val_ids)


# ---------------------------------------------------------------- the training script, tiny run


@pytest.fixture(scope="module")
def tiny_corpus(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("corpus") / "slice.txt"
    path.write_text(synthetic_play(20_000), encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def tiny_run(tiny_corpus, tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    out = tmp_path_factory.mktemp("tiny") / "model"
    proc = run_trainer(tiny_corpus, out)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out, proc


def test_tiny_run_writes_complete_hf_folder(tiny_run):
    out, proc = tiny_run
    for name in HF_FILES + CARD_FILES:
        assert (out / name).is_file(), f"missing {name}"
    config = read_json(out / "config.json")
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["torch_dtype"] == "bfloat16"
    assert config["tie_word_embeddings"] is True
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        assert {f.get_tensor(k).dtype for k in f.keys()} == {torch.bfloat16}
    assert re.search(r"step\s+10 \| val loss \d+\.\d+", proc.stdout), "periodic validation loss not printed"
    assert re.search(r"step\s+5 \| loss \d+\.\d+", proc.stdout), "training progress not printed"


def test_tiny_run_loads_in_transformers(tiny_run):
    out, _ = tiny_run
    model, tok = load_hf(out)
    assert type(model).__name__ == "LlamaForCausalLM"
    assert model.config.num_hidden_layers == 1 and model.config.vocab_size == 320
    ids = tok("ROMEO:\n").input_ids
    assert len(greedy_ids(model.float(), ids, 5)) == 5


def test_tiny_run_metrics_cover_the_held_out_tenth(tiny_run, tiny_corpus):
    out, _ = tiny_run
    metrics = read_json(out / "metrics.json")
    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    held_out = tok.encode(val_text(tiny_corpus.read_text(encoding="utf-8"))).ids
    assert metrics["val_tokens"] == len(held_out) - 1
    assert metrics["val_ppl"] == pytest.approx(math.exp(metrics["val_loss"]), rel=1e-4)
    assert metrics["eval"]["seq_len"] == 64 and metrics["eval"]["stride"] == 32
    assert metrics["train"]["steps"] == 20 and metrics["train"]["stopped_by"] == "max-steps"
    first, last = metrics["train"]["val_history"][0], metrics["train"]["val_history"][-1]
    assert last["val_loss"] < first["val_loss"], "validation loss did not improve in 20 steps"


def test_tiny_run_val_loss_recomputes_independently(tiny_run, tiny_corpus):
    out, _ = tiny_run
    metrics = read_json(out / "metrics.json")
    model, _ = load_hf(out)
    held_out = Tokenizer.from_file(str(out / "tokenizer.json")).encode(val_text(tiny_corpus.read_text())).ids
    ev, sl = metrics["eval"], metrics["slice"]
    loss, count = sliding_window_loss(model.float(), torch.tensor(held_out), ev["seq_len"], ev["stride"])
    assert (count, loss) == (metrics["val_tokens"], pytest.approx(metrics["val_loss"], abs=1e-4))
    loss, count = sliding_window_loss(model.float(), torch.tensor(held_out), sl["seq_len"], sl["stride"])
    assert (count, loss) == (sl["val_tokens"], pytest.approx(sl["val_loss"], abs=1e-4))


def test_tiny_run_card_reports_its_numbers(tiny_run, tiny_corpus):
    out, _ = tiny_run
    card = (out / "README.md").read_text(encoding="utf-8")
    metrics = read_json(out / "metrics.json")
    assert f"| validation perplexity | {metrics['val_ppl']:.2f} |" in card
    assert f"| validation loss | {metrics['val_loss']:.4f} nats/token |" in card
    assert f"tools/train_default_model.py {tiny_corpus}" in card
    assert card.count("```text") == 3, "expected three sample outputs"
    assert "public domain" in card


def test_training_is_reproducible_with_fixed_seed(tiny_run, tiny_corpus, tmp_path):
    out, _ = tiny_run
    proc = run_trainer(tiny_corpus, tmp_path / "again")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert sha256(tmp_path / "again" / "model.safetensors") == sha256(out / "model.safetensors")
    assert read_json(tmp_path / "again" / "metrics.json")["val_loss"] == read_json(out / "metrics.json")["val_loss"]


def test_time_budget_stops_training_and_keeps_best_weights(tiny_corpus):
    trainer = load_trainer()
    args = trainer.parse_args([str(tiny_corpus), "--out", "unused", *TINY_ARGS,
                               "--max-steps", "1000000", "--time-budget-min", "0.02"])
    text = tiny_corpus.read_text(encoding="utf-8")
    train_text, held_out = trainer.split_corpus(text)
    tok = trainer.train_tokenizer(train_text, args.vocab_size)
    model = trainer.build_model(args, tok)
    val_ids = trainer.encode(tok, held_out)
    result = trainer.train(model, [trainer.encode(tok, train_text)], val_ids, args)
    assert result.stopped_by == "time-budget"
    assert 0 < result.steps < 1_000_000 and result.seconds < 30
    assert round(result.best_val, 4) == min(h["val_loss"] for h in result.history)
    kept = trainer.window_loss(model, trainer.fixed_val_windows(val_ids, args))
    assert kept == pytest.approx(result.best_val, abs=1e-5), "model does not hold the best checkpoint"


def test_learning_rate_warms_up_then_anneals_to_floor_by_budget(tiny_corpus):
    trainer = load_trainer()
    args = trainer.parse_args([str(tiny_corpus), "--out", "unused", "--lr", "1e-3", "--warmup-steps", "10",
                               "--max-steps", "1000", "--time-budget-min", "1", "--min-lr-ratio", "0.1"])
    assert trainer.lr_at(0, 0.0, args) == pytest.approx(1e-4)
    assert trainer.lr_at(9, 0.0, args) == pytest.approx(1e-3)
    assert trainer.lr_at(500, 0.0, args) == pytest.approx(5.5e-4)
    assert trainer.lr_at(100, 60.0, args) == pytest.approx(1e-4), "time budget spent: lr at its floor"
    assert trainer.lr_at(1000, 0.0, args) == pytest.approx(1e-4), "step budget spent: lr at its floor"


def test_draft_mode_trains_a_small_model_on_the_targets_tokenizer(tiny_run, tiny_corpus, tmp_path):
    """--draft-of: the target's tokenizer files byte for byte, its context length, the draft shape; the
    engine takes the result as the target's draft."""
    from llmctl.engine.model_config import ModelConfig
    from llmctl.engine.spec_decode.draft_proposer import DraftModel

    target, _ = tiny_run
    out = tmp_path / "draft"
    cmd = [sys.executable, str(SCRIPT), str(tiny_corpus), "--out", str(out), "--draft-of", str(target),
           "--hidden-size", "16", "--heads", "2", "--kv-heads", "1", "--intermediate-size", "32", "--seq-len", "32",
           "--batch-size", "4", "--max-steps", "20", "--eval-interval", "10", "--eval-windows", "2",
           "--warmup-steps", "5", "--sample-tokens", "8", "--log-interval", "5"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (out / name).read_bytes() == (target / name).read_bytes()
    config, target_config = read_json(out / "config.json"), read_json(target / "config.json")
    assert config["num_hidden_layers"] == 1 and config["hidden_size"] == 16  # the draft default: 1 layer
    assert (config["vocab_size"], config["max_position_embeddings"]) == (320, 64) == (
        target_config["vocab_size"], target_config["max_position_embeddings"])
    history = read_json(out / "metrics.json")["train"]["val_history"]
    assert history[-1]["val_loss"] < history[0]["val_loss"]
    assert "default-draft" in (out / "README.md").read_text(encoding="utf-8")
    DraftModel.load(str(out), ModelConfig.from_pretrained(target), target, 64)


def test_draft_mode_refuses_another_vocabulary_size(tiny_run, tiny_corpus, capsys):
    target, _ = tiny_run
    with pytest.raises(SystemExit) as exit_info:
        load_trainer().parse_args([str(tiny_corpus), "--out", "unused", "--draft-of", str(target), "--vocab-size", "999"])
    assert exit_info.value.code == 2 and "differs from the target's 320" in capsys.readouterr().err


# ---------------------------------------------------------------- the shipped model


@pytest.fixture(scope="module")
def shipped():
    assert (SHIPPED / "model.safetensors").is_file(), f"default model missing in {SHIPPED}"
    return load_hf(SHIPPED)


def test_shipped_folder_is_complete_and_small():
    for name in HF_FILES + CARD_FILES:
        assert (SHIPPED / name).is_file(), f"missing {name}"
    assert folder_bytes(SHIPPED) < 10 * 1024 * 1024
    assert read_json(SHIPPED / "config.json")["architectures"] == ["LlamaForCausalLM"]


def test_shipped_card_names_validation_perplexity():
    card = (SHIPPED / "README.md").read_text(encoding="utf-8")
    metrics = read_json(SHIPPED / "metrics.json")
    assert f"| validation perplexity | {metrics['val_ppl']:.2f} |" in card
    assert "python tools/train_default_model.py ../shared/data/tinyshakespeare.txt --out llmctl/default_model" in card
    assert f"{metrics['params']:,}" in card


def test_shipped_model_same_greedy_tokens_from_both_tokenizer_routes(shipped):
    from transformers import PreTrainedTokenizerFast

    model, auto_tok = shipped
    model = model.float()
    raw_tok = Tokenizer.from_file(str(SHIPPED / "tokenizer.json"))
    fast_tok = PreTrainedTokenizerFast(tokenizer_file=str(SHIPPED / "tokenizer.json"))
    prompt = "ROMEO:\n"
    raw_ids, auto_ids = raw_tok.encode(prompt).ids, auto_tok(prompt).input_ids
    assert raw_ids == auto_ids == fast_tok(prompt).input_ids
    from_raw, from_auto = greedy_ids(model, raw_ids, 40), greedy_ids(model, auto_ids, 40)
    assert from_raw == from_auto
    assert raw_tok.decode(from_raw) == auto_tok.decode(from_auto, skip_special_tokens=True)


def test_shipped_model_held_out_slice_loss_matches_metrics_and_beats_unigram(shipped):
    """Recompute the fixed held-out slice independently: it must match metrics.json and beat an
    add-one unigram model of the training tokens by over a nat (it learned more than frequencies).
    The whole-split number in the card comes from the same code path, checked on the tiny run."""
    model, _ = shipped
    metrics = read_json(SHIPPED / "metrics.json")
    tok = Tokenizer.from_file(str(SHIPPED / "tokenizer.json"))
    text = corpus_text()
    held_out = tok.encode(val_text(text)).ids
    sl = metrics["slice"]
    first = held_out[: int(re.search(r"\d+", sl["tokens"]).group())]
    loss, count = sliding_window_loss(model.float(), torch.tensor(first), sl["seq_len"], sl["stride"])
    assert count == sl["val_tokens"]
    assert loss == pytest.approx(sl["val_loss"], abs=2e-3)
    assert metrics["val_tokens"] == len(held_out) - 1
    baseline = unigram_loss(tok.encode(text[: int(len(text) * 0.9)]).ids, held_out, tok.get_vocab_size())
    assert loss < baseline - 1.0, f"slice loss {loss:.3f} vs unigram {baseline:.3f}"
    assert metrics["val_loss"] < baseline - 1.0, f"val loss {metrics['val_loss']:.3f} vs unigram {baseline:.3f}"


def test_shipped_model_writes_shakespeare_like_text(shipped):
    model, tok = shipped
    words = set(re.findall(r"[A-Za-z']+", corpus_text()))
    torch.manual_seed(0)
    ids = tok("ROMEO:\n", return_tensors="pt").input_ids
    out = model.float().generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=200,
                                 do_sample=True, temperature=0.8, top_k=50, top_p=None)
    text = tok.decode(out[0], skip_special_tokens=True)
    generated = re.findall(r"[A-Za-z']+", text)
    known = sum(w in words for w in generated) / len(generated)
    assert known > 0.8, f"only {known:.0%} of generated words occur in the corpus:\n{text}"
    assert len(SPEAKER_LINE.findall(text)) >= 2, f"no speaker lines in:\n{text}"
    assert text.count("\n") >= 5, f"no verse lines in:\n{text}"


# ---------------------------------------------------------------- tokenizer and chat template alone


def test_tokenizers_library_round_trips_corpus_text():
    tok = Tokenizer.from_file(str(SHIPPED / "tokenizer.json"))
    text = corpus_text()
    for sample in (text[:5000], val_text(text)[:5000], "Café ñ — “quoted” 日本 🙂\n\ttab"):
        assert tok.decode(tok.encode(sample).ids) == sample
    assert 1000 <= tok.get_vocab_size() <= 4096
    for special in ("<|bos|>", "<|endoftext|>", "<|im_start|>", "<|im_end|>"):
        assert tok.encode(special).ids == [tok.token_to_id(special)]


def test_chat_template_renders_in_sandboxed_jinja_and_matches_transformers(shipped):
    _, auto_tok = shipped
    config = read_json(SHIPPED / "tokenizer_config.json")
    assert config["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert (config["bos_token"], config["eos_token"]) == ("<|bos|>", "<|endoftext|>")
    template = ImmutableSandboxedEnvironment().from_string(config["chat_template"])
    messages = [{"role": "system", "content": "Speak as a player."},
                {"role": "user", "content": "Who goes there?"}]
    rendered = template.render(messages=messages, add_generation_prompt=True, bos_token=config["bos_token"])
    assert rendered == ("<|im_start|>system\nSpeak as a player.<|im_end|>\n"
                        "<|im_start|>user\nWho goes there?<|im_end|>\n<|im_start|>assistant\n")
    assert auto_tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == rendered
    tok = Tokenizer.from_file(str(SHIPPED / "tokenizer.json"))
    assert tok.encode(rendered).ids.count(tok.token_to_id("<|im_start|>")) == 3


# ---------------------------------------------------------------- where the corpus comes from


def test_ci_refuses_to_run_without_the_corpus(tmp_path):
    """CI must never skip the corpus tests: .ci/run stops (before installing anything) without it."""
    env = {"PATH": "/usr/bin:/bin", "LLMCTL_TRAIN_CORPUS": str(tmp_path / "missing.txt")}
    proc = subprocess.run(["bash", str(ROOT / ".ci" / "run")], capture_output=True, text=True, env=env, timeout=60)
    assert proc.returncode == 2
    assert f"training corpus not found at {tmp_path / 'missing.txt'}" in proc.stderr
    assert "LLMCTL_TRAIN_CORPUS" in proc.stderr


def test_trainer_reads_the_corpus_from_the_env_variable(tmp_path, monkeypatch):
    trainer = load_trainer()
    play = tmp_path / "play.txt"
    play.write_text(synthetic_play(2_000), encoding="utf-8")
    monkeypatch.setenv("LLMCTL_TRAIN_CORPUS", str(play))
    assert trainer.parse_args(["--out", "unused"]).corpus == play
    monkeypatch.setenv("LLMCTL_TRAIN_CORPUS", str(tmp_path / "missing.txt"))
    proc = subprocess.run([sys.executable, str(SCRIPT), "--out", str(tmp_path / "out")], capture_output=True,
                          text=True, timeout=120, env=dict(os.environ))
    assert proc.returncode == 2
    assert f"training corpus not found at {tmp_path / 'missing.txt'}" in proc.stderr
