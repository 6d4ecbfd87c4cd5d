"""Verify rows (the seam speculative decoding plugs into): a decode that carries k draft tokens runs as
one row of k + 1 tokens, the model's k + 1 choices come back, the drafts it agrees with are kept and
the rest rolled back before any block is published. No proposer exists yet, so the tests set the
drafts (`Sequence.spec_token_ids`) themselves, from a reference run that decoded one token a step."""

from __future__ import annotations

import pytest
import torch

from llmctl.engine import LLM, EngineArgs, SamplingParams
from llmctl.engine.executor.uniproc_executor import UniProcExecutor
from llmctl.engine.llm_engine import LLMEngine
from llmctl.engine.sequence import Sequence

BLOCK_SIZE = 4
NUM_BLOCKS = 37  # a size no other KV axis has, so the tests can find the block axis in any layout
PROMPT = [5, 17, 42, 99, 7]  # 5 tokens: the verify row below crosses into a third block


def _llm(folder) -> LLM:
    return LLM(str(folder), device="cpu", dtype="float32", block_size=BLOCK_SIZE, num_kv_blocks=NUM_BLOCKS,
               max_model_len=64, max_num_seqs=4, max_num_batched_tokens=64, enable_prefix_caching=True)


@pytest.fixture()
def pair(tiny_chat_model):
    """A reference engine and one that verifies drafts, identical otherwise."""
    return _llm(tiny_chat_model).engine, _llm(tiny_chat_model).engine


def _only_seq(engine) -> Sequence:
    (seq,) = engine.scheduler.running
    return seq


def _kv_at(engine, seq: Sequence, positions: range) -> list[torch.Tensor]:
    """Each layer's K and V at `positions` of `seq`, read through its block table."""
    runner = engine.executor.runner
    shape = runner.attention.kv_cache_shape(runner.num_blocks, runner.block_size)
    axis = 1 + next(i for i in range(len(shape) - 1) if shape[i] == NUM_BLOCKS and shape[i + 1] == BLOCK_SIZE)
    layers = []
    for cache in runner.kv_caches:  # [2, *shape]
        by_slot = cache.movedim(axis, 1).movedim(axis + 1, 2)  # [2, blocks, block_size, ...]
        layers.append(torch.stack([by_slot[:, seq.block_table[p // BLOCK_SIZE], p % BLOCK_SIZE] for p in positions]))
    return layers


def _prefix_cache(engine) -> set[tuple]:
    """The published blocks: (block id, token ids, the block id of its parent)."""
    blocks = engine.block_manager.blocks
    by_hash = {b.block_hash: b.block_id for b in blocks if b.block_hash is not None}
    return {(b.block_id, b.token_ids, by_hash.get(b.parent_hash)) for b in blocks if b.block_hash is not None}


def test_a_4_token_verify_row_accepting_2_leaves_what_two_decodes_leave(pair):
    reference, verifying = pair
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    for engine in pair:
        engine.add_request("r", PROMPT, params)
        engine.step()  # the prompt: 5 computed tokens, one sampled
    reference.step()
    reference.step()  # two decodes, one token each
    ref = _only_seq(reference)
    first, second = ref.output_token_ids[1:3]

    seq = _only_seq(verifying)
    # Drafts: the token the model decodes next, then a wrong one, then any: the row is [last, d0, d1, d2].
    seq.spec_token_ids = [first, (second + 1) % verifying.vocab_size, 3]
    step = verifying.step()
    assert step.num_batched_tokens == 4
    assert seq.output_token_ids == ref.output_token_ids  # d0 accepted, then the model's own token
    assert seq.token_ids == ref.token_ids and seq.num_computed_tokens == ref.num_computed_tokens == 7
    # The third block held only the rejected d2's lookahead slot: it went back to the pool.
    assert seq.block_table == ref.block_table and len(seq.block_table) == 2
    assert verifying.block_manager.num_free_blocks == reference.block_manager.num_free_blocks
    # Positions 4..7 (the second block) held d1 in the verify row; it is not full of computed tokens,
    # so it was not published: the prefix cache is the reference's, block for block.
    assert _prefix_cache(verifying) == _prefix_cache(reference)
    for got, want in zip(_kv_at(verifying, seq, range(7)), _kv_at(reference, ref, range(7))):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    # And the next steps go on as the reference does (the kept decode K/V is refilled, not stale).
    while verifying.has_unfinished_requests() or reference.has_unfinished_requests():
        verifying.step()
        reference.step()
    assert seq.output_token_ids == ref.output_token_ids
    for engine in pair:
        engine.block_manager.check_invariants([])
        assert engine.block_manager.num_free_blocks == NUM_BLOCKS


@pytest.mark.parametrize("drafts", ["right", "wrong", "half-right"])
def test_verify_rows_every_step_give_the_reference_output(tiny_chat_model, drafts):
    """Greedy decoding with drafts taken from the reference's output (all right, all wrong, or only the
    first one right) produces exactly the reference's tokens, in as many steps as the right drafts
    save, and every block comes back."""
    params = SamplingParams(max_tokens=21, temperature=0.0, ignore_eos=True)
    plain = _llm(tiny_chat_model)
    want = plain.generate([PROMPT, PROMPT[::-1]], params)
    wanted = {f"r{i}": o.outputs[0].token_ids for i, o in enumerate(want)}

    engine = _llm(tiny_chat_model).engine
    for i, prompt in enumerate([PROMPT, PROMPT[::-1]]):
        engine.add_request(f"r{i}", prompt, params)
    steps = 0
    while engine.has_unfinished_requests():
        for seq in engine.scheduler.running:
            future = wanted[seq.request_id][len(seq.output_token_ids):][:3]
            if drafts == "wrong":
                future = [(t + 1) % engine.vocab_size for t in future]
            elif drafts == "half-right":
                future = future[:1] + [(t + 1) % engine.vocab_size for t in future[1:]]
            seq.spec_token_ids = future
        for output in engine.step().outputs:
            if output.finished:
                assert output.outputs[0].token_ids == wanted[output.request_id]
                assert output.outputs[0].finish_reason == "length"
        steps += 1
    # The prefill step samples the first token; each later step keeps 1 + the right drafts (of 3).
    assert steps == {"right": 1 + 20 // 4, "half-right": 1 + 20 // 2, "wrong": 1 + 20}[drafts]
    engine.block_manager.check_invariants([])
    assert engine.block_manager.num_free_blocks == NUM_BLOCKS


def test_a_stop_token_among_the_accepted_drafts_ends_the_output_there(tiny_chat_model):
    plain = _llm(tiny_chat_model)
    greedy = dict(temperature=0.0, ignore_eos=True)
    tokens = plain.generate([PROMPT], SamplingParams(max_tokens=12, **greedy))[0].outputs[0].token_ids
    at = next(i for i in range(2, len(tokens)) if tokens[i] not in tokens[:i])  # first occurrence
    params = SamplingParams(max_tokens=12, stop_token_ids=[tokens[at]], **greedy)
    want = plain.generate([PROMPT], params)[0].outputs[0]
    assert want.token_ids == tokens[: at + 1] and want.stop_reason == tokens[at]

    engine = _llm(tiny_chat_model).engine
    engine.add_request("r", PROMPT, params)
    engine.step()  # the prompt
    while engine.has_unfinished_requests():
        seq = _only_seq(engine)
        seq.spec_token_ids = tokens[len(seq.output_token_ids):][:4]  # right drafts, running past the stop
        outputs = engine.step().outputs
    (got,) = [o.outputs[0] for o in outputs]
    assert (got.token_ids, got.finish_reason, got.stop_reason) == (want.token_ids, "stop", tokens[at])
    engine.block_manager.check_invariants([])
    assert engine.block_manager.num_free_blocks == NUM_BLOCKS


def test_a_stop_string_completed_inside_a_verify_row_takes_the_tokens_after_it_back(tiny_chat_model):
    plain = _llm(tiny_chat_model)
    greedy = dict(temperature=0.0, ignore_eos=True)
    free = plain.generate([PROMPT], SamplingParams(max_tokens=16, **greedy))[0].outputs[0]
    stop = free.text[len(free.text) // 2:][:2]
    assert stop.strip(), "the tiny model's text has a visible middle to stop on"
    params = SamplingParams(max_tokens=16, stop=[stop], **greedy)
    want = plain.generate([PROMPT], params)[0].outputs[0]
    assert want.finish_reason == "stop" and len(want.token_ids) < 16

    engine = _llm(tiny_chat_model).engine
    engine.add_request("r", PROMPT, params)
    engine.step()
    while engine.has_unfinished_requests():
        seq = _only_seq(engine)
        seq.spec_token_ids = free.token_ids[len(seq.output_token_ids):][:4]  # right drafts, past the stop
        outputs = engine.step().outputs
    (got,) = [o.outputs[0] for o in outputs]
    assert (got.text, got.token_ids, got.finish_reason, got.stop_reason) == (
        want.text, want.token_ids, "stop", stop)
    assert engine.block_manager.num_free_blocks == NUM_BLOCKS


class ProtocolOnly:
    """An executor with the `Executor` methods and nothing else (no `runner` to reach through), as a
    multi-rank one would be: the engine must run on it unchanged."""

    def __init__(self, config):
        inner = UniProcExecutor(config)
        self.calls: list[str] = []
        for name in ("num_blocks", "block_size", "device", "dtype", "weight_bytes", "max_concurrent_batches"):
            setattr(self, name, getattr(inner, name))
        self.kv_cache_bytes = inner.kv_cache_bytes
        for name in ("execute", "make_generator", "truncate_kept_state", "release_kept_state",
                     "release_after_out_of_memory", "check_health", "shutdown"):
            setattr(self, name, self._recorded(name, getattr(inner, name)))

    def _recorded(self, name, method):
        def call(*args):
            self.calls.append(name)
            return method(*args)
        return call


def test_the_engine_runs_on_any_executor_with_the_protocols_methods(tiny_chat_model):
    args = EngineArgs(model=str(tiny_chat_model), device="cpu", dtype="float32", block_size=BLOCK_SIZE,
                      num_kv_blocks=NUM_BLOCKS, max_model_len=64)
    engine = LLMEngine(args, executor_class=ProtocolOnly)
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, seed=3)
    want = _llm(tiny_chat_model).generate([PROMPT], params)[0].outputs[0].token_ids
    engine.add_request("r", PROMPT, params)
    engine.step()
    _only_seq(engine).spec_token_ids = [(want[1] + 1) % engine.vocab_size, 2]  # a verify row, rejected
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step().outputs
    assert outputs[-1].outputs[0].token_ids == want
    assert set(engine.executor.calls) == {"execute", "make_generator", "truncate_kept_state", "release_kept_state"}
