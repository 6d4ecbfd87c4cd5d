"""The rejection sampler for drafts drawn from a distribution q (a draft model's sampled proposals).

A verify row of k drafts x_0..x_{k-1} gives the target's distributions p_0..p_k (after the request's
penalties, temperature, top-k/top-p/min-p: the distribution decoding one token at a time draws from).
Draft j is accepted with probability min(1, p_j(x_j) / q_j(x_j)); the first rejected one is replaced by
a draw from the residual max(0, p_j - q_j), normalised, and ends the row; when all k are accepted a
bonus token is drawn from p_k. Each emitted token is then distributed exactly as the target's
(Leviathan et al. 2023, Chen et al. 2023: q(t)·min(1, p/q) + P(reject)·residual(t) = p(t)).

A rejected draft never comes back: rejection needs p(x) < q(x), where the residual is zero. So the
scheduler's rule (`scheduler.accepted_tokens`: drafts equal to the sampled token, then the first other)
reads this sampler's output as it reads a deterministic draft's.

Draws: a uniform per draft, then one exponential vector over the vocabulary for the last token
(Gumbel-max, as `Sampler` draws), each from `generator_at(offset, stream)`: for a seeded request its
generator keyed to that output position (`SamplingRow.generator_at`), so the emitted token at a
position after all accepted drafts uses the same noise a one-token decode there would.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch

# A sampled position past a rejected draft: the row ended before it, nothing was drawn there.
PLACEHOLDER_TOKEN_ID = -1

# The draw streams of one output position: its token's draw, a draft's acceptance test, a draft model's proposal.
TOKEN_STREAM, ACCEPT_STREAM, DRAFT_STREAM = 0, 1, 2


def position_seed(seed: int, position: int, stream: int = TOKEN_STREAM) -> int:
    """The seed of a seeded request's draws at one output position (tuples of ints hash alike in every
    process, unlike str)."""
    return hash((seed, position, stream)) & (2**63 - 1)


@dataclass(frozen=True)
class DraftSpan:
    """A verify row whose drafts were drawn from distributions: its k + 1 sampled positions start at
    `start` in the sampler's batch; `probs[j]` is the distribution `token_ids[j]` was drawn from."""

    start: int
    token_ids: list[int]
    probs: torch.Tensor  # float32 [k, vocab]

    @property
    def positions(self) -> range:
        return range(self.start, self.start + len(self.token_ids) + 1)


def acceptance_probability(target: torch.Tensor, draft: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """min(1, p(x) / q(x)) for each draft x (rows of `target`/`draft` are p_j / q_j)."""
    index = torch.arange(len(token_ids), device=target.device)
    p, q = target[index, token_ids], draft[index, token_ids]
    return torch.where(q > 0, (p / q.clamp_min(torch.finfo(q.dtype).tiny)).clamp(max=1.0), (p > 0).to(p.dtype))


def residual_distribution(target: torch.Tensor, draft: torch.Tensor, rejected: int) -> torch.Tensor:
    """max(0, p - q) normalised: what a rejection draws from. `rejected` (the draft token) gets no mass,
    even when rounding leaves some; a residual that rounds to nothing falls back to p without it."""
    residual = (target - draft).clamp_min(0.0)
    residual[rejected] = 0.0
    total = residual.sum()
    if not total > 0:
        residual = target.clone()
        residual[rejected] = 0.0
        total = residual.sum()
    return residual / total


def rejection_sample(target: torch.Tensor, token_ids: list[int], draft: torch.Tensor,
                     generator_at: Callable[[int, int], Optional[torch.Generator]]) -> list[int]:
    """The tokens a verify row emits: the accepted drafts, then the resample of the first rejected one
    or the bonus token. `target` is [k + 1, vocab] (p_0..p_k), `draft` [k, vocab] (q_0..q_{k-1});
    `generator_at(j, stream)` is the generator for the draws at the row's j-th position."""
    k = len(token_ids)
    if target.shape[0] != k + 1 or draft.shape[0] < k or draft.shape[-1] != target.shape[-1]:
        raise ValueError(f"draft probabilities of shape {tuple(draft.shape)} do not fit {k} drafts over the "
                         f"target's vocabulary of {target.shape[-1]}")
    target = target.float()
    draft = draft[:k].to(device=target.device, dtype=torch.float32)
    drafts = torch.tensor(token_ids, dtype=torch.long, device=target.device)
    uniform = torch.cat([torch.rand(1, generator=generator_at(j, ACCEPT_STREAM), device=target.device)
                         for j in range(k)]) if k else torch.empty(0, device=target.device)
    rejected = (uniform >= acceptance_probability(target, draft, drafts)).nonzero()
    accepted = int(rejected[0]) if rejected.numel() else k
    last = target[k] if accepted == k else residual_distribution(target[accepted], draft[accepted],
                                                                 token_ids[accepted])
    noise = torch.empty_like(last).exponential_(generator=generator_at(accepted, TOKEN_STREAM))
    return token_ids[:accepted] + [int((last / noise).argmax())]
