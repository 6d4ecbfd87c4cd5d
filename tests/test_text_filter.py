"""The pattern filters' text transformer and rule files (llmctl/server/text_filter.py), without a
server: any split of a text into stream deltas gives what filtering the whole text gives, which is
what `re.sub` over all the rules gives; unbounded or unstreamable rules are refused at load time."""

from __future__ import annotations

import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from llmctl.server.text_filter import FilterFileError, StreamFilter, load_rules

RULES = """
rules:
  - name: number
    pattern: '\\d{3,6}'
    action: redact
    replacement: '#'
  - name: pet
    words: [cat, cat dog, C++]
    action: redact
  - name: stop-word
    words: [halt]
    action: block
"""


@pytest.fixture(scope="module")
def rules(tmp_path_factory):
    path = tmp_path_factory.mktemp("rules") / "out.yaml"
    path.write_text(RULES)
    return load_rules(path, "--output-filter", with_actions=True)


def _reference(rules, text: str) -> tuple[str, bool]:
    """re.sub over one alternation of the rules (leftmost match, the first-listed rule on a tie),
    cut at the first block match."""
    combined = re.compile("|".join(f"(?P<r{i}>{r.regex.pattern})" for i, r in enumerate(rules.rules)), re.IGNORECASE)
    out, at = [], 0
    for match in combined.finditer(text):
        rule = next(r for i, r in enumerate(rules.rules) if match.group(f"r{i}") is not None)
        out.append(text[at:match.start()])
        if rule.action == "block":
            return "".join(out), True
        out.append(rule.replacement)
        at = match.end()
    return "".join(out) + text[at:], False


def _streamed(rules, text: str, cuts: list[int]) -> tuple[str, StreamFilter]:
    stream, shown, at = StreamFilter(rules), "", 0
    for cut in sorted(set(c % (len(text) + 1) for c in cuts)):
        shown += stream.feed(text[at:cut])
        at = cut
    return shown + stream.feed(text[at:], final=True), stream


PIECES = st.sampled_from(["a", "b", " ", "1", "2", "34", "cat", "dog", "C++", " cat dog", "halt", "x!", "é"])


@settings(max_examples=400, deadline=None)
@given(st.lists(PIECES, max_size=30).map("".join), st.lists(st.integers(0, 200), max_size=12))
def test_any_split_of_the_stream_gives_the_whole_texts_result(rules, text, cuts):
    shown, stream = _streamed(rules, text, cuts)
    expected, blocked = _reference(rules, text)
    assert shown == expected
    assert (stream.blocked_by == "stop-word") == blocked


def test_a_match_straddling_deltas_is_redacted_and_text_is_held_back_only_by_the_longest_span(rules):
    stream = StreamFilter(rules)
    assert rules.holdback == 7  # "cat dog": the longest span of any rule
    assert stream.feed("total 12") == "t"  # "otal 12" may still become a match: held back
    assert stream.feed("34 cats") == "otal #"  # the match straddled the deltas; " cats" is held back
    assert stream.feed(" halt and more") == " cats "  # the block rule matched: nothing after it is released
    assert stream.blocked_by == "stop-word" and stream.redactions == {"number": 1}
    assert stream.feed("more text", final=True) == ""


def test_whole_words_only(rules):
    shown, _ = _streamed(rules, "concatenate cat; cat dogma", [])
    assert shown == "concatenate [redacted]; [redacted] dogma"


@pytest.mark.parametrize("pattern, message", [
    ("'.*'", "unbounded"),
    ("'secret\\w+'", "unbounded"),
    ("'a{1,300}'", "can span 300 characters"),
    ("'x?'", "can match empty text"),
    ("'^Sure'", "an anchor"),
    ("'pass(?=word)'", "a look-ahead or look-behind"),
    ("'(unclosed'", "not a valid regular expression"),
])
def test_unstreamable_patterns_are_refused_at_load_time(tmp_path, pattern, message):
    path = tmp_path / "rules.yaml"
    path.write_text(f"rules:\n  - name: bad\n    pattern: {pattern}\n    action: block\n")
    with pytest.raises(FilterFileError, match=re.escape(message)) as caught:
        load_rules(path, "--output-filter", with_actions=True)
    assert str(path) in str(caught.value) and "(bad)" in str(caught.value) and "\n" not in str(caught.value)


@pytest.mark.parametrize("body, message", [
    ("rules: []", "non-empty list"),
    ("rules:\n  - name: a\n    words: [x]\n    action: drop", "must be redact or block"),
    ("rules:\n  - name: a\n    words: [x]\n  - name: a\n    words: [y]", "used twice"),
    ("rules:\n  - name: a\n    words: [x]\n    pattern: 'y'", "exactly one of 'pattern'"),
    ("rules:\n  - name: a\n    words: [x]\n    colour: red", "unknown field(s) colour"),
    ("rules: [", "not valid YAML"),
])
def test_bad_rule_files_name_the_problem(tmp_path, body, message):
    path = tmp_path / "rules.yaml"
    path.write_text(body)
    with pytest.raises(FilterFileError, match=re.escape(message)):
        load_rules(path, "--output-filter", with_actions=True)


def test_input_rules_take_no_action(tmp_path):
    path = tmp_path / "rules.yaml"
    path.write_text("rules:\n  - name: a\n    words: [x]\n    action: redact\n")
    with pytest.raises(FilterFileError, match="input rules refuse the request"):
        load_rules(path, "--input-filter", with_actions=False)


def test_the_rule_files_in_the_docs_load(tmp_path):
    from pathlib import Path

    doc = (Path(__file__).resolve().parents[1] / "docs" / "serve.md").read_text()
    blocks = [b for b in re.findall(r"```yaml\n(.*?)```", doc, re.S) if b.startswith("rules:")]
    assert len(blocks) == 2
    path = tmp_path / "rules.yaml"
    for block, with_actions in zip(blocks, (True, False)):
        path.write_text(block)
        assert load_rules(path, "--output-filter", with_actions=with_actions).rules


# ---- one request's outputs through the filter (what serving.py's hook calls) --------------------------
def _request_filter(tmp_path, *, choices: int, cumulative: bool):
    from prometheus_client import CollectorRegistry

    from llmctl.server.text_filter import FilterCounters, OutputFilter

    path = tmp_path / "rules.yaml"
    path.write_text("rules:\n  - name: secret\n    words: [secret]\n    action: block\n"
                    "  - name: digits\n    pattern: '[0-9]{2,3}'\n    action: redact\n    replacement: '#'\n")
    audit: dict = {}
    output_filter = OutputFilter(load_rules(path, "--output-filter", with_actions=True),
                                 FilterCounters.on(CollectorRegistry(), "m"))
    return output_filter.for_request(audit, choices=choices, cumulative=cumulative), audit


def _output(*texts: str, finished: bool = False, reasons=None):
    from llmctl.engine.outputs import CompletionOutput, RequestOutput

    reasons = reasons or [None] * len(texts)
    return RequestOutput("r", None, [1], [CompletionOutput(i, text, [7], None, None, finish_reason=reason)
                                           for i, (text, reason) in enumerate(zip(texts, reasons))], finished)


@pytest.mark.parametrize("cumulative", [True, False])
def test_a_block_ends_the_choice_with_content_filter_and_cancels_the_request(tmp_path, cumulative):
    request, audit = _request_filter(tmp_path, choices=1, cumulative=cumulative)
    pieces = ["ab 12", "3 is the se", "cret word", " more"]
    cancelled, shown, reasons = [], "", []
    for i in range(len(pieces)):
        text = "".join(pieces[:i + 1]) if cumulative else pieces[i]
        out = request.apply(0, _output(text), lambda: cancelled.append(True))
        if not out.outputs:
            continue
        shown = out.outputs[0].text if cumulative else shown + out.outputs[0].text
        reasons.append(out.outputs[0].finish_reason)
        if out.finished:
            break
    assert shown == "ab # is the " and reasons[-1] == "content_filter" and cancelled == [True]
    assert audit == {"output_filter_redactions": {"digits": 1}, "output_filter_blocked": ["secret"]}


def test_with_two_choices_the_request_runs_on_until_the_other_one_ends(tmp_path):
    request, _ = _request_filter(tmp_path, choices=2, cumulative=False)
    cancelled = []
    out = request.apply(0, _output("a secret word", "fine"), lambda: cancelled.append(True))
    assert [c.finish_reason for c in out.outputs] == ["content_filter", None] and not out.finished
    out = request.apply(0, _output("dropped", " and done", reasons=[None, "stop"]), lambda: cancelled.append(True))
    assert [(c.index, c.text, c.finish_reason) for c in out.outputs] == [(1, "fine and done", "stop")]  # "fine" was held back
    assert out.finished and cancelled == [True]
