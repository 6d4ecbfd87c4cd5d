"""Out of memory inside a step: the engine undoes the step, retries it smaller (shorter prefill
chunk, fewer sequences, preempting the rest) and keeps a lowered budget for a while; only a request
that does not fit even alone at the smallest chunk fails, with a capacity error (HTTP 503 with
Retry-After). Bystanders finish with the tokens of an OOM-free run and no KV block leaks.

The OOM is injected where a real one happens: a forward pre-hook on the last layer's MLP (the
largest activation of a step, after every layer has written its KV slots) raises what torch raises,
`torch.OutOfMemoryError` with CUDA's message, or the CPU allocator's own RuntimeError from a real
allocation that cannot succeed."""

from __future__ import annotations

import asyncio
import json
import logging
import re
from typing import Optional

import httpx
import pytest
import torch

from llmctl.engine import LLM, SamplingParams
from llmctl.engine.block_manager import BlockManager
from llmctl.engine.scheduler import OOM_RECOVERY_STEPS, Scheduler, SchedulerConfig
from llmctl.engine.sequence import Sequence
from server_helpers import running_server

GREEDY = dict(temperature=0.0, ignore_eos=True)
OOM_LOG = re.compile(r"out of memory in a step|does not fit in free device memory")


class InjectedOOM:
    """Run the model out of memory when a step has more than `max_tokens` tokens or `max_seqs`
    sequences, or a sequence's context passes `max_context`, as a device with less free memory would."""

    def __init__(self, runner, *, max_tokens: Optional[int] = None, max_context: Optional[int] = None,
                 max_seqs: Optional[int] = None, kind: str = "cuda"):
        self.max_tokens, self.max_context, self.max_seqs, self.kind = max_tokens, max_context, max_seqs, kind
        self.events: list[tuple[int, int]] = []  # (tokens, longest context) of each step it failed
        self._context = self._seqs = 0
        model = runner.model
        self._handles = [model.register_forward_pre_hook(self._note_batch),
                         model.model.layers[-1].mlp.register_forward_pre_hook(self._allocate)]

    def _note_batch(self, _module, args) -> None:
        _ids, positions, _kv, meta = args[:4]
        self._context = int(positions.max()) + 1  # the longest context in the batch
        self._seqs = meta.num_rows

    def _allocate(self, _module, args) -> None:
        tokens = args[0].shape[0]
        over = ((self.max_tokens is not None and tokens > self.max_tokens)
                or (self.max_context is not None and self._context > self.max_context)
                or (self.max_seqs is not None and self._seqs > self.max_seqs))
        if not over:
            return
        self.events.append((tokens, self._context))
        if self.kind == "cuda":
            raise torch.OutOfMemoryError(
                f"CUDA out of memory. Tried to allocate {tokens * 6:.2f} MiB. GPU 0 has a total capacity of "
                "79.25 GiB of which 10.69 MiB is free. Of the allocated memory 77.00 GiB is allocated by "
                "PyTorch, and 1.52 GiB is reserved by PyTorch but unallocated.")
        torch.empty((tokens, 1 << 42), dtype=torch.float32)  # the CPU allocator refuses 16 TiB per token

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()


def ids(length: int, start: int = 10) -> list[int]:
    return [(start + 7 * i) % 500 + 5 for i in range(length)]


def assert_all_free(llm: LLM) -> None:
    engine = llm.engine
    engine.block_manager.check_invariants([])
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    assert not engine.requests and not engine.scheduler.has_unfinished


def _tiny_llm(folder, caching: bool) -> LLM:
    return LLM(str(folder), device="cpu", dtype="float32", max_model_len=256, num_kv_blocks=96,
               max_num_batched_tokens=128, max_num_seqs=8, enable_prefix_caching=caching)


@pytest.fixture(scope="module")
def llm(tiny_chat_model) -> LLM:
    """Prefix caching off, so a repeated prompt is computed again in full (and can run out of memory)."""
    return _tiny_llm(tiny_chat_model, caching=False)


@pytest.fixture(scope="module")
def caching_llm(tiny_chat_model) -> LLM:
    return _tiny_llm(tiny_chat_model, caching=True)


def _reset_budgets(llm: LLM) -> None:
    """Each test starts from the configured budgets (a module-scoped engine remembers OOMs)."""
    for _ in range(8 * OOM_RECOVERY_STEPS):
        sched = llm.engine.scheduler
        if sched.token_budget == sched.config.max_num_batched_tokens and sched.max_num_seqs == sched.config.max_num_seqs:
            return
        llm.generate([ids(4, 99)], SamplingParams(max_tokens=OOM_RECOVERY_STEPS, **GREEDY))
    raise AssertionError("the lowered budgets never recovered")


@pytest.mark.parametrize("engine", ["llm", "caching_llm"])
def test_bystanders_of_an_oom_batch_finish_with_the_reference_tokens(engine, request, caplog):
    """With the prefix cache on, the rerun's prompts hit the cache: undoing a step must give the
    shared blocks back without losing them from the cache."""
    llm = request.getfixturevalue(engine)
    _reset_budgets(llm)
    prompts = [ids(n, start) for n, start in ((60, 1), (45, 2), (30, 3), (20, 4), (12, 5), (5, 6))]
    params = [SamplingParams(max_tokens=m, **GREEDY) for m in (12, 9, 14, 10, 16, 11)]
    reference = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    retries_before = llm.engine.num_oom_retries

    oom = InjectedOOM(llm.engine.executor.runner, max_tokens=40)
    caplog.set_level(logging.WARNING, logger="llmctl.engine.llm_engine")
    try:
        outputs = llm.generate(prompts, params)
    finally:
        oom.remove()

    assert oom.events, "the injected OOM never fired: the test exercises nothing"
    assert [o.outputs[0].token_ids for o in outputs] == reference
    assert all(o.error is None and o.outputs[0].finish_reason == "length" for o in outputs)
    assert llm.engine.num_oom_retries - retries_before == len(oom.events)
    sched = llm.engine.scheduler  # remembered, so the next steps do not hit it again
    assert sched.token_budget <= 40 or sched.max_num_seqs < sched.config.max_num_seqs
    # one log line per OOM, no traceback
    lines = [r for r in caplog.records if OOM_LOG.search(r.getMessage())]
    assert len(lines) == len(oom.events) and not any(r.exc_info for r in lines)
    assert_all_free(llm)


def test_a_prefill_chunk_that_runs_out_of_memory_succeeds_after_shrinking(llm):
    _reset_budgets(llm)
    prompt, params = ids(100, 7), SamplingParams(max_tokens=6, **GREEDY)
    reference = llm.generate([prompt], params)[0].outputs[0].token_ids

    oom = InjectedOOM(llm.engine.executor.runner, max_tokens=30, kind="cpu")
    try:
        output = llm.generate([prompt], params)[0]
    finally:
        oom.remove()

    assert [tokens for tokens, _ in oom.events] == [100, 50]  # 100 -> 50 -> 25 tokens per chunk
    assert output.error is None and output.outputs[0].token_ids == reference
    assert llm.engine.scheduler.token_budget == 25
    assert_all_free(llm)


def test_a_request_too_large_even_alone_fails_with_a_capacity_error_and_the_rest_finish(llm):
    _reset_budgets(llm)
    prompts = [ids(150, 3), ids(10, 4), ids(20, 5), ids(8, 6)]
    params = SamplingParams(max_tokens=10, **GREEDY)
    reference = [o.outputs[0].token_ids for o in llm.generate(prompts[1:], params)]

    oom = InjectedOOM(llm.engine.executor.runner, max_context=100)  # attention over >100 tokens does not fit
    try:
        outputs = llm.generate(prompts, params)
    finally:
        oom.remove()

    big = outputs[0]
    assert type(big.error).__name__ == "CapacityError" and "does not fit in free device memory" in str(big.error)
    assert big.finished and big.outputs[0].finish_reason == "abort"
    assert big.error.retry_after_s > 0
    assert [o.outputs[0].token_ids for o in outputs[1:]] == reference
    assert all(o.error is None for o in outputs[1:])
    assert llm.engine.num_capacity_errors >= 1
    assert json.loads(json.dumps(big.to_dict()))["error"] == str(big.error)
    assert_all_free(llm)


def test_running_sequences_over_a_lowered_cap_are_preempted_and_recomputed(llm):
    """Decode batches run out of memory: the sequence count halves, the newest running ones are
    preempted by recompute, and their outputs still equal the OOM-free run."""
    _reset_budgets(llm)
    prompts = [ids(6, s) for s in range(8)]
    params = SamplingParams(max_tokens=20, **GREEDY)
    reference = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    preemptions_before = llm.engine.scheduler.num_preemptions

    oom = InjectedOOM(llm.engine.executor.runner)

    def tighten_once_decoding(_index, output):  # all 8 prefilled together; then only 3 rows fit
        if len(output.outputs[0].token_ids) >= 2:
            oom.max_seqs = 3

    try:
        outputs = llm.generate(prompts, params, on_output=tighten_once_decoding)
    finally:
        oom.remove()

    assert [o.outputs[0].token_ids for o in outputs] == reference
    assert [tokens for tokens, _ in oom.events][:2] == [8, 4]  # 8 -> 4 -> 2 decode rows
    assert llm.engine.scheduler.max_num_seqs < 8  # 2, or 4 once it has doubled back after 64 steps
    assert llm.engine.scheduler.num_preemptions - preemptions_before >= 6
    assert_all_free(llm)


# ---- the scheduler's budgets ------------------------------------------------------------------------
def _scheduler(budget=64, max_num_seqs=8, block_size=4) -> Scheduler:
    config = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget, max_model_len=1024)
    return Scheduler(config, BlockManager(256, block_size))


def _seq(seq_id: int, length: int) -> Sequence:
    return Sequence(seq_id, f"r{seq_id}", 0, list(range(length)), SamplingParams())


def test_undo_returns_admissions_and_their_blocks_and_keeps_the_pool_consistent():
    sched = _scheduler()
    seqs = [_seq(i, 10) for i in range(3)]
    for seq in seqs:
        sched.add(seq)
    out = sched.schedule()
    assert len(out.admitted) == 3 and sched.blocks.num_free_blocks < 256
    sched.undo(out)
    assert not sched.running and sorted(s.seq_id for s in sched.waiting) == [0, 1, 2]
    assert all(s.num_computed_tokens == 0 and not s.block_table for s in seqs)
    assert sched.blocks.num_free_blocks == 256
    sched.blocks.check_invariants(seqs)
    assert [s.num_new_tokens for s in sched.schedule().scheduled] == [10, 10, 10]  # same plan again


def test_budgets_halve_then_double_back_to_the_configured_ones():
    sched = _scheduler(budget=64, max_num_seqs=8)
    for i in range(8):
        sched.add(_seq(i, 30))
    out = sched.schedule()
    assert out.num_batched_tokens == 64
    sched.undo(out)
    assert sched.shrink_after_oom(out) and sched.token_budget == 32 and sched.max_num_seqs == 8
    out = sched.schedule()
    assert out.num_batched_tokens == 32
    for _ in range(OOM_RECOVERY_STEPS - 1):
        sched.schedule()
    assert sched.token_budget == 64  # doubled back to the configured budget: no cap left
    assert sched.stats()["token_budget"] == 64


def test_decode_batches_halve_the_sequence_count_and_preempt_the_newest():
    sched = _scheduler(budget=64, max_num_seqs=8)
    seqs = [_seq(i, 3) for i in range(6)]
    for seq in seqs:
        sched.add(seq)
    prefill = sched.schedule()
    for item in prefill.scheduled:
        item.seq.num_computed_tokens += item.num_new_tokens
        item.seq.append_token(1)
    decode = sched.schedule()
    assert len(decode.scheduled) == 6
    sched.undo(decode)
    assert sched.shrink_after_oom(decode) and sched.max_num_seqs == 3
    out = sched.schedule()
    assert [s.seq.seq_id for s in out.scheduled] == [0, 1, 2]
    assert sorted(s.seq_id for s in out.preempted) == [3, 4, 5]
    assert all(s.num_computed_tokens == 0 and not s.block_table for s in seqs[3:])
    sched.blocks.check_invariants(seqs)


def test_one_sequence_at_one_block_cannot_shrink():
    sched = _scheduler(block_size=4)
    sched.add(_seq(0, 4))
    out = sched.schedule()
    assert not sched.shrink_after_oom(out)


# ---- the server -------------------------------------------------------------------------------------
def test_server_answers_503_with_retry_after_for_the_request_that_cannot_fit_and_200_for_the_rest():
    # float32: recomputed bystanders (preempted by the shrinking) must match the reference token for token
    with running_server(engine_options={"dtype": "float32"}, max_waiting_requests=64) as srv:
        bystanders = [{"prompt": f"ROMEO {i}:", "max_tokens": 24, "temperature": 0, "ignore_eos": True}
                      for i in range(4)]
        oversized = {"prompt": ids(300, 11), "max_tokens": 4, "temperature": 0, "ignore_eos": True}

        async def run_all(with_oversized: bool):
            async with httpx.AsyncClient(base_url=srv.base_url, timeout=120) as http:
                jobs = [http.post("/v1/completions", json=body) for body in bystanders]
                if with_oversized:
                    jobs.insert(1, http.post("/v1/completions", json=oversized))
                    jobs.append(_stream_events(http, {**oversized, "stream": True}))
                return await asyncio.gather(*jobs)

        reference = [r.json()["choices"][0]["text"] for r in asyncio.run(run_all(False))]
        oom = InjectedOOM(srv.engine.engine.executor.runner, max_context=200)
        try:
            responses = asyncio.run(run_all(True))
        finally:
            oom.remove()

        big, events = responses.pop(1), responses.pop()
        assert big.status_code == 503, big.text
        assert int(big.headers["retry-after"]) > 0
        error = big.json()["error"]
        assert error["code"] == "insufficient_capacity" and error["type"] == "service_unavailable"
        assert "does not fit in free device memory" in error["message"]
        assert [r.status_code for r in responses] == [200] * 4
        assert [r.json()["choices"][0]["text"] for r in responses] == reference
        assert events[-1] == "[DONE]" and json.loads(events[-2])["error"]["code"] == "insufficient_capacity"

        stats = srv.wait_idle()  # no request left, every KV block free
        assert stats["num_capacity_errors"] == 2
        metrics = httpx.get(srv.base_url + "/metrics").text
        retries = _metric(metrics, "llmctl:num_oom_retries_total")
        assert retries == stats["num_oom_retries"] > 0
        assert _metric(metrics, "llmctl:num_capacity_errors_total") == 2
        assert srv.engine.is_healthy


async def _stream_events(http: httpx.AsyncClient, body: dict) -> list[str]:
    async with http.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200
        return [line[len("data: "):] async for line in response.aiter_lines() if line.startswith("data: ")]


def _metric(text: str, name: str) -> float:
    match = re.search(rf"^{re.escape(name)}{{[^}}]*}} (\S+)$", text, re.MULTILINE)
    assert match, f"{name} missing from /metrics"
    return float(match.group(1))


# ---- llmctl generate ---------------------------------------------------------------------------------
def test_generate_prints_the_prompts_that_fit_and_fails_in_one_line_for_the_one_that_does_not(
        tiny_chat_model, tmp_path, monkeypatch, capsys):
    from llmctl.cli import run

    real = LLM.from_engine_args

    def with_injected_oom(args):  # the real engine on a device whose memory ends at a 64-token context
        llm = real(args)
        InjectedOOM(llm.engine.executor.runner, max_context=64)
        return llm

    monkeypatch.setattr(LLM, "from_engine_args", with_injected_oom)
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("short one\n" + "To be, or not to be " * 30 + "\nshort two\n")
    code = run(["generate", "-f", str(prompts), "-m", str(tiny_chat_model), "--json", "--max-tokens", "4",
                "--temperature", "0", "--ignore-eos", "--device", "cpu"])
    captured = capsys.readouterr()
    rows = [json.loads(line) for line in captured.out.splitlines()]
    assert code == 1
    assert [r["error"] is None for r in rows] == [True, False, True]
    assert [r["completion_tokens"] for r in rows[::2]] == [4, 4]
    assert rows[1]["finish_reason"] == "abort" and "does not fit in free device memory" in rows[1]["error"]
    last = captured.err.strip().splitlines()[-1]
    assert last.startswith("llmctl: error: 1 of 3 prompt(s) failed; prompt 1: request") and "Traceback" not in captured.err
