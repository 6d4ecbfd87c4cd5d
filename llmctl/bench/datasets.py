"""The prompts `llmctl bench serve` sends: random, a JSONL file, or groups sharing a long prefix.

Each request carries its prompt text, the prompt length the client believes it has (exact when a
tokenizer is given, else the number of words: common English words are about one token each in
the usual BPE vocabularies) and the number of output tokens to ask for (`max_tokens`).

Random lengths follow vLLM's symmetric definition: uniform integers in
[floor(L x (1 - r)), ceil(L x (1 + r))] with 0 <= r < 1 (output lengths at least 1).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Optional, Protocol

import numpy as np

from llmctl.errors import UserError

# Short, frequent English words: with their leading space these are almost all single tokens in
# large BPE vocabularies (GPT-2, Llama 3, Qwen), so N words make a prompt of roughly N tokens.
WORDS = (
    "the of and to in is that it was for on are as with his they at be this from have or by one had not "
    "but what all were when we there can an your which their said if do will each about how up out them "
    "then she many some so these would other into has more her two like him see time could no make than "
    "first been its who now people my made over did down only way find use may water long little very "
    "after words called just where most know get through back much before go good new write our used me "
    "man too any day same right look think also around another came come work three word must because "
    "does part even place well such here take why things help put years different away again off went "
    "old number great tell men say small every found still between name should home big give air line "
    "set own under read last never us left end along while might next sound below saw something thought "
    "both few those always looked show large often together asked house world going want school important "
    "until form food keep children feet land side without boy once animals life enough took sometimes four "
    "head above kind began almost live page got earth need far hand high year mother light parts country "
    "father let night following picture being study second eyes soon times story boys since white days ever "
    "paper hard near sentence better best across during today others however sure means knew whole"
).split()


@dataclass(frozen=True)
class BenchRequest:
    prompt: str
    prompt_len: int
    output_len: int
    group: Optional[int] = None  # shared-prefix group, None for other datasets
    messages: Optional[tuple[dict, ...]] = None  # chat history sent as is (messages / conversation datasets)
    arrival_s: Optional[float] = None  # send time from a trace, seconds after the start


@dataclass(frozen=True)
class Conversation:
    """A multi-turn conversation replayed turn by turn: each turn's request carries the history so
    far, with the server's own earlier answers. Each turn is a BenchRequest holding the user message."""

    turns: tuple[BenchRequest, ...]
    system: Optional[str] = None


class TextTokenizer(Protocol):
    vocab_size: int

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str: ...


def validate_range_ratio(range_ratio: float) -> None:
    if not 0.0 <= range_ratio < 1.0:
        raise UserError(f"--random-range-ratio must be in [0, 1), got {range_ratio}")


def sample_lengths(rng: np.random.Generator, count: int, length: int, range_ratio: float,
                   minimum: int = 1) -> list[int]:
    """`count` integers uniform in [floor(length(1-r)), ceil(length(1+r))], never below `minimum`."""
    validate_range_ratio(range_ratio)
    low = max(minimum, math.floor(length * (1 - range_ratio)))
    high = max(low, math.ceil(length * (1 + range_ratio)))
    return rng.integers(low, high + 1, size=count).tolist()


def count_tokens(text: str, tokenizer: Optional[TextTokenizer]) -> int:
    if tokenizer is not None:
        return len(tokenizer.encode(text, add_special_tokens=False))
    return len(text.split())


def random_text(rng: np.random.Generator, length: int, tokenizer: Optional[TextTokenizer]) -> str:
    """Text of about `length` tokens: random token ids decoded when a tokenizer is given, else words."""
    if tokenizer is None:
        return " ".join(rng.choice(WORDS, size=length).tolist())
    ids = rng.integers(0, tokenizer.vocab_size, size=length).tolist()
    text = tokenizer.decode(ids)
    # Decoding then re-encoding random ids merges or splits tokens; trim or top up until the text
    # re-encodes to the asked length (as vLLM's random dataset does), keeping the closest attempt.
    best_text, best_gap = text, math.inf
    for _ in range(8):
        ids = tokenizer.encode(text, add_special_tokens=False)
        if abs(len(ids) - length) < best_gap:
            best_text, best_gap = text, abs(len(ids) - length)
        if best_gap == 0:
            break
        if len(ids) > length:
            ids = ids[:length]
        else:
            ids = ids + rng.integers(0, tokenizer.vocab_size, size=length - len(ids)).tolist()
        # A cut inside a multi-byte character decodes to U+FFFD, which re-encodes longer: drop it.
        text = tokenizer.decode(ids).rstrip("\ufffd")
    return best_text


def fit_lengths(input_len: int, output_len: int, range_ratio: float, context: int,
                prefix_len: int = 0) -> tuple[int, int, int]:
    """(input_len, output_len, prefix_len) whose longest request fits in `context` tokens.

    Unchanged when they fit. Otherwise the output lengths stay when their longest takes at most half
    the context (decode is what a serving benchmark measures), else they shrink to that half; the
    prompt (shared prefix and random part in proportion) gets the rest.
    """
    def longest(n: int) -> int:
        return math.ceil(n * (1 + range_ratio))

    if prefix_len + longest(input_len) + longest(output_len) <= context:
        return input_len, output_len, prefix_len
    if context < 3 + (prefix_len > 0):
        raise UserError(f"the server's context of {context} tokens is too small for a benchmark request")
    if longest(output_len) > context // 2:
        output_len = max(1, math.floor(context // 2 / (1 + range_ratio)))
    budget = context - longest(output_len)
    scale = min(1.0, budget / (prefix_len + longest(input_len)))
    prefix_len = max(1, math.floor(prefix_len * scale)) if prefix_len else 0
    input_len = max(1, math.floor(input_len * scale))
    while prefix_len + longest(input_len) > budget and input_len > 1:
        input_len -= 1
    return input_len, output_len, prefix_len


def fit_requests(requests: list[BenchRequest], context: int) -> tuple[list[BenchRequest], int, int]:
    """Cap each request's output so prompt + output fit in `context` tokens.

    Returns the requests, how many were capped, and how many have a prompt that alone fills the
    context (they are sent as they are; the server refuses them and they count as failed)."""
    fitted, capped, too_long = [], 0, 0
    for request in requests:
        room = context - request.prompt_len
        if room < 1:
            too_long += 1
        elif request.output_len > room:
            request, capped = replace(request, output_len=room), capped + 1
        fitted.append(request)
    return fitted, capped, too_long


def added_tokens(tokenizer: TextTokenizer, chat: bool) -> int:
    """Tokens a server adds around a prompt: special tokens (completions) or the chat template (chat)."""
    probe = "hello"
    bare = len(tokenizer.encode(probe, add_special_tokens=False))
    if chat and hasattr(tokenizer, "encode_chat"):
        try:
            return len(tokenizer.encode_chat([{"role": "user", "content": probe}])) - bare
        except Exception:  # noqa: BLE001 - no chat template: the server would refuse chat anyway
            return 0
    return len(tokenizer.encode(probe)) - bare


def random_requests(num: int, input_len: int, output_len: int, range_ratio: float,
                    rng: np.random.Generator, tokenizer: Optional[TextTokenizer] = None) -> list[BenchRequest]:
    input_lens = sample_lengths(rng, num, input_len, range_ratio)
    output_lens = sample_lengths(rng, num, output_len, range_ratio)
    requests = []
    for in_len, out_len in zip(input_lens, output_lens):
        prompt = random_text(rng, in_len, tokenizer)
        requests.append(BenchRequest(prompt, count_tokens(prompt, tokenizer), out_len))
    return requests


def shared_prefix_requests(num: int, num_prefixes: int, prefix_len: int, input_len: int, output_len: int,
                           range_ratio: float, rng: np.random.Generator,
                           tokenizer: Optional[TextTokenizer] = None) -> list[BenchRequest]:
    """`num_prefixes` groups whose prompts start with the same `prefix_len`-token text, in shuffled order.

    The suffix after the prefix is random with `input_len` (and the range ratio); a blank line
    separates them so the prefix tokenizes identically in every prompt of its group.
    """
    if num_prefixes < 1 or num_prefixes > num:
        raise UserError(f"--num-prefixes must be between 1 and --num-prompts ({num}), got {num_prefixes}")
    if prefix_len < 1:
        raise UserError(f"--prefix-len must be >= 1, got {prefix_len}")
    prefixes = [random_text(rng, prefix_len, tokenizer) for _ in range(num_prefixes)]
    suffix_lens = sample_lengths(rng, num, input_len, range_ratio)
    output_lens = sample_lengths(rng, num, output_len, range_ratio)
    requests = []
    for index, (suffix_len, out_len) in enumerate(zip(suffix_lens, output_lens)):
        group = index % num_prefixes
        prompt = prefixes[group] + "\n\n" + random_text(rng, suffix_len, tokenizer)
        requests.append(BenchRequest(prompt, count_tokens(prompt, tokenizer), out_len, group))
    order = rng.permutation(num).tolist()
    return [requests[i] for i in order]


def file_requests(path: Path, num: int, default_output_len: int,
                  tokenizer: Optional[TextTokenizer] = None) -> list[BenchRequest]:
    """The first `num` prompts of a JSONL file (cycled when it holds fewer)."""
    loaded = _read_jsonl(path, default_output_len, tokenizer)
    return [loaded[i % len(loaded)] for i in range(num)]


def _read_jsonl(path: Path, default_output_len: int, tokenizer: Optional[TextTokenizer]) -> list[BenchRequest]:
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except OSError as exc:
        raise UserError(f"cannot read --dataset-path {path}: {exc.strerror or exc}") from None
    except UnicodeDecodeError:
        raise UserError(f"--dataset-path {path} is not UTF-8 text") from None
    requests = []
    for number, line in enumerate(lines, start=1):
        if line.strip():
            requests.append(_parse_line(line, f"{path}:{number}", default_output_len, tokenizer))
    if not requests:
        raise UserError(f"--dataset-path {path} holds no prompts (expected JSON lines with a 'prompt')")
    return requests


def _parse_line(line: str, where: str, default_output_len: int, tokenizer: Optional[TextTokenizer]) -> BenchRequest:
    try:
        item = json.loads(line)
    except json.JSONDecodeError as exc:
        raise UserError(f"{where}: not valid JSON ({exc.msg})") from None
    if not isinstance(item, dict) or not isinstance(item.get("prompt"), str) or not item["prompt"]:
        raise UserError(f"{where}: expected an object with a non-empty string 'prompt'")
    output_len = item.get("output_len", item.get("max_tokens", default_output_len))
    if isinstance(output_len, bool) or not isinstance(output_len, int) or output_len < 1:
        raise UserError(f"{where}: output_len/max_tokens must be an integer >= 1, got {output_len!r}")
    return BenchRequest(item["prompt"], count_tokens(item["prompt"], tokenizer), output_len)
