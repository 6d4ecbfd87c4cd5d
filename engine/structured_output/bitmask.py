"""The sampler's one structured-output hook: `apply_grammar_bitmask(logits, rows)`, before sampling.

One bitmask for the whole batch (every token allowed in rows without a grammar), each constrained row filled
by its sequence's matcher, then one in-place apply over those rows (CPU or CUDA): tokens the grammar does not
allow next get -inf, so any sampler (greedy, random, the rejection sampler) draws only allowed tokens, and an
end-of-sequence token only where the grammar may end.
"""

from __future__ import annotations

from typing import Any, Protocol, Sequence

import torch


class _Row(Protocol):
    grammar: Any  # Optional[SequenceGrammar]
    output_token_ids: list[int]


def apply_grammar_bitmask(logits: torch.Tensor, rows: Sequence[_Row]) -> torch.Tensor:
    """Mask `logits` ([len(rows), vocab], in place) to what each row's grammar allows; returns it."""
    constrained = [i for i, row in enumerate(rows) if row.grammar is not None]
    if not constrained:
        return logits
    backend = rows[constrained[0]].grammar.backend
    bitmask = backend.allocate_bitmask(len(rows))
    by_sequence: dict[int, list[tuple[int, list[int]]]] = {}  # one matcher per sequence, its positions together
    for i in constrained:
        by_sequence.setdefault(id(rows[i].grammar), []).append((i, rows[i].output_token_ids))
    for positions in by_sequence.values():
        rows[positions[0][0]].grammar.fill_rows(bitmask, positions)
    backend.apply_bitmask(logits, bitmask, constrained)
    return logits
