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

Rows that are not argmax-only run vectorised on the logits' device: penalties on the touched entries,
top-k through `torch.topk` (top-p over those candidates; only a row with top-p and no top-k sorts its
vocabulary), per-row settings in one host->device copy each, and the step's results (ids and log-probs)
back to the host in one transfer (`_to_host`). Seeded rows draw their noise from their own generator
one row at a time (the draws stay those of earlier versions); the others share one draw.
"""

from __future__ import annotations

import itertools
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
    # Async scheduling: outputs sampled by the step in flight, not in output_token_ids yet (their count is known;
    # rows that need their values - penalties, logits processors, a grammar - are sampled after that step lands).
    num_pending: int = 0

    @property
    def num_outputs(self) -> int:
        return len(self.output_token_ids) + self.num_pending

    def generator_at(self, offset: int = 0, stream: int = TOKEN_STREAM) -> Optional[torch.Generator]:
        """The row's generator, ready for its draws at output position len(output_token_ids) + offset
        (`stream` tells apart the draws of one position); None for an unseeded row."""
        if self.generator is not None and self.draw_seed is not None:
            self.generator.manual_seed(position_seed(self.draw_seed, self.num_outputs + offset, stream))
        return self.generator

    @property
    def masks_stops(self) -> bool:
        """Its stop tokens are masked: fewer than min_tokens generated yet."""
        return bool(self.stop_token_ids) and self.num_outputs < self.params.min_tokens

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


@dataclass
class DeviceSample:
    """A step's sampled ids still on the logits' device (what async scheduling feeds the next step's inputs
    from), and `table`, the one tensor the host reads for them (`output` parses it once it is there)."""
    token_ids: torch.Tensor  # [positions] long
    table: torch.Tensor  # token_ids, or a float64 [positions, 2 + 2 top_n] table of ids and log-probs
    logprob_counts: Optional[list[Optional[int]]] = None  # per position, its row's `logprobs`; None: no log-probs
    top_n: int = 0

    def output(self, host_table: list) -> SamplerOutput:
        """The SamplerOutput of `table.tolist()`."""
        if self.logprob_counts is None:
            return SamplerOutput(host_table, None)
        return SamplerOutput([int(line[0]) for line in host_table],
                             [_logprob_entry(line, count, self.top_n)
                              for line, count in zip(host_table, self.logprob_counts)])


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


def _to_host(values: torch.Tensor) -> list:
    """The step's one device->host transfer (a sync on an accelerator): everything the host needs rides in it."""
    return values.tolist()


def _to_device(values: Sequence, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Host values as a tensor on `device`; non_blocking: from pageable memory the copy is staged before the
    call returns (safe), without the stream sync a blocking copy waits for."""
    return torch.tensor(values, dtype=dtype).to(device, non_blocking=True)


def device_argmax(values: torch.Tensor) -> torch.Tensor:
    """Each row's argmax (first index on ties) as a long tensor on `values`' device: on CPU through
    `row_argmax`'s vector passes (torch's CPU argmax is not vectorised), elsewhere one torch argmax."""
    if values.is_cpu:
        return torch.tensor(row_argmax(values), dtype=torch.long)
    return values.argmax(dim=-1)


def _row_index(lengths: list[int]) -> torch.Tensor:
    """[0]*lengths[0] + [1]*lengths[1] + ... on the host."""
    return torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths, dtype=torch.long))


def penalise(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """Repetition penalty on each row's prompt+output tokens, then presence/frequency on its output tokens
    (OpenAI's definition), for all `rows` at once; tokens past the vocabulary are ignored. Only the
    touched (row, token) entries are read and written: a token's output count comes from searching the
    sorted output keys (no [rows, vocab] count tensor, no data-dependent shape to sync on)."""
    vocab, device = logits.shape[-1], logits.device
    penalised = [r if r.params.needs_penalties else None for r in rows]
    outputs = [r.output_token_ids if r else [] for r in penalised]
    prompts = [r.prompt_token_ids if r and r.params.repetition_penalty != 1.0 else [] for r in penalised]
    row_ids = torch.cat([_row_index([len(o) for o in outputs]), _row_index([len(p) for p in prompts])])
    token_ids = torch.tensor(list(itertools.chain(*outputs, *prompts)), dtype=torch.long)
    in_vocab = token_ids < vocab
    num_outputs = int(in_vocab[:sum(len(o) for o in outputs)].sum())  # outputs stay first
    pairs = torch.stack([row_ids[in_vocab], token_ids[in_vocab]]).to(device, non_blocking=True)
    settings = _to_device([[r.params.repetition_penalty, r.params.frequency_penalty, r.params.presence_penalty]
                           for r in rows], logits.dtype, device)[pairs[0]]
    keys = pairs[0] * vocab + pairs[1]
    output_keys = keys[:num_outputs].sort().values
    counts = torch.searchsorted(output_keys, keys, right=True) - torch.searchsorted(output_keys, keys)
    counts = counts.to(logits.dtype)
    repetition, frequency, presence = settings.unbind(1)
    values = logits[pairs[0], pairs[1]]
    values = torch.where(values > 0, values / repetition, values * repetition)  # exact for a penalty of 1
    values = values - (frequency * counts + presence * (counts > 0).to(logits.dtype))
    return logits.index_put((pairs[0], pairs[1]), values)  # a repeated pair writes the same value each time


def filter_logits(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Top-k, then top-p over what top-k keeps, then min-p: the logits a row keeps, the others -inf."""
    vocab = logits.shape[-1]
    top_k = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]
    top_p = [p.top_p for p in params]
    if any(k < vocab for k in top_k) or any(p < 1.0 for p in top_p):
        logits = logits.masked_fill(logits < _cutoffs(logits, top_k, top_p), float("-inf"))
    min_p = [p.min_p for p in params]
    if any(m > 0.0 for m in min_p):
        probs = torch.softmax(logits, dim=-1)
        threshold = _to_device(min_p, probs.dtype, probs.device).unsqueeze(1)
        logits = logits.masked_fill(probs < threshold * probs.amax(dim=-1, keepdim=True), float("-inf"))
    return logits


def _cutoffs(logits: torch.Tensor, top_k: list[int], top_p: list[float]) -> torch.Tensor:
    """[rows, 1]: the smallest logit each row keeps under top-k / top-p (-inf: no filter). Rows with a top-k
    look at the batch's largest k candidates (`torch.topk`); only rows with top-p and no top-k sort."""
    rows, vocab = logits.shape
    with_k = [i for i in range(rows) if top_k[i] < vocab]
    sorting = [i for i in range(rows) if top_k[i] == vocab and top_p[i] < 1.0]
    if len(with_k) == rows or len(sorting) == rows:
        return _group_cutoff(logits, top_k, top_p, bool(with_k)).unsqueeze(1)
    cutoffs = torch.full((rows,), float("-inf"), dtype=logits.dtype, device=logits.device)
    for group, by_top_k in ((with_k, True), (sorting, False)):
        if group:
            index = _to_device(group, torch.long, logits.device)
            cutoffs[index] = _group_cutoff(logits[index], [top_k[i] for i in group], [top_p[i] for i in group],
                                           by_top_k)
    return cutoffs.unsqueeze(1)


def _group_cutoff(logits: torch.Tensor, top_k: list[int], top_p: list[float], by_top_k: bool) -> torch.Tensor:
    """The smallest kept logit of each row: among its top_k best (the group's largest k of candidates when
    `by_top_k`, else the whole sorted vocabulary), the shortest prefix whose mass before its last token is
    at most top_p (renormalised over the top-k)."""
    if by_top_k:
        candidates = logits.topk(max(top_k), dim=-1).values  # sorted, descending
    else:
        candidates = logits.sort(dim=-1, descending=True).values
    width = candidates.shape[-1]
    ranks = torch.arange(width, device=logits.device).unsqueeze(0)
    drop = ranks >= _to_device(top_k, torch.long, logits.device).unsqueeze(1)
    if any(p < 1.0 for p in top_p):
        probs = torch.softmax(candidates.masked_fill(drop, float("-inf")), dim=-1)
        # p = 1 keeps all: a cumulative sum can round past 1.0
        limit = _to_device([p if p < 1.0 else float("inf") for p in top_p], probs.dtype, logits.device).unsqueeze(1)
        drop |= (probs.cumsum(dim=-1) - probs) > limit  # keep the token that crosses p
    kept = (~drop).sum(dim=-1, keepdim=True)  # a prefix: both rules drop a suffix of the sorted candidates
    return candidates.gather(1, kept - 1).squeeze(1)


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
        sample = self.sample(logits, rows, drafts)
        return sample.output(_to_host(sample.table))

    def sample(self, logits: torch.Tensor, rows: list[SamplingRow], drafts: Sequence[DraftSpan] = (),
               argmax: Optional[list[int]] = None) -> DeviceSample:
        """`__call__`'s tokens and log-probs left on the device (no transfer: the caller makes it)."""
        if all(row.argmax_only for row in rows):
            chosen = torch.tensor(argmax, dtype=torch.long) if argmax is not None else device_argmax(logits)
            return DeviceSample(chosen, chosen)
        logits = self._apply_processors(logits, rows)
        raw_logprobs = None
        if any(r.params.logprobs is not None for r in rows):
            raw_logprobs = torch.log_softmax(logits, dim=-1)
        logits = self._apply_penalties(logits, rows)
        logits = self._mask_early_stops(logits, rows)
        logits = apply_grammar_bitmask(logits, rows)
        spans = [span for span in drafts if not rows[span.start].params.greedy]
        chosen = self._choose(logits, rows, skip={i for span in spans for i in span.positions})
        if spans:
            chosen = self._rejection_sample(logits, rows, spans, chosen)
        return self._collect(chosen, raw_logprobs, rows)

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

    @staticmethod
    def _apply_penalties(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        if not any(r.params.needs_penalties for r in rows):
            return logits
        return penalise(logits, rows)

    @staticmethod
    def _mask_early_stops(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        vocab = logits.shape[-1]
        pairs = [(i, t) for i, r in enumerate(rows) if r.masks_stops for t in r.stop_token_ids if t < vocab]
        if not pairs:
            return logits
        index = _to_device(pairs, torch.long, logits.device)
        return logits.index_put((index[:, 0], index[:, 1]), logits.new_full((), float("-inf")))  # filled there: no copy

    # ---- choosing ---------------------------------------------------------------------------
    def _choose(self, logits: torch.Tensor, rows: list[SamplingRow], skip: frozenset[int] | set[int] = frozenset()
                ) -> torch.Tensor:
        """Each row's token on the device: argmax, or a draw for the random rows not in `skip` (those the
        rejection sampler takes; theirs is left to it)."""
        random_rows = [i for i, r in enumerate(rows) if not r.params.greedy and i not in skip]
        if len(random_rows) == len(rows):
            return self._draw(logits, rows)
        chosen = device_argmax(logits)
        if random_rows:
            index = _to_device(random_rows, torch.long, logits.device)
            chosen[index] = self._draw(logits[index], [rows[i] for i in random_rows])
        return chosen

    def _draw(self, logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        probs = self.distribution(logits, [row.params for row in rows])
        return device_argmax(probs / self._exponential_noise(probs, rows))

    def distribution(self, logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
        """The distribution a random row draws from: temperature, then top-k / top-p / min-p (a draft
        proposer's q, drawn from under the request's settings)."""
        temperature = _to_device([p.temperature for p in params], logits.dtype, logits.device).unsqueeze(1)
        return torch.softmax(filter_logits(logits / temperature, params), dim=-1)

    def _exponential_noise(self, probs: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        """Exponential(1) noise per row: argmax(p / noise) is a draw from p (the Gumbel-max trick). Unseeded
        rows share one draw from the sampler's generator; a seeded row draws from its own, keyed to its position."""
        shared = [i for i, row in enumerate(rows) if row.generator is None]
        draw = torch.empty(len(shared), probs.shape[1], dtype=probs.dtype, device=probs.device)
        if shared:
            draw.exponential_(generator=self.generator)
        if len(shared) == len(rows):
            return draw
        noise = torch.empty_like(probs)
        if shared:
            noise[_to_device(shared, torch.long, probs.device)] = draw
        for i, row in enumerate(rows):
            if row.generator is not None:
                noise[i].exponential_(generator=row.generator_at())
        return noise

    def _rejection_sample(self, logits: torch.Tensor, rows: list[SamplingRow], spans: list[DraftSpan],
                          chosen: torch.Tensor) -> torch.Tensor:
        """`chosen` with each span's positions replaced by what the rejection sampler emits there."""
        positions: list[int] = []
        tokens: list[int] = []
        for span in spans:
            row = rows[span.start]
            target = self.distribution(logits[list(span.positions)], [rows[i].params for i in span.positions])
            emitted = rejection_sample(target, span.token_ids, span.probs,
                                       lambda offset, stream, row=row: row.generator_at(offset, stream) or self.generator)
            positions.extend(span.positions)
            tokens.extend(emitted + [PLACEHOLDER_TOKEN_ID] * (len(span.positions) - len(emitted)))
        chosen[_to_device(positions, torch.long, chosen.device)] = _to_device(tokens, torch.long, chosen.device)
        return chosen

    # ---- results ------------------------------------------------------------------------------
    @staticmethod
    def _collect(chosen: torch.Tensor, raw: Optional[torch.Tensor], rows: list[SamplingRow]) -> DeviceSample:
        """The ids, and the log-probs rows asked for, as one table for one transfer to the host."""
        if raw is None:
            return DeviceSample(chosen, chosen)
        top_n = max(r.params.logprobs or 0 for r in rows)
        columns = [chosen.unsqueeze(1).to(torch.float64),
                   raw.gather(1, chosen.clamp_min(0).unsqueeze(1)).to(torch.float64)]
        if top_n:
            values, ids = raw.topk(top_n, dim=-1)
            columns += [ids.to(torch.float64), values.to(torch.float64)]
        # float64 holds every token id and float32 exactly
        return DeviceSample(chosen, torch.cat(columns, dim=1), [row.params.logprobs for row in rows], top_n)


def _logprob_entry(line: list[float], count: Optional[int], top_n: int) -> Optional[dict[int, float]]:
    """{token: logprob} of one row's `_collect` line: the sampled token's, then its top `count`."""
    token = int(line[0])
    if count is None or token == PLACEHOLDER_TOKEN_ID:
        return None
    entry = {token: line[1]}
    entry.update({int(t): v for t, v in zip(line[2:2 + count], line[2 + top_n:2 + top_n + count])})
    return entry
