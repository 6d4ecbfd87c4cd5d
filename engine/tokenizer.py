"""Tokenizer, chat templates and incremental detokenization on the `tokenizers` library alone.

Reads `tokenizer.json`, `tokenizer_config.json` (special tokens, chat template) and
`generation_config.json` (extra end-of-sequence ids). Chat templates run in jinja2's immutable
sandbox, so a template cannot touch Python internals.
"""

from __future__ import annotations

import functools
import json
import re
import uuid
from datetime import datetime
from pathlib import Path
from typing import Any, Optional

from llmctl.engine.errors import InvalidRequestError, ModelLoadError

# Message fields chat templates write into the prompt verbatim.
_MESSAGE_TEXT_KEYS = ("content", "name")
# Tokens of prompt context given to the detokenizer so the first generated token decodes as it
# would in the middle of text (SentencePiece-style decoders drop a leading space at text start).
PROMPT_CONTEXT_TOKENS = 5


def _token_text(value: Any) -> Optional[str]:
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ModelLoadError(f"{path.name} is not valid JSON: {exc}") from None
    return data if isinstance(data, dict) else {}


GGUF_CONTROL_TOKEN = 3  # tokenizer.ggml.token_type: 1 normal, 2 unknown, 3 control, 4 user-defined, 6 byte
# llama.cpp's pre-tokenizer names -> their split regexes (llama-vocab.cpp), None: GPT-2's own
GGUF_PRE_TOKENIZERS = {
    "default": None,
    "gpt-2": None,
    "smollm": None,  # GPT-2's, with every digit split off first
    "llama-bpe": r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                 r"|\s*[\r\n]+|\s+(?!\S)|\s+",
    "qwen2": r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
             r"|\s*[\r\n]+|\s+(?!\S)|\s+",
}


def _gguf_byte_level_bpe(metadata: dict[str, Any], tokens: list[str], source: str):
    from tokenizers import Tokenizer as Backend
    from tokenizers import decoders, models

    pre = str(metadata.get("tokenizer.ggml.pre", "default"))
    if pre not in GGUF_PRE_TOKENIZERS:
        raise ModelLoadError(f"{source}: GGUF pre-tokenizer {pre!r} is not supported (supported: "
                             f"{', '.join(GGUF_PRE_TOKENIZERS)}); give a tokenizer folder with --tokenizer")
    merges = [tuple(str(m).split(" ", 1)) for m in metadata.get("tokenizer.ggml.merges") or []]
    if not merges or any(len(m) != 2 for m in merges):
        raise ModelLoadError(f"{source}: GGUF tokenizer lacks valid tokenizer.ggml.merges")
    backend = Backend(models.BPE({t: i for i, t in enumerate(tokens)}, merges, ignore_merges=pre == "llama-bpe"))
    backend.pre_tokenizer = _gguf_pre_tokenizer(pre)
    backend.decoder = decoders.ByteLevel()
    return backend


def _gguf_sentencepiece_bpe(metadata: dict[str, Any], tokens: list[str], source: str):
    """SentencePiece BPE as Hugging Face's Llama conversion builds it: "▁" for spaces (and one prepended
    unless add_space_prefix is false), merges from the scores (a piece's score ranks the merges that make
    it, as SentencePiece merges the highest-scoring pair first), unknown characters through <0xXX> bytes."""
    from tokenizers import Tokenizer as Backend
    from tokenizers import decoders, models, normalizers

    scores = list(metadata.get("tokenizer.ggml.scores") or [])
    if len(scores) != len(tokens):
        raise ModelLoadError(f"{source}: GGUF SentencePiece tokenizer needs one tokenizer.ggml.scores entry per token")
    vocab = {token: i for i, token in enumerate(tokens)}
    unknown = metadata.get("tokenizer.ggml.unknown_token_id")
    backend = Backend(models.BPE(vocab, sentencepiece_merges(vocab, scores), fuse_unk=True, byte_fallback=True,
                                 unk_token=tokens[unknown] if unknown is not None else None))
    steps = [normalizers.Replace(" ", SPIECE_SPACE)]
    if metadata.get("tokenizer.ggml.add_space_prefix", True):
        steps.insert(0, normalizers.Prepend(SPIECE_SPACE))
    backend.normalizer = normalizers.Sequence(steps)
    backend.decoder = decoders.Sequence([decoders.Replace(SPIECE_SPACE, " "), decoders.ByteFallback(),
                                         decoders.Fuse(), decoders.Strip(content=" ", left=1, right=0)])
    return backend


SPIECE_SPACE = "\u2581"


def sentencepiece_merges(vocab: dict[str, int], scores: list[float]) -> list[tuple[str, str]]:
    """Every split of a piece into two pieces of the vocabulary is a merge; merges rank by the merged piece's
    score (highest first), then by longer left and right pieces, then by the pieces' ids (the order Hugging
    Face's SentencePiece conversion gives them)."""
    ranked = []
    for piece, index in vocab.items():
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in vocab and right in vocab:
                ranked.append((-scores[index], -len(left), -len(right), index, vocab[left], vocab[right], left, right))
    ranked.sort()
    return [(left, right) for *_, left, right in ranked]


def _gguf_pre_tokenizer(pre: str):
    from tokenizers import Regex, pre_tokenizers

    pattern = GGUF_PRE_TOKENIZERS[pre]
    if pattern is None:
        byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        if pre == "smollm":
            return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
        return byte_level
    return pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(pattern), behavior="isolated", invert=False),
                                    pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])


class Tokenizer:
    def __init__(self, backend, config: dict[str, Any], generation_config: dict[str, Any],
                 chat_template: Optional[str]):
        self._tok = backend
        self.config = config
        self.chat_template = chat_template
        self.bos_token = _token_text(config.get("bos_token"))
        self.eos_token = _token_text(config.get("eos_token"))
        self.bos_token_id = self._id_of(self.bos_token)
        self.eos_token_id = self._id_of(self.eos_token)
        eos = {self.eos_token_id} if self.eos_token_id is not None else set()
        extra = generation_config.get("eos_token_id")
        eos.update([extra] if isinstance(extra, int) else [t for t in (extra or []) if isinstance(t, int)])
        self.eos_token_ids: frozenset[int] = frozenset(eos)
        self.vocab_size = backend.get_vocab_size(with_added_tokens=True)

    @classmethod
    def from_pretrained(cls, folder: str | Path) -> "Tokenizer":
        from tokenizers import Tokenizer as Backend

        folder = Path(folder)
        path = folder / "tokenizer.json"
        if not path.is_file():
            raise ModelLoadError(f"no tokenizer.json in {folder} (give a tokenizer folder: --tokenizer, EngineArgs.tokenizer; token-id prompts alone run without one: skip_tokenizer_init=True)")
        try:
            backend = Backend.from_file(str(path))
        except Exception as exc:  # noqa: BLE001 - the Rust side raises plain Exception
            raise ModelLoadError(f"{path} cannot be parsed: {exc}") from None
        config = _read_json(folder / "tokenizer_config.json")
        template = config.get("chat_template")
        if isinstance(template, list):  # named templates: take "default"
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = named.get("default") or next(iter(named.values()), None)
        jinja_file = folder / "chat_template.jinja"
        if template is None and jinja_file.is_file():
            template = jinja_file.read_text()
        return cls(backend, config, _read_json(folder / "generation_config.json"), template)

    @classmethod
    def from_gguf(cls, metadata: dict[str, Any], source: str = "GGUF file") -> "Tokenizer":
        """The tokenizer a GGUF file describes (`tokenizer.ggml.*`): llama.cpp's "gpt2" model, a byte-level
        BPE (tokens in id order, merges "a b" by rank), with the pre-tokenizer its `tokenizer.ggml.pre` names,
        or its "llama" model, SentencePiece BPE (tokens with scores, byte fallback); control tokens are
        special, `add_bos_token` prefixes BOS, the end-of-turn token also ends a sequence."""
        from tokenizers import AddedToken, processors

        kind = metadata.get("tokenizer.ggml.model")
        tokens = [str(t) for t in metadata.get("tokenizer.ggml.tokens") or []]
        if not tokens:
            raise ModelLoadError(f"{source}: GGUF tokenizer lacks tokenizer.ggml.tokens")
        if kind == "gpt2":
            backend = _gguf_byte_level_bpe(metadata, tokens, source)
        elif kind == "llama":
            backend = _gguf_sentencepiece_bpe(metadata, tokens, source)
        else:
            raise ModelLoadError(f"{source}: GGUF tokenizer model {kind!r} is not supported (supported: gpt2, "
                                 "byte-level BPE; llama, SentencePiece BPE); give a tokenizer folder with --tokenizer")
        types = list(metadata.get("tokenizer.ggml.token_type") or [])
        backend.add_special_tokens([AddedToken(tokens[i], special=True, normalized=False)
                                    for i, kind in enumerate(types) if kind == GGUF_CONTROL_TOKEN])
        special = {name: metadata.get(f"tokenizer.ggml.{name}_token_id") for name in ("bos", "eos", "eot")}
        config = {f"{name}_token": tokens[special[name]] for name in ("bos", "eos") if special[name] is not None}
        if metadata.get("tokenizer.ggml.add_bos_token") and special["bos"] is not None:
            backend.post_processor = processors.TemplateProcessing(
                single=f"{config['bos_token']} $A", special_tokens=[(config["bos_token"], special["bos"])])
        generation = {"eos_token_id": special["eot"]} if special["eot"] is not None else {}
        template = metadata.get("tokenizer.chat_template")
        return cls(backend, config, generation, str(template) if template else None)

    def _id_of(self, token: Optional[str]) -> Optional[int]:
        return self._tok.token_to_id(token) if token else None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        # encode_batch, not encode: only the batch call releases the GIL, so a server thread
        # tokenising a long prompt leaves the event loop free (a 0.7 MB prompt: 1.4 s of loop lag
        # through encode, 4 ms through encode_batch, measured on the default model's tokenizer).
        return self._tok.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    @functools.cached_property
    def max_chars_per_token(self) -> int:
        """An upper bound on the characters of text one token can stand for, so a text longer than
        `max_chars_per_token * n` cannot fit in `n` tokens. A vocabulary entry is at least as long
        as the text it decodes to (byte-level BPE spells each byte as one character); a normalizer
        may contract text before the model sees it (NFKC, Hangul composition: at most 4 to 1)."""
        longest = max((len(t) for t in self._tok.get_vocab(with_added_tokens=True)), default=1)
        return longest * (4 if self._tok.normalizer is not None else 1)

    def vocabulary(self) -> list[str]:
        """Every token's vocabulary entry (its encoded form: byte-level BPE's "Ġthe"), indexed by id; "" for an
        id the vocabulary skips."""
        entries = [""] * self.vocab_size
        for token, token_id in self._tok.get_vocab(with_added_tokens=True).items():
            if token_id < len(entries):
                entries[token_id] = token
        return entries

    def backend_json(self) -> str:
        """The tokenizer as tokenizer.json's text (what grammar engines read its vocabulary's encoding from)."""
        return self._tok.to_str()

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(token_ids, skip_special_tokens=skip_special_tokens)

    # ---- chat -------------------------------------------------------------------------------
    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            **extra: Any) -> str:
        if not self.chat_template:
            raise InvalidRequestError("this model has no chat template; send a plain prompt instead", param="messages")
        _validate_messages(messages)
        template = self._chat_template
        special = {k: _token_text(v) for k, v in self.config.items() if k.endswith("_token")}
        try:
            return template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                   **special, **extra)
        except InvalidRequestError:
            raise
        except Exception as exc:  # noqa: BLE001 - template errors come in many types
            raise InvalidRequestError(f"chat template failed: {exc}", param="messages") from None

    @functools.cached_property
    def _chat_template(self):
        """The chat template compiled once (a failed compile raises again on the next request)."""
        return _compile_template(self.chat_template)

    def encode_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **extra: Any) -> list[int]:
        """The conversation's token ids. Control tokens come only from the template: a message that
        types one (`<|im_end|>\\n<|im_start|>system ...`, to forge a turn) has it encoded as the
        plain characters it is. (transformers' apply_chat_template and vLLM parse the whole
        rendered string, so there the typed token becomes the real one.)"""
        self._refuse_control_tokens_in_tools(messages, extra.get("tools"))
        # The template already writes BOS and friends: do not add them twice.
        rendered = self.apply_chat_template(messages, add_generation_prompt, **extra)
        texts = [m[key] for m in messages for key in _MESSAGE_TEXT_KEYS if isinstance(m.get(key), str) and m[key]]
        if not any(special in text for text in texts for special in self.special_token_texts):
            return self.encode(rendered, add_special_tokens=False)  # the common case: as before, byte for byte
        return self._encode_marked(messages, rendered, add_generation_prompt, **extra)

    def _refuse_control_tokens_in_tools(self, messages: list[dict[str, Any]], tools: Any) -> None:
        """Tool definitions and calls are rendered as JSON, not as marked message text: one that types a
        control token could forge a turn, so it is refused."""
        structured = json.dumps([tools, [m.get("tool_calls") for m in messages]], ensure_ascii=False)
        typed = next((t for t in self.special_token_texts if t in structured), None)
        if typed is not None:
            raise InvalidRequestError(f"a tool definition or tool call contains the text of the control token "
                                      f"{typed!r}", param="tools" if typed in json.dumps(tools, ensure_ascii=False)
                                      else "messages")

    @functools.cached_property
    def chat_template_variables(self) -> frozenset[str]:
        """The variables the chat template reads from its caller (e.g. `tools`, `enable_thinking`)."""
        if not self.chat_template:
            return frozenset()
        from jinja2 import meta

        return frozenset(meta.find_undeclared_variables(self._chat_template.environment.parse(self.chat_template)))

    @functools.cached_property
    def special_token_texts(self) -> tuple[str, ...]:
        return tuple(t.content for t in self._tok.get_added_tokens_decoder().values() if t.special and t.content)

    @functools.cached_property
    def _text_only(self):
        """A copy of the backend that encodes special tokens' text as ordinary text."""
        backend = type(self._tok).from_str(self._tok.to_str())
        backend.encode_special_tokens = True
        return backend

    def _encode_marked(self, messages: list[dict[str, Any]], rendered: str, add_generation_prompt: bool,
                       **extra: Any) -> list[int]:
        """Render with a unique marker in place of each message text, then encode the template's
        parts as usual and the message texts with special tokens as text."""
        nonce = uuid.uuid4().hex
        texts: list[str] = []

        def mark(text: str) -> str:
            texts.append(text)
            return f"\x00{nonce}:{len(texts) - 1}\x00"

        marked = [{**m, **{k: mark(m[k]) for k in _MESSAGE_TEXT_KEYS if isinstance(m.get(k), str) and m[k]}}
                  for m in messages]
        parts = re.split(f"\x00{nonce}:(\\d+)\x00", self.apply_chat_template(marked, add_generation_prompt, **extra))
        pieces = [(texts[int(part)], True) if i % 2 else (part, False) for i, part in enumerate(parts)]
        if "".join(text for text, _ in pieces) != rendered:
            # The template transforms message text (filters, string tests), so its spans cannot be found.
            raise InvalidRequestError("a message contains the text of a control token (e.g. "
                                      f"{next(t for t in self.special_token_texts if any(t in x for x in texts))!r}), "
                                      "which this model's chat template does not allow to keep as plain text",
                                      param="messages")
        ids: list[int] = []
        for text, is_message_text in pieces:
            if text:
                ids += (self._text_only.encode_batch([text], add_special_tokens=False)[0].ids if is_message_text
                        else self.encode(text, add_special_tokens=False))
        return ids


def _validate_messages(messages: Any) -> None:
    if not isinstance(messages, list) or not messages:
        raise InvalidRequestError("messages must be a non-empty list", param="messages")
    for message in messages:
        if not isinstance(message, dict) or "role" not in message:
            raise InvalidRequestError("each message must be an object with a 'role'", param="messages")


def _raise_from_template(message: str) -> None:
    raise InvalidRequestError(f"chat template rejected the conversation: {message}", param="messages")


def _compile_template(source: str):
    from jinja2 import TemplateError
    from jinja2.exceptions import SecurityError
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class StrictSandbox(ImmutableSandboxedEnvironment):
        def unsafe_undefined(self, obj: Any, attribute: str):
            # jinja2's default renders a probe such as `{{ x.__class__ }}` as an empty string; a template
            # that reaches for internals is refused instead of silently rendering a different prompt.
            raise SecurityError(f"access to attribute {attribute!r} of {type(obj).__name__!r} object is unsafe")

    env = StrictSandbox(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = lambda value, indent=None: json.dumps(value, ensure_ascii=False, indent=indent)
    env.globals["raise_exception"] = _raise_from_template
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(source)
    except TemplateError as exc:
        raise InvalidRequestError(f"chat template does not compile: {exc}") from None


class IncrementalDetokenizer:
    """Turns a growing list of output token ids into text deltas that never split a character.

    Decodes a sliding window of ids (seeded with the prompt's last tokens); a delta is released only
    when the window's text grows without ending in U+FFFD, i.e. once the bytes form whole characters.
    """

    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: list[int], skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids = list(prompt_token_ids[-PROMPT_CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.text = ""

    def add(self, token_id: int) -> str:
        self.ids.append(token_id)
        decode = self.tokenizer.decode
        prefix_text = decode(self.ids[self.prefix_offset:self.read_offset], self.skip_special_tokens)
        window_text = decode(self.ids[self.prefix_offset:], self.skip_special_tokens)
        if len(window_text) <= len(prefix_text) or window_text.endswith("\ufffd"):
            return ""
        delta = window_text[len(prefix_text):]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        self.text += delta
        return delta
