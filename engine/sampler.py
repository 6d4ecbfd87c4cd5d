"""The sampler: logits of the rows to sample -> next token ids (and optional top log-probs).

Order: penalties (repetition on prompt+output, presence/frequency on output), min_tokens masking
of stop tokens, the structured-output grammar's bitmask (engine/structured_output/bitmask.py), then greedy argmax or temperature -> top-k -> top-p -> min-p -> a draw. A seeded
row's draw for output position t comes from its generator re-seeded from (seed, t) (`position_seed`):
its output depends neither on the rest of the batch nor on how its tokens were grouped into steps, so
an n-gram verify row (each position drawn as a one-token decode would draw it, drafts kept while they
equal the draw) gives a seeded request exactly the tokens plain decoding gives it.
The positions of a sampled verify row whose drafts came with their distribution (`DraftSpan`) go
through the rejection sampler (engine/spec_decode/rejection_sampler.py) on the same target distribution instead;
past its first rejection they hold `PLACEHOLDER_TOKEN_ID`.
Reported log-probs are those of the raw model distribution.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch

from llmctl.engine.kernels import load_cpu_kernels
from llmctl.engine.sampling_params import SamplingParams
from llmctl.engine.spec_decode.rejection_sampler import (PLACEHOLDER_TOKEN_ID, TOKEN_STREAM, DraftSpan, position_seed,
                                                         rejection_sample)
from llmctl.engine.structured_output import apply_grammar_bitmask


@dataclass
class SamplingRow:
    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    generator: Optional[torch.Generator]
    stop_token_ids: tuple[int, ...]  # masked while fewer than min_tokens were generated
    draw_seed: Optional[int] = None  # with `generator`: re-seed it per output position (position_seed)
    grammar: Optional[Any] = None  # the sequence's structured_output.SequenceGrammar: masks what it does not allow

    def generator_at(self, offset: int = 0, stream: int = TOKEN_STREAM) -> Optional[torch.Generator]:
        """The row's generator, ready for its draws at output position len(output_token_ids) + offset
        (`stream` tells apart the draws of one position); None for an unseeded row."""
        if self.generator is not None and self.draw_seed is not None:
            self.generator.manual_seed(position_seed(self.draw_seed, len(self.output_token_ids) + offset, stream))
        return self.generator

    @property
    def masks_stops(self) -> bool:
        """Its stop tokens are masked: fewer than min_tokens generated yet."""
        return bool(self.stop_token_ids) and len(self.output_token_ids) < self.params.min_tokens

    @property
    def argmax_only(self) -> bool:
        """Greedy with nothing to apply first: no logits processors, penalties, log-probs or min_tokens mask."""
        params = self.params
        return (params.greedy and not params.logits_processors and params.logprobs is None
                and not params.needs_penalties and not self.masks_stops and self.grammar is None)


@dataclass
class SamplerOutput:
    token_ids: list[int]  # PLACEHOLDER_TOKEN_ID past a verify row's rejected draft
    logprobs: Optional[list[Optional[dict[int, float]]]]  # per row: {token: logprob} incl. the sampled one


ARGMAX_CHUNK = 1024


def row_argmax(values: torch.Tensor) -> list[int]:
    """`values.argmax(-1).tolist()` of a 2-D tensor (first index on ties), in two passes on CPU.

    torch's CPU argmax over the last dimension is not vectorised while `amax` is (about 10x apart at
    64 x 49152): the native kernel's two vector passes where it is built, else take the maximum of each
    1024-wide chunk, pick the first chunk holding the row's maximum, and argmax inside that chunk only.
    """
    rows, width = values.shape
    if not values.is_cpu or width < 4 * ARGMAX_CHUNK:
        return values.argmax(dim=-1).tolist()
    kernels = load_cpu_kernels()
    if kernels is not None and values.dtype == torch.float32 and values.is_contiguous():
        return kernels.argmax(values)
    pad = -width % ARGMAX_CHUNK
    if pad:
        values = torch.nn.functional.pad(values, (0, pad), value=float("-inf"))
    chunks = values.view(rows, -1, ARGMAX_CHUNK)
    best_chunk = chunks.amax(dim=-1).argmax(dim=-1)
    inside = chunks[torch.arange(rows, device=values.device), best_chunk].argmax(dim=-1)
    return (best_chunk * ARGMAX_CHUNK + inside).tolist()


class Sampler:
    def __init__(self, generator: torch.Generator):
        self.generator = generator  # for unseeded rows

    def __call__(self, logits: torch.Tensor, rows: list[SamplingRow], drafts: Sequence[DraftSpan] = (),
                 argmax: Optional[list[int]] = None) -> SamplerOutput:
        """One token per row of `logits`; the rows of each span in `drafts` (a verify row with its draft
        distribution) are sampled together by the rejection sampler, unless the request is greedy (then
        the target's argmax at each position is the rejection sampler's answer for any q). `argmax`: each
        row's argmax where the forward found them (`row_argmax`'s answer)."""
        if all(row.argmax_only for row in rows):  # the passes below would change nothing: after a batch-1
            # step's weight stream each costs cold caches
            return SamplerOutput(argmax if argmax is not None else row_argmax(logits), None)
        logits = self._apply_processors(logits, rows)
        raw_logprobs = None
        if any(r.params.logprobs is not None for r in rows):
            raw_logprobs = torch.log_softmax(logits, dim=-1)
        logits = self._apply_penalties(logits, rows)
        logits = self._mask_early_stops(logits, rows)
        logits = apply_grammar_bitmask(logits, rows)
        spans = [span for span in drafts if not rows[span.start].params.greedy]
        token_ids = self._choose(logits, rows, skip={i for span in spans for i in span.positions})
        for span in spans:
            positions = list(span.positions)
            row = rows[span.start]
            target = self.distribution(logits[positions], [rows[i].params for i in positions])
            emitted = rejection_sample(target, span.token_ids, span.probs,
                                       lambda offset, stream, row=row: row.generator_at(offset, stream) or self.generator)
            token_ids[span.start:span.start + len(positions)] = (
                emitted + [PLACEHOLDER_TOKEN_ID] * (len(positions) - len(emitted)))
        return SamplerOutput(token_ids, self._gather_logprobs(raw_logprobs, token_ids, rows))

    # ---- logit processing -----------------------------------------------------------------
    @staticmethod
    def _apply_processors(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        if not any(r.params.logits_processors for r in rows):
            return logits
        logits = logits.clone()
        for i, row in enumerate(rows):
            for processor in row.params.logits_processors:
                logits[i] = processor(list(row.output_token_ids), logits[i])
        return logits

    def _apply_penalties(self, logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        needs = [i for i, r in enumerate(rows) if r.params.needs_penalties]
        if not needs:
            return logits
        logits = logits.clone()
        vocab = logits.shape[-1]
        for i in needs:
            params, row = rows[i].params, logits[i]
            output = torch.tensor(rows[i].output_token_ids, dtype=torch.long, device=logits.device)
            output = output[output < vocab]
            if params.repetition_penalty != 1.0:
                seen = torch.tensor(rows[i].prompt_token_ids + rows[i].output_token_ids, dtype=torch.long,
                                    device=logits.device)
                seen = torch.unique(seen[seen < vocab])
                values = row[seen]
                row[seen] = torch.where(values > 0, values / params.repetition_penalty,
                                        values * params.repetition_penalty)
            if output.numel() and (params.presence_penalty or params.frequency_penalty):
                counts = torch.bincount(output, minlength=vocab).to(row.dtype)
                row -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0).to(row.dtype)
        return logits

    def _mask_early_stops(self, logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        early = [i for i, r in enumerate(rows) if r.masks_stops]
        if not early:
            return logits
        logits = logits.clone()
        for i in early:
            ids = [t for t in rows[i].stop_token_ids if t < logits.shape[-1]]
            logits[i, ids] = float("-inf")
        return logits

    # ---- choosing ---------------------------------------------------------------------------
    def _choose(self, logits: torch.Tensor, rows: list[SamplingRow], skip: frozenset[int] | set[int] = frozenset()
                ) -> list[int]:
        """Argmax, or a draw for the random rows not in `skip` (those the rejection sampler takes)."""
        chosen = row_argmax(logits)
        random_rows = [i for i, r in enumerate(rows) if not r.params.greedy and i not in skip]
        if not random_rows:
            return chosen
        index = torch.tensor(random_rows, device=logits.device)
        probs = self.distribution(logits[index], [rows[i].params for i in random_rows])
        noise = self._exponential_noise(probs, [rows[i] for i in random_rows])
        for i, token in zip(random_rows, row_argmax(probs / noise)):
            chosen[i] = token
        return chosen

    def distribution(self, logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
        """The distribution a random row draws from: temperature, then top-k / top-p / min-p (a draft
        proposer's q, drawn from under the request's settings)."""
        temperature = torch.tensor([p.temperature for p in params], dtype=logits.dtype,
                                   device=logits.device).unsqueeze(1)
        return torch.softmax(self._filter(logits / temperature, params), dim=-1)

    @staticmethod
    def _filter(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
        vocab = logits.shape[-1]
        top_k = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]
        top_p = [p.top_p for p in params]
        min_p = [p.min_p for p in params]
        if any(k < vocab for k in top_k) or any(p < 1.0 for p in top_p):
            sorted_logits, order = logits.sort(dim=-1, descending=True)
            ranks = torch.arange(vocab, device=logits.device).unsqueeze(0)
            k_tensor = torch.tensor(top_k, device=logits.device).unsqueeze(1)
            drop = ranks >= k_tensor
            sorted_probs = torch.softmax(sorted_logits.masked_fill(drop, float("-inf")), dim=-1)
            p_tensor = torch.tensor(top_p, dtype=logits.dtype, device=logits.device).unsqueeze(1)
            drop |= (sorted_probs.cumsum(dim=-1) - sorted_probs) > p_tensor  # keep the token that crosses p
            logits = logits.scatter(1, order, sorted_logits.masked_fill(drop, float("-inf")))
        if any(m > 0.0 for m in min_p):
            probs = torch.softmax(logits, dim=-1)
            threshold = torch.tensor(min_p, dtype=probs.dtype, device=probs.device).unsqueeze(1)
            logits = logits.masked_fill(probs < threshold * probs.amax(dim=-1, keepdim=True), float("-inf"))
        return logits

    def _exponential_noise(self, probs: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        """Exponential(1) noise per row: argmax(p / noise) is a draw from p (the Gumbel-max trick)."""
        noise = torch.empty_like(probs)
        shared = [i for i, row in enumerate(rows) if row.generator is None]
        if shared:
            noise[shared] = torch.empty(len(shared), probs.shape[1], dtype=probs.dtype,
                                        device=probs.device).exponential_(generator=self.generator)
        for i, row in enumerate(rows):
            if row.generator is not None:
                noise[i].exponential_(generator=row.generator_at())
        return noise

    @staticmethod
    def _gather_logprobs(raw: Optional[torch.Tensor], token_ids: list[int],
                         rows: list[SamplingRow]) -> Optional[list[Optional[dict[int, float]]]]:
        if raw is None:
            return None
        result: list[Optional[dict[int, float]]] = []
        for i, row in enumerate(rows):
            count = row.params.logprobs
            if count is None or token_ids[i] == PLACEHOLDER_TOKEN_ID:
                result.append(None)
                continue
            entry = {int(token_ids[i]): float(raw[i, token_ids[i]])}
            if count:
                values, ids = raw[i].topk(count)
                entry.update({int(t): float(v) for t, v in zip(ids.tolist(), values.tolist())})
            result.append(entry)
        return result
