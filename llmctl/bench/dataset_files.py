"""Real workloads for `llmctl bench serve`: ShareGPT conversations, chat `messages` JSONL, multi-turn
conversations replayed turn by turn, and timed traces (mooncake's JSONL).

- ShareGPT: a JSON list (or JSONL) of {"conversations": [{"from": "human"|"gpt"|"system", "value": ...}]};
  the first human turn is the prompt and the reply after it sets the output length (as vLLM does).
- messages: JSONL of {"messages": [{"role", "content"}...], optional "max_tokens"/"output_len"},
  sent as is to /v1/chat/completions.
- conversation: either format above; every user turn is sent in order, after the history so far
  with the server's real earlier answers; a recorded assistant turn sets that turn's output length.
- trace: JSONL of {"timestamp": ms, "input_length", "output_length", optional "hash_ids"}; requests go
  out at their timestamps (relative to the first) and prompts sharing a hash id share that block of
  TRACE_BLOCK_TOKENS tokens, so the trace's prefix reuse reaches the server's cache.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional

import numpy as np

from llmctl.bench.datasets import WORDS, BenchRequest, Conversation, TextTokenizer, count_tokens
from llmctl.errors import UserError

TRACE_BLOCK_TOKENS = 512  # mooncake traces hash prompts in blocks of 512 tokens
_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "chatgpt": "assistant",
          "bard": "assistant", "model": "assistant", "system": "system"}


def read_records(path: Path) -> list[tuple[str, Any]]:
    """(where, item) for each record of a JSON list, {"data": [...]} or JSON lines file."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise UserError(f"cannot read --dataset-path {path}: {exc.strerror or exc}") from None
    except UnicodeDecodeError:
        raise UserError(f"--dataset-path {path} is not UTF-8 text") from None
    try:
        whole = json.loads(text)
    except json.JSONDecodeError:
        whole = None
    if isinstance(whole, dict) and isinstance(whole.get("data"), list):
        whole = whole["data"]
    if isinstance(whole, list):
        return [(f"{path}[{index}]", item) for index, item in enumerate(whole)]
    records = []
    for number, line in enumerate(text.splitlines(), start=1):
        if line.strip():
            try:
                records.append((f"{path}:{number}", json.loads(line)))
            except json.JSONDecodeError as exc:
                raise UserError(f"{path}:{number}: not valid JSON ({exc.msg})") from None
    return records


def _chat_messages(where: str, item: Any) -> list[dict[str, str]]:
    """The record's turns as OpenAI messages, from `messages` (role/content) or ShareGPT `conversations`."""
    if isinstance(item, dict) and isinstance(item.get("messages"), list):
        raw, role_key, text_key = item["messages"], "role", "content"
    elif isinstance(item, dict) and isinstance(item.get("conversations"), list):
        raw, role_key, text_key = item["conversations"], "from", "value"
    else:
        raise UserError(f"{where}: expected an object with a 'messages' or 'conversations' list")
    messages = []
    for turn in raw:
        role = _ROLES.get(str(turn.get(role_key, "")).lower()) if isinstance(turn, dict) else None
        text = turn.get(text_key) if isinstance(turn, dict) else None
        if role is None or not isinstance(text, str):
            raise UserError(f"{where}: each turn needs a known {role_key!r} and a string {text_key!r}, got {turn!r:.80}")
        messages.append({"role": role, "content": text})
    return messages


def _output_len(where: str, item: dict, default: int) -> int:
    value = item.get("output_len", item.get("max_tokens", default))
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise UserError(f"{where}: output_len/max_tokens must be an integer >= 1, got {value!r}")
    return value


def _cycled(items: list, num: int, path: Path, what: str) -> list:
    if not items:
        raise UserError(f"--dataset-path {path} holds no {what}")
    return [items[i % len(items)] for i in range(num)]


def sharegpt_requests(path: Path, num: int, tokenizer: Optional[TextTokenizer]) -> list[BenchRequest]:
    """First human turn -> prompt, the reply's length -> output length; records without both are skipped."""
    requests = []
    for where, item in read_records(path):
        messages = _chat_messages(where, item)
        for index, message in enumerate(messages[:-1]):
            reply = messages[index + 1]
            if message["role"] == "user" and reply["role"] == "assistant" and message["content"]:
                output_len = max(1, count_tokens(reply["content"], tokenizer))
                requests.append(BenchRequest(message["content"], count_tokens(message["content"], tokenizer), output_len))
                break
    return _cycled(requests, num, path, "human turn followed by a reply")


def messages_requests(path: Path, num: int, default_output_len: int,
                      tokenizer: Optional[TextTokenizer]) -> list[BenchRequest]:
    requests = []
    for where, item in read_records(path):
        messages = _chat_messages(where, item)
        if not messages:
            raise UserError(f"{where}: 'messages' is empty")
        text = "\n".join(message["content"] for message in messages)
        requests.append(BenchRequest(text, count_tokens(text, tokenizer), _output_len(where, item, default_output_len),
                                     messages=tuple(messages)))
    return _cycled(requests, num, path, "messages")


def conversations(path: Path, num: int, default_output_len: int,
                  tokenizer: Optional[TextTokenizer]) -> list[Conversation]:
    """Each record's user turns, in order; the recorded assistant turn after one sets its output length."""
    found = []
    for where, item in read_records(path):
        messages = _chat_messages(where, item)
        system = next((m["content"] for m in messages if m["role"] == "system"), None)
        turns = []
        for index, message in enumerate(messages):
            if message["role"] != "user":
                continue
            reply = messages[index + 1] if index + 1 < len(messages) else None
            output_len = (max(1, count_tokens(reply["content"], tokenizer))
                          if reply and reply["role"] == "assistant" else default_output_len)
            turns.append(BenchRequest(message["content"], count_tokens(message["content"], tokenizer), output_len))
        if turns:
            found.append(Conversation(tuple(turns), system))
    return _cycled(found, num, path, "conversation with a user turn")


def trace_requests(path: Path, num: int, seed: int, tokenizer: Optional[TextTokenizer]) -> list[BenchRequest]:
    """The first `num` trace records (not cycled: a trace's times are its point), sent at their timestamps."""
    records = read_records(path)[:num]
    if not records:
        raise UserError(f"--dataset-path {path} holds no trace records")
    blocks: dict[int, list[int]] = {}
    first_ms = None
    requests = []
    for where, item in records:
        timestamp, input_len, output_len, hash_ids = _trace_fields(where, item)
        first_ms = timestamp if first_ms is None else first_ms
        units = _trace_units(hash_ids, input_len, blocks, np.random.default_rng([seed, 2, len(requests)]),
                             seed, tokenizer)
        prompt = tokenizer.decode(units) if tokenizer is not None else " ".join(WORDS[u] for u in units)
        requests.append(BenchRequest(prompt, count_tokens(prompt, tokenizer), output_len,
                                     arrival_s=(timestamp - first_ms) / 1000.0))
    return requests


def _trace_fields(where: str, item: Any) -> tuple[float, int, int, list[int]]:
    if not isinstance(item, dict):
        raise UserError(f"{where}: expected an object with timestamp, input_length, output_length")
    timestamp, hash_ids = item.get("timestamp"), item.get("hash_ids", [])
    if isinstance(timestamp, bool) or not isinstance(timestamp, (int, float)) or timestamp < 0:
        raise UserError(f"{where}: 'timestamp' must be a number of milliseconds >= 0, got {timestamp!r}")
    lengths = [item.get(key) for key in ("input_length", "output_length")]
    if any(isinstance(v, bool) or not isinstance(v, int) or v < 1 for v in lengths):
        raise UserError(f"{where}: input_length and output_length must be integers >= 1, got {lengths}")
    if not isinstance(hash_ids, list) or any(isinstance(h, bool) or not isinstance(h, int) or h < 0 for h in hash_ids):
        raise UserError(f"{where}: 'hash_ids' must be a list of integers >= 0")
    return float(timestamp), lengths[0], lengths[1], hash_ids


def _trace_units(hash_ids: list[int], input_len: int, blocks: dict[int, list[int]], rng: np.random.Generator,
                 seed: int, tokenizer: Optional[TextTokenizer]) -> list[int]:
    """Token ids (or word indices without a tokenizer): one fixed random block per hash id, then fresh ones."""
    vocab = tokenizer.vocab_size if tokenizer is not None else len(WORDS)
    units: list[int] = []
    for hash_id in hash_ids:
        if len(units) >= input_len:
            break
        if hash_id not in blocks:
            block_rng = np.random.default_rng([seed, 3, hash_id])
            blocks[hash_id] = block_rng.integers(0, vocab, size=TRACE_BLOCK_TOKENS).tolist()
        units.extend(blocks[hash_id])
    if len(units) < input_len:
        units.extend(rng.integers(0, vocab, size=input_len - len(units)).tolist())
    return units[:input_len]
