"""Pattern filters on the text a server takes in and gives out (`--input-filter`, `--output-filter`).

These are pattern filters, not a safety model: they find what their rules spell out (regular
expressions and word lists), nothing else. A rule file is YAML (docs/serve.md):

    rules:
      - name: email                       # named in errors, /metrics and the audit log
        pattern: '[\\w.+-]{1,64}@[\\w-]{1,63}\\.[a-z]{2,10}'
        action: redact                    # output rules: redact (default replacement "[redacted]") or block
        replacement: "[email]"
      - name: codename
        words: [Nightingale, Blue Heron]  # literal, whole words, case-insensitive unless ignore_case: false
        action: block

Output text is filtered as it streams (`StreamFilter`: text deltas in, text out). A match can
straddle deltas, so the filter holds back as many characters as the longest rule can span, and
no more: every rule must be bounded (`.*`, `+` and `{n,}` are refused when the file is loaded),
at most `MAX_SPAN` characters, and free of anchors and look-arounds (a stream has no known end,
and what was already sent cannot be looked at again). `\\b` is allowed: the filter keeps one
character on either side for it. The same transformer filters whole (non-streamed) texts, so both
give the same result.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Optional

from llmctl.server.policy_files import PolicyFileError, read_entries

# Characters a stream may be held back: bounds the added latency (a few tokens' worth per rule).
MAX_SPAN = 256
ACTIONS = ("redact", "block")
DEFAULT_REPLACEMENT = "[redacted]"
CONTENT_FILTER = "content_filter"  # OpenAI's finish_reason for a completion a filter stopped
_RULE_FIELDS = {"name", "pattern", "words", "action", "replacement", "ignore_case"}


class FilterFileError(PolicyFileError):
    """A rule file cannot be used; the message names the file, the rule and what to fix."""


@dataclass(frozen=True)
class Rule:
    name: str
    regex: re.Pattern
    span: int  # the longest text a match can cover
    action: str = "block"
    replacement: str = DEFAULT_REPLACEMENT


@dataclass(frozen=True)
class RuleSet:
    rules: tuple[Rule, ...]

    @property
    def holdback(self) -> int:
        """Characters a stream keeps back: a match starting before them is complete (and `\\b` after
        it has its character)."""
        return max(rule.span for rule in self.rules)

    def first_match(self, text: str, pos: int) -> Optional[tuple[Rule, re.Match]]:
        """The earliest match at or after `pos` (text before `pos` is context for `\\b`); at the same
        position the rule listed first wins."""
        best: Optional[tuple[Rule, re.Match]] = None
        for rule in self.rules:
            match = rule.regex.search(text, pos)
            if match is not None and (best is None or match.start() < best[1].start()):
                best = (rule, match)
        return best

    def find(self, text: str) -> Optional[Rule]:
        hit = self.first_match(text, 0)
        return hit[0] if hit is not None else None


# ---- the stream transformer --------------------------------------------------------------------------
class StreamFilter:
    """One text stream through a rule set: `feed(delta)` returns the text that may be shown now;
    `feed(delta, final=True)` releases the rest. After a block rule matched, `blocked_by` names it
    and nothing more is released (the text before the match was)."""

    def __init__(self, rules: RuleSet):
        self._rules = rules
        self._pending = ""  # text received and not yet released
        self._before = ""  # the released character before it (context for \b)
        self.redactions: Counter[str] = Counter()
        self.blocked_by: Optional[str] = None

    def feed(self, delta: str, *, final: bool = False) -> str:
        if self.blocked_by is not None:
            return ""
        self._pending += delta
        out: list[str] = []
        while True:
            safe = len(self._pending) if final else len(self._pending) - self._rules.holdback
            if safe <= 0:
                return "".join(out)
            hit = self._rules.first_match(self._before + self._pending, len(self._before))
            start = hit[1].start() - len(self._before) if hit is not None else safe
            if hit is None or start >= safe:  # nothing starts in the part that can be released
                out.append(self._release(safe))
                return "".join(out)
            rule, match = hit
            end = match.end() - len(self._before)
            out.append(self._pending[:start])
            if rule.action == "block":
                self.blocked_by, self._pending = rule.name, ""
                return "".join(out)
            out.append(rule.replacement)
            self.redactions[rule.name] += 1
            self._before, self._pending = self._pending[end - 1:end], self._pending[end:]

    def _release(self, upto: int) -> str:
        released = self._pending[:upto]
        if released:
            self._before, self._pending = released[-1], self._pending[upto:]
        return released


# ---- rule files ----------------------------------------------------------------------------------------
def load_rules(path: Path, flag: str, *, with_actions: bool) -> RuleSet:
    """Read and check a rule file; `with_actions`: output rules (redact/block), else input rules
    (a match refuses the request, so an `action` is an error)."""
    return RuleSet(tuple(read_entries(path, flag, "rules", lambda entry, where: _parse_rule(entry, where, with_actions),
                                      FilterFileError)))


def _parse_rule(entry: Any, where: str, with_actions: bool) -> Rule:
    if not isinstance(entry, dict):
        raise FilterFileError(f"{where} must be a mapping")
    allowed = _RULE_FIELDS if with_actions else _RULE_FIELDS - {"action", "replacement"}
    unknown = sorted(set(map(str, entry)) - allowed)
    if unknown:
        hint = " (input rules refuse the request: they take no action)" if not with_actions else ""
        raise FilterFileError(f"{where}: unknown field(s) {', '.join(unknown)}{hint}; fields are "
                              f"{', '.join(sorted(allowed))}")
    name = entry.get("name")
    if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}", name):
        raise FilterFileError(f"{where}: 'name' must be 1-64 letters, digits or ._- (it names the rule in "
                              "errors, /metrics and the audit log)")
    where = f"{where} ({name})"
    ignore_case = entry.get("ignore_case", "words" in entry)
    if not isinstance(ignore_case, bool):
        raise FilterFileError(f"{where}: 'ignore_case' must be true or false")
    source = _source(entry, where)
    regex = _compile(source, re.IGNORECASE if ignore_case else 0, where)
    action = entry.get("action", "block") if with_actions else "block"
    if action not in ACTIONS:
        raise FilterFileError(f"{where}: 'action' must be redact or block, got {action!r}")
    replacement = entry.get("replacement", DEFAULT_REPLACEMENT)
    if not isinstance(replacement, str) or (action == "block" and "replacement" in entry):
        raise FilterFileError(f"{where}: 'replacement' is a string, and only for action: redact")
    return Rule(name, regex, _span(source, regex.flags, where), action, replacement)


def _source(entry: dict, where: str) -> str:
    pattern, words = entry.get("pattern"), entry.get("words")
    if (pattern is None) == (words is None):
        raise FilterFileError(f"{where}: give exactly one of 'pattern' (a regular expression) or 'words' (a list)")
    if pattern is not None:
        if not isinstance(pattern, str) or not pattern:
            raise FilterFileError(f"{where}: 'pattern' must be a non-empty string")
        return pattern
    if not isinstance(words, list) or not words or not all(isinstance(w, str) and w.strip() for w in words):
        raise FilterFileError(f"{where}: 'words' must be a non-empty list of non-empty strings")
    # Longest first: at one position the longer word wins ("Blue Heron" over "Blue"). Whole words:
    # \b on each side that is a word character ("C++" ends in none).
    return "|".join(_whole_word(w.strip()) for w in sorted(words, key=lambda w: len(w.strip()), reverse=True))


def _whole_word(word: str) -> str:
    left = r"\b" if re.match(r"\w", word[0]) else ""
    right = r"\b" if re.match(r"\w", word[-1]) else ""
    return f"{left}{re.escape(word)}{right}"


def _compile(source: str, flags: int, where: str) -> re.Pattern:
    try:
        return re.compile(source, flags)
    except re.error as exc:
        raise FilterFileError(f"{where}: the pattern is not a valid regular expression: {exc}") from None


def _span(source: str, flags: int, where: str) -> int:
    """The longest text the pattern can match; refuses what a stream cannot be filtered by."""
    parser, _ = _re_internals()
    tree = parser.parse(source, flags)
    low, high = tree.getwidth()
    if high > MAX_SPAN:
        unbounded = high >= parser.MAXREPEAT
        why = ("is unbounded (*, + or {n,})" if unbounded else f"can span {high} characters")
        raise FilterFileError(f"{where}: the pattern {why}; a stream is held back by the longest match a rule "
                              f"can cover, so bound every repeat (e.g. {{1,40}} instead of +) to at most "
                              f"{MAX_SPAN} characters in all")
    if low == 0:
        raise FilterFileError(f"{where}: the pattern can match empty text; every match must cover a character")
    bad = _unstreamable(tree, parser)
    if bad:
        raise FilterFileError(f"{where}: the pattern uses {bad}, which a stream cannot honour (its end is not "
                              "known and sent text cannot be looked at again); \\b is allowed")
    return high


def _re_internals() -> tuple[Any, Any]:
    """The re module's own parser and opcodes (widths exactly as it matches): `re._parser` since
    Python 3.11, `sre_parse` before."""
    try:
        import re._constants as constants
        import re._parser as parser
    except ImportError:  # Python 3.10
        import sre_constants as constants  # type: ignore[no-redef]
        import sre_parse as parser  # type: ignore[no-redef]
    return parser, constants


def _unstreamable(node: Any, parser: Any) -> Optional[str]:
    """The first construct in the parsed pattern a stream cannot honour, or None."""
    _, c = _re_internals()
    if isinstance(node, parser.SubPattern):
        for op, arg in node:
            if op is c.AT and arg not in (c.AT_BOUNDARY, c.AT_NON_BOUNDARY):
                return "an anchor (^, $, \\A or \\Z)"
            if op in (c.ASSERT, c.ASSERT_NOT):
                return "a look-ahead or look-behind"
            if (found := _unstreamable(arg, parser)) is not None:
                return found
    elif isinstance(node, (list, tuple)):
        return next((found for item in node if (found := _unstreamable(item, parser)) is not None), None)
    return None


# ---- the server side: input checks, and the hook on engine outputs -----------------------------------
@dataclass
class FilterCounters:
    """Prometheus counters of both filters, on the server's registry."""
    redactions: Any
    blocks: Any
    refusals: Any
    model_name: str

    @classmethod
    def on(cls, registry: Any, model_name: str) -> "FilterCounters":
        from prometheus_client import Counter as PromCounter

        labels = ["model_name", "rule"]
        return cls(PromCounter("llmctl:output_filter_redactions", "Matches an --output-filter redact rule "
                               "replaced.", labels, registry=registry),
                   PromCounter("llmctl:output_filter_blocks", "Completions an --output-filter block rule ended "
                               "(finish_reason content_filter).", labels, registry=registry),
                   PromCounter("llmctl:input_filter_refusals", "Requests an --input-filter rule refused (400).",
                               labels, registry=registry),
                   model_name)


class OutputFilter:
    """`--output-filter`: the rules and their counters; `for_request` makes one request's state."""

    def __init__(self, rules: RuleSet, counters: FilterCounters):
        self.rules = rules
        self.counters = counters

    def for_request(self, audit: dict[str, Any], *, choices: int, cumulative: bool = True) -> "RequestFilter":
        """`choices`: completions per prompt (`n`); `cumulative`: each output holds all the text so
        far (else only what is new since the previous one, vLLM's DELTA / FINAL_ONLY outputs)."""
        return RequestFilter(self, audit, choices, cumulative)


@dataclass
class _Choice:
    stream: StreamFilter
    seen: int = 0  # characters of the engine's cumulative text fed so far
    shown: str = ""  # the filtered text so far
    counted: Counter = field(default_factory=Counter)


class RequestFilter:
    """One request's outputs through the filter: `apply` turns each engine output of prompt `index`
    into the same output with filtered text, cumulative or new as the engine's was. A choice a
    block rule stopped ends with finish_reason `content_filter` (later deltas of it are dropped);
    once every choice of a prompt ended, `cancel` aborts its engine request (its KV blocks are
    freed) and the output is final."""

    def __init__(self, owner: OutputFilter, audit: dict[str, Any], choices: int, cumulative: bool):
        self._owner = owner
        self._audit = audit
        self._per_prompt = choices
        self._cumulative = cumulative
        self._choices: dict[tuple[int, int], _Choice] = {}
        self._ended: set[tuple[int, int]] = set()

    def apply(self, index: int, output: Any, cancel: Callable[[], None]) -> Any:
        completions = [c for c in (self._filtered(index, completion) for completion in output.outputs) if c is not None]
        ended = sum(1 for p_index, _ in self._ended if p_index == index)
        finished = output.finished or ended == self._per_prompt
        if finished and not output.finished:
            cancel()
        return replace(output, outputs=completions, finished=finished)

    def _filtered(self, index: int, completion: Any) -> Any:
        """The completion with filtered text; None for a delta of a choice a block rule ended."""
        key = (index, completion.index)
        choice = self._choices.get(key)
        if choice is None:
            choice = self._choices[key] = _Choice(StreamFilter(self._owner.rules))
        released = ""
        if choice.stream.blocked_by is None:
            delta = completion.text[choice.seen:] if self._cumulative else completion.text
            choice.seen += len(delta)
            released = choice.stream.feed(delta, final=completion.finish_reason is not None)
            choice.shown += released
            self._count(choice)
        elif not self._cumulative:
            return None
        text = choice.shown if self._cumulative else released
        if choice.stream.blocked_by is not None:
            self._ended.add(key)
            return replace(completion, text=text, finish_reason=CONTENT_FILTER, stop_reason=None)
        if completion.finish_reason is not None:
            self._ended.add(key)
        return replace(completion, text=text)

    def _count(self, choice: _Choice) -> None:
        counters, model = self._owner.counters, self._owner.counters.model_name
        for rule, total in choice.stream.redactions.items():
            if total > choice.counted[rule]:
                counters.redactions.labels(model, rule).inc(total - choice.counted[rule])
                redacted = self._audit.setdefault("output_filter_redactions", {})
                redacted[rule] = redacted.get(rule, 0) + total - choice.counted[rule]
                choice.counted[rule] = total
        if choice.stream.blocked_by is not None:
            counters.blocks.labels(model, choice.stream.blocked_by).inc()
            self._audit.setdefault("output_filter_blocked", []).append(choice.stream.blocked_by)
