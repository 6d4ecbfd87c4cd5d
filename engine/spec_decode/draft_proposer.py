"""Draft-model proposals for speculative decoding, as vLLM's `{"model": PATH, "num_speculative_tokens": K}`.

A second, smaller model with the target's tokenizer runs in the same engine, on the same device, in a
`ModelRunner` of its own. Its paged KV pool has the target's block ids: a sequence's draft K/V live in
the blocks of the sequence's own block table, so they are allocated and freed with the target's (the
engine sizes the two pools together: `RunnerConfig.extra_kv_bytes_per_token`), and nothing of the
draft outlives a block.

Before each `schedule()` the engine has `DraftProposer.propose` draft for every running decode:
  1. reserve the slots the draft writes (the last known token and the first k - 1 drafts) with the
     block manager's lookahead, as the scheduler does for a verify row; no room: no drafts, never a
     preemption;
  2. catch up: one row per sequence over the tokens the draft has not seen (its whole context the
     first time, since prefix-cached blocks hold no draft K/V of this sequence's; after a verify
     step the accepted tokens), ending in the first draft;
  3. k - 1 one-token rows, each feeding the previous draft and drawing the next.
A greedy request gets the draft's argmax (a deterministic draft: `spec_draft_probs` stays None). A
sampled one draws each draft from the draft's distribution after the request's temperature, top-k,
top-p and min-p, and hands it to the verifier as `Sequence.spec_draft_probs` (float32 [k, vocab]), so
the rejection sampler keeps the output distribution exactly the target's. Seeded requests draw their
drafts from a generator of their own, re-seeded for the output position each draft proposes for (a
stream apart from the target's draws there), so the output stays reproducible.

The draft's K/V of a rejected draft are simply overwritten later: what the draft holds per sequence is
its fed tokens (the known ones, then its drafts), compared with the sequence's tokens at the next
round; a preempted sequence (blocks gone) starts from nothing.

A draft forward that runs out of memory costs the round, never the requests: the round's drafts are
dropped (its sequences decode one token in the step), its lookahead blocks go back, and the next rounds
run smaller, as the target's steps do after an OOM (`Scheduler.shrink_after_oom`): half the catch-up
tokens while a catch-up row is longer than a block, else half the sequences, else no drafting; the caps
double back every `OOM_RECOVERY_STEPS` rounds.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field, replace
from importlib.resources import files
from pathlib import Path
from typing import Optional

import torch
from safetensors import safe_open

from llmctl.engine.args import SpeculativeConfig
from llmctl.engine.block_manager import BlockManager
from llmctl.engine.errors import EngineArgsError, ModelLoadError, is_out_of_memory
from llmctl.engine.loader import find_weight_files
from llmctl.engine.model_config import ModelConfig
from llmctl.engine.model_runner import ModelRunner, RunnerConfig, kv_bytes_per_token
from llmctl.engine.parallel import TensorParallel
from llmctl.engine.sampler import Sampler, row_argmax
from llmctl.engine.scheduler import OOM_RECOVERY_STEPS
from llmctl.engine.sequence import Sequence
from llmctl.engine.spec_decode.ngram_proposer import AdaptiveProposer
from llmctl.engine.spec_decode.rejection_sampler import DRAFT_STREAM, position_seed
from llmctl.engine.step_types import ScheduledSeq

logger = logging.getLogger(__name__)

DEFAULT_DRAFT = "default-draft"


def default_draft_path() -> Path:
    """The draft shipped for the embedded default model (tools/train_default_model.py --draft-of)."""
    return Path(str(files("llmctl").joinpath("default_draft")))


def resolve_draft_folder(name: str) -> Path:
    """`"default-draft"` -> the shipped draft's folder; anything else is a model folder."""
    return default_draft_path() if name == DEFAULT_DRAFT else Path(name)


def _vocabulary(folder: Path) -> Optional[dict[str, int]]:
    """token -> id of the folder's tokenizer.json (added tokens included); None without one."""
    from tokenizers import Tokenizer as Backend

    path = folder / "tokenizer.json"
    if not path.is_file():
        return None
    try:
        return Backend.from_file(str(path)).get_vocab(with_added_tokens=True)
    except Exception as exc:  # noqa: BLE001 - the Rust side raises plain Exception
        raise ModelLoadError(f"{path} cannot be parsed: {exc}") from None


@dataclass(frozen=True)
class DraftModel:
    """A checked draft: its folder and architecture, with the target's vocabulary."""

    folder: Path
    config: ModelConfig

    @classmethod
    def load(cls, name: str, target: ModelConfig, tokenizer_folder: Path, max_model_len: int) -> "DraftModel":
        """The draft named by `speculative_config.model`, refused (naming what differs) unless its
        token ids mean what the target's mean and it covers `max_model_len` positions."""
        folder = resolve_draft_folder(name)
        if not folder.is_dir():
            raise ModelLoadError(f"draft model folder {folder} does not exist (speculative_config model {name!r}; "
                                 f'"{DEFAULT_DRAFT}" is the shipped one)')
        config = ModelConfig.from_pretrained(folder)
        if config.vocab_size != target.vocab_size:
            raise EngineArgsError(f"the draft model {folder} has a vocabulary of {config.vocab_size} tokens, the "
                                  f"target {target.vocab_size}: a draft needs the target's tokenizer")
        draft_vocab, target_vocab = _vocabulary(folder), _vocabulary(tokenizer_folder)
        if draft_vocab is not None and target_vocab is not None and draft_vocab != target_vocab:
            differing = sorted(set(draft_vocab.items()) ^ set(target_vocab.items()), key=lambda kv: kv[1])[:3]
            raise EngineArgsError(f"the draft model {folder} has another tokenizer than the target's "
                                  f"({tokenizer_folder}): token ids differ, e.g. {differing}")
        if config.max_position_embeddings < max_model_len:
            raise EngineArgsError(f"the draft model {folder} covers {config.max_position_embeddings} positions, "
                                  f"fewer than max_model_len {max_model_len}: lower --max-model-len")
        return cls(folder, config)

    def kv_bytes_per_token(self, dtype: torch.dtype) -> int:
        return kv_bytes_per_token(self.config, dtype)

    def weight_bytes(self, dtype: torch.dtype) -> int:
        """What its weights take in `dtype`: from the tensor shapes of a safetensors checkpoint, from the
        file sizes (scaled from the checkpoint's dtype) of a pickled one."""
        element = torch.empty((), dtype=dtype).element_size()
        stored = getattr(torch, str(self.config.checkpoint_dtype or "float32").replace("torch.", ""), torch.float32)
        total = 0
        for path in find_weight_files(self.folder):
            if path.suffix == ".safetensors":
                with safe_open(str(path), framework="pt") as weights:
                    total += sum(math.prod(weights.get_slice(name).get_shape()) for name in weights.keys()) * element
            else:
                total += path.stat().st_size * element // torch.empty((), dtype=stored).element_size()
        return total


@dataclass
class _DraftState:
    """What the draft holds for one sequence: K/V of `shadow.token_ids[:shadow.num_computed_tokens]`,
    in the sequence's blocks (the shadow shares its block table). Past `known` they are drafts."""

    shadow: Sequence
    preemptions: int
    known: int = 0
    generator: Optional[torch.Generator] = None
    drafts: list[int] = field(default_factory=list)
    probs: list[torch.Tensor] = field(default_factory=list)


class DraftProposer(AdaptiveProposer):
    def __init__(self, config: SpeculativeConfig, draft: DraftModel, target: RunnerConfig, num_blocks: int,
                 block_size: int, blocks: BlockManager):
        """`target` is the target runner's configuration: the draft runs on its device, in its dtype, on a
        pool of its `num_blocks` blocks of `block_size` tokens, whose allocation `blocks` tracks."""
        super().__init__(config)
        self.blocks = blocks
        self.max_tokens_per_round = target.max_num_batched_tokens
        self.block_size = block_size
        self.runner = ModelRunner(replace(
            target, model_config=draft.config, model_folder=draft.folder, block_size=block_size,
            num_kv_blocks=num_blocks, max_num_seqs=min(target.max_num_seqs, config.disable_by_batch_size),
            quantization=None, extra_kv_bytes_per_token=0, extra_reserved_bytes=0,
            # Whole in the engine's process, as vLLM's draft (its tensor-parallel size 1): the ranks run the
            # target only, and the draft's pool shares the block ids, not the heads.
            tensor_parallel=TensorParallel.single()))
        self.sampler = Sampler(self.runner.make_generator(target.seed + 1))  # for unseeded requests' drafts
        self._states: dict[int, _DraftState] = {}
        # Lowered after a draft forward ran out of memory (None: not lowered): the catch-up tokens and the
        # sequences one round drafts for.
        self._token_cap: Optional[int] = None
        self._seq_cap: Optional[int] = None
        self._rounds_since_shrink = 0
        logger.info("draft model %s: %d layers, %.1f MiB of weights", draft.folder, draft.config.num_layers,
                    self.runner.weight_bytes / 2**20)

    @property
    def kv_cache_bytes(self) -> int:
        return self.runner.kv_cache_bytes

    def propose(self, running: list[Sequence]) -> None:
        """Set `spec_token_ids` (and for sampled requests `spec_draft_probs`) of every running decode
        the batch-size gate, the adaptive window, the request's limits and the free blocks allow."""
        if not self._start_round(running):
            return  # touching nothing (see `_start_round`)
        pays = self._drafting_pays(running)
        live = {seq.seq_id for seq in running}
        self._states = {sid: state for sid, state in self._states.items() if sid in live}
        for seq in running:
            seq.spec_token_ids, seq.spec_draft_probs = [], None
        self._relax_caps()
        wanted = [(seq, k) for seq, k in ((seq, self._num_drafts(seq)) for seq in running) if k]
        if not pays:
            # A seeded sampled request's output depends on which of its steps drafted (the rejection
            # sampler's draws differ from a plain decode's), so the timing-based gate must not decide
            # for it: it drafts whenever the batch-size gate and its window allow, as without the gate.
            wanted = [(seq, k) for seq, k in wanted if seq.params.seed is not None and not seq.params.greedy]
            if not wanted:
                return
            self.cost_gate.skip_measurement()  # the step drafts for some: its time measures neither choice
        if self._seq_cap is not None:
            wanted = wanted[:self._seq_cap]
        # Slots for the last known token and the first k - 1 drafts: what the draft writes this round.
        wanted = [(seq, k) for seq, k in wanted if self.blocks.allocate(seq, 1, num_lookahead_tokens=k - 1)]
        wanted, rows = self._catch_up_rows(wanted)
        if not wanted:
            return
        try:
            self._draft(wanted, rows)
        except Exception as exc:  # noqa: BLE001 - only allocation failures are handled here
            if not is_out_of_memory(exc):
                raise
            cause = f"{type(exc).__name__}: {' '.join(str(exc).split())}"
        else:
            return
        # Outside the except block, so the traceback (and the activations its frames hold) is gone.
        self._after_out_of_memory(wanted, rows, cause)

    def _relax_caps(self) -> None:
        """Double lowered caps back every `OOM_RECOVERY_STEPS` rounds (one that reaches the configured
        value is dropped)."""
        if self._token_cap is None and self._seq_cap is None:
            return
        self._rounds_since_shrink += 1
        if self._rounds_since_shrink < OOM_RECOVERY_STEPS:
            return
        self._rounds_since_shrink = 0
        if self._token_cap is not None:
            self._token_cap = None if 2 * self._token_cap >= self.max_tokens_per_round else 2 * self._token_cap
        if self._seq_cap is not None:
            limit = self.runner.config.max_num_seqs
            self._seq_cap = None if 2 * self._seq_cap >= limit else max(1, 2 * self._seq_cap)

    def _after_out_of_memory(self, wanted: list[tuple[Sequence, int]], rows: list[ScheduledSeq],
                             cause: str) -> None:
        """A draft forward ran out of memory: no drafts this round (the sequences decode one token in the
        step), the round's lookahead blocks back, and smaller rounds for a while."""
        for seq, _ in wanted:
            seq.spec_token_ids, seq.spec_draft_probs = [], None
            self.blocks.free_lookahead(seq)
            state = self._states.get(seq.seq_id)
            if state is not None:  # its shadow counts only the K/V forwards that finished wrote
                state.drafts, state.probs = [], []
        self.runner.release_kept_state()  # the kept decode K/V may be half-updated
        if self.runner.device.type == "cuda":
            torch.cuda.empty_cache()
        self.num_oom_skips += 1
        longest = max(row.num_new_tokens for row in rows)
        if longest > self.block_size:
            self._token_cap = max(self.block_size, sum(row.num_new_tokens for row in rows) // 2)
        else:
            self._seq_cap = len(wanted) // 2  # 0: not even one sequence's round fits, none until the caps relax
        self._rounds_since_shrink = 0
        logger.warning("out of memory in the draft model's forward for %d sequence(s) (%s); these decode without "
                       "drafts this step, and draft rounds take at most %s token(s) and %s sequence(s) for a while",
                       len(wanted), cause, self._token_cap or self.max_tokens_per_round,
                       self.runner.config.max_num_seqs if self._seq_cap is None else self._seq_cap)

    def _num_drafts(self, seq: Sequence) -> int:
        """K, within the model's positions and the request's max_tokens (the token after the drafts is the
        last), as the scheduler will verify them; 0 for a sequence in prefill or with drafting off."""
        if seq.num_uncomputed_tokens != 1 or seq.seq_id in self._disabled:
            return 0
        room = min(self.config.num_speculative_tokens, self.runner.config.max_model_len - seq.num_tokens)
        if seq.params.max_tokens is not None:
            room = min(room, seq.params.max_tokens - len(seq.output_token_ids) - 1)
        return max(room, 0)

    def _catch_up_rows(self, wanted: list[tuple[Sequence, int]]) -> tuple[list[tuple[Sequence, int]],
                                                                           list[ScheduledSeq]]:
        """One row per sequence over the tokens its draft has not seen, within the round's token budget
        (a row that reaches the sequence's end samples the first draft); the sequences the budget leaves
        out get no drafts this round and their lookahead back."""
        kept, rows, budget = [], [], self._token_cap or self.max_tokens_per_round
        for seq, k in wanted:
            if not budget:
                self.blocks.free_lookahead(seq)
                continue
            state = self._catch_up_state(seq)
            take = min(seq.num_tokens - state.shadow.num_computed_tokens, budget)
            budget -= take
            kept.append((seq, k))
            rows.append(ScheduledSeq(state.shadow, take))
        return kept, rows

    def _draft(self, wanted: list[tuple[Sequence, int]], rows: list[ScheduledSeq]) -> None:
        active = [(seq, k, self._states[seq.seq_id]) for (seq, k), row in zip(wanted, rows) if row.samples]
        logits = self._run(rows)
        for row in rows:  # catch-up rows hold known tokens only
            self._states[row.seq.seq_id].known = row.seq.num_computed_tokens
        for step in range(max((k for _, k, _ in active), default=0)):
            self._draw(logits, active)
            active = [(seq, k, state) for seq, k, state in active if len(state.drafts) < k]
            if not active:
                break
            rows = []
            for _, _, state in active:  # feed the newest draft to get the next
                state.shadow.token_ids.append(state.drafts[-1])
                rows.append(ScheduledSeq(state.shadow, 1))
            logits = self._run(rows)
        for seq, _ in wanted:
            state = self._states[seq.seq_id]
            seq.spec_token_ids = state.drafts
            seq.spec_draft_probs = torch.stack(state.probs) if state.probs else None
            state.drafts, state.probs = [], []
            if not seq.spec_token_ids:  # still catching up: its lookahead would outlive the step
                self.blocks.free_lookahead(seq)

    def _catch_up_state(self, seq: Sequence) -> _DraftState:
        """The sequence's draft state, its shadow holding the sequence's tokens and, as computed, the
        longest prefix of them whose draft K/V still hold (drafts the target accepted count)."""
        state = self._states.get(seq.seq_id)
        if state is None or state.preemptions != seq.num_preemptions:  # new, or its blocks were freed
            shadow = Sequence(seq.seq_id, seq.request_id, seq.index, [], params=None)  # type: ignore[arg-type]
            generator = None
            if seq.params.seed is not None:
                generator = self.runner.make_generator(hash((seq.params.seed, seq.index, 1)) & (2**63 - 1))
            state = self._states[seq.seq_id] = _DraftState(shadow, seq.num_preemptions, generator=generator)
        shadow, tokens = state.shadow, seq.token_ids
        valid = state.known
        fed = shadow.token_ids
        while valid < min(shadow.num_computed_tokens, len(tokens) - 1) and fed[valid] == tokens[valid]:
            valid += 1
        if valid < shadow.num_computed_tokens:
            self.runner.truncate_kept_state(seq.seq_id, valid)
        shadow.token_ids = list(tokens)
        shadow.block_table = seq.block_table  # the target's table, the same list
        shadow.num_computed_tokens = valid
        state.known = min(state.known, valid)
        return state

    def _run(self, rows: list[ScheduledSeq]) -> torch.Tensor:
        logits = self.runner.sample_logits(rows)
        for row in rows:
            row.seq.num_computed_tokens += row.num_new_tokens
        return logits.float()

    def _draw(self, logits: torch.Tensor, active: list[tuple[Sequence, int, _DraftState]]) -> None:
        """One more draft per active sequence: the argmax for a greedy request, else a draw from the
        draft's distribution under the request's sampling settings (kept as its q)."""
        greedy = row_argmax(logits)
        for i, (seq, _, state) in enumerate(active):
            if seq.params.greedy:
                state.drafts.append(greedy[i])
                continue
            q = self.sampler.distribution(logits[i:i + 1], [seq.params])[0]
            generator = self.sampler.generator
            if state.generator is not None:  # keyed to the position it proposes for, as the target's draws are
                position = len(seq.output_token_ids) + len(state.drafts)
                generator = state.generator.manual_seed(position_seed(seq.draw_seed, position, DRAFT_STREAM))
            state.drafts.append(int(torch.multinomial(q, 1, generator=generator)))
            state.probs.append(q)
