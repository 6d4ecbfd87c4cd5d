"""The sampler's one structured-output hook: `apply_grammar_bitmask(logits, rows)`, before sampling.

One bitmask buffer for the whole batch (the backend's, reused step after step), the rows of sequences at a
step boundary filled by one batch call of the backend, the positions of a verify row (drafts) by their
sequence's matcher, then one in-place apply over the filled rows only (CPU or CUDA): tokens the grammar does not
allow next get -inf, so any sampler (greedy, random, the rejection sampler) draws only allowed tokens, and an
end-of-sequence token only where the grammar may end. Rows left unfilled (no grammar, a terminated matcher, a
position past a refused draft) are not masked, so the buffer needs no reset.
"""

from __future__ import annotations

from typing import Any, Protocol, Sequence

import torch


class _Row(Protocol):
    grammar: Any  # Optional[SequenceGrammar]
    output_token_ids: list[int]


def apply_grammar_bitmask(logits: torch.Tensor, rows: Sequence[_Row]) -> torch.Tensor:
    """Mask `logits` ([len(rows), vocab], in place) to what each row's grammar allows; returns it."""
    by_sequence: dict[int, list[int]] = {}  # one matcher per sequence: a verify row's positions together
    for i, row in enumerate(rows):
        if row.grammar is not None:
            by_sequence.setdefault(id(row.grammar), []).append(i)
    if not by_sequence:
        return logits
    backend = rows[next(iter(by_sequence.values()))[0]].grammar.backend
    bitmask = backend.batch_bitmask(len(rows))
    boundary_rows, matchers, filled = [], [], []
    for positions in by_sequence.values():
        grammar = rows[positions[0]].grammar
        if len(positions) == 1 and grammar.at_boundary(rows[positions[0]].output_token_ids):
            if not grammar.is_terminated:
                boundary_rows.append(positions[0])
                matchers.append(grammar.matcher)
        else:
            filled += grammar.fill_rows(bitmask, [(i, rows[i].output_token_ids) for i in positions])
    if matchers:
        backend.fill_bitmasks(matchers, bitmask, boundary_rows)
    filled += boundary_rows
    if filled:
        backend.apply_bitmask(logits, bitmask, filled)
    return logits
