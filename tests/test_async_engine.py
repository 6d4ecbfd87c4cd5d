"""`AsyncLLMEngine`: warm-up before ready, continuous batching from asyncio, abort, admission
control, deadlines, and fault isolation (a failing step fails only its requests; a fatal failure
fails everything pending at once and turns the engine unhealthy)."""

from __future__ import annotations

import asyncio
import threading
import time

import httpx
import pytest

from llmctl.engine import AsyncLLMEngine, EngineArgs, SamplingParams
from llmctl.engine.errors import (EngineDeadError, EngineOverloadedError, InvalidRequestError,
                                  RequestTimeoutError, StepFailedError)
from server_helpers import running_server

GREEDY = dict(temperature=0.0, ignore_eos=True)


@pytest.fixture
def engine():
    eng = AsyncLLMEngine.from_engine_args(EngineArgs(device="cpu"), max_waiting_requests=64)
    yield eng
    eng.shutdown()


def _free(eng: AsyncLLMEngine) -> bool:
    stats = eng.get_stats()
    return stats["num_free_blocks"] == stats["num_total_blocks"] and stats["num_requests"] == 0


def _wait_free(eng: AsyncLLMEngine, timeout: float = 5.0) -> bool:
    """The stats snapshot is published just after the final output: poll briefly."""
    deadline = time.monotonic() + timeout
    while not _free(eng):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


async def _run(eng: AsyncLLMEngine, request_id: str, max_tokens: int = 8, prompt="ROMEO:"):
    final = None
    async for output in eng.generate(prompt, SamplingParams(max_tokens=max_tokens, **GREEDY), request_id):
        final = output
    return final


def _poison_runner(eng: AsyncLLMEngine, poisoned: set[str], message: str = "boom"):
    """Make every step that runs a poisoned request raise, as an OOM or kernel failure would."""
    runner = eng.engine.executor.runner
    original = runner.execute

    def execute(scheduled, rows):
        if any(item.seq.request_id in poisoned for item in scheduled):
            raise RuntimeError(message)
        return original(scheduled, rows)

    runner.execute = execute


def test_not_ready_until_warmed_up_then_serves(engine):
    assert not engine.is_ready

    async def refused():
        with pytest.raises(EngineOverloadedError, match="warming up"):
            await engine.add_request("early", "x", SamplingParams())

    asyncio.run(refused())
    engine.start()
    assert engine.is_ready and engine.is_healthy
    async def main():
        return await asyncio.gather(*[_run(engine, f"r{i}", 4 + i) for i in range(6)])

    outputs = asyncio.run(main())
    assert [len(o.outputs[0].token_ids) for o in outputs] == [4, 5, 6, 7, 8, 9]
    assert _wait_free(engine)


def test_model_info_is_read_only_and_names_the_models_facts(engine):
    import dataclasses

    info = engine.model_info
    assert info.max_model_len == engine.engine.max_model_len and info.vocab_size == engine.engine.vocab_size
    assert info.tokenizer is engine.engine.tokenizer and info.bos_token_id == info.tokenizer.bos_token_id
    assert info.eos_token_ids == engine.engine.eos_token_ids and info.eos_token_ids
    assert info.model.endswith("default_model")
    executor = engine.engine.executor
    assert (info.weight_bytes, info.kv_cache_bytes) == (executor.weight_bytes, executor.kv_cache_bytes)
    assert info.kv_cache_bytes == executor.num_blocks * executor.runner.bytes_per_block > 0
    assert info.dtype == str(executor.dtype).removeprefix("torch.") and info.quantization is None
    with pytest.raises(dataclasses.FrozenInstanceError):
        info.max_model_len = 1


def test_invalid_request_raises_at_submission(engine):
    engine.start()

    async def main():
        with pytest.raises(InvalidRequestError, match="outside the vocabulary"):
            await engine.add_request("bad", [10**7], SamplingParams())
        await _run(engine, "dup-check")
        return engine.get_stats()

    asyncio.run(main())
    assert _wait_free(engine)


def test_leaving_the_stream_aborts_and_frees_blocks(engine):
    engine.start()

    async def main():
        seen = 0
        async for _ in engine.generate("A long tale", SamplingParams(max_tokens=400, **GREEDY), "leaver"):
            seen += 1
            if seen == 3:
                break
        for _ in range(200):
            if _free(engine):
                return True
            await asyncio.sleep(0.01)
        return False

    assert asyncio.run(main())


def test_a_reader_that_stops_reading_holds_one_output(engine):
    # A stalled SSE client stops taking outputs while the engine keeps stepping: the stream keeps
    # only the newest (cumulative) one, and the reader then sees it complete.
    engine.start()

    async def main():
        params = SamplingParams(max_tokens=60, n=4, logprobs=5, **GREEDY)
        stream = await engine.add_request("stalled", engine.model_info.tokenizer.encode("A tale"), params)
        backlogs = []
        while _free(engine):  # until the engine reports it running
            await asyncio.sleep(0.005)
        while not _free(engine):
            backlogs.append(stream.backlog)
            await asyncio.sleep(0.01)
        outputs = [output async for output in stream]
        return max(backlogs), outputs

    worst, outputs = asyncio.run(main())
    assert worst <= 2  # one output (+ the final one): it was one per step
    assert len(outputs) == 1 and outputs[0].finished
    assert [len(c.token_ids) for c in outputs[0].outputs] == [60] * 4


def test_a_lagging_reader_of_deltas_gets_the_missed_ones_concatenated(engine):
    # With RequestOutputKind.DELTA a stalled reader's pending delta is appended to, not replaced:
    # it still holds one output, and what it reads adds up to what a cumulative reader gets.
    from llmctl.engine import RequestOutputKind

    engine.start()
    tokens = engine.model_info.tokenizer.encode("A tale")
    params = dict(max_tokens=40, n=3, logprobs=3, temperature=0.0, ignore_eos=True)

    async def read(stream, stall: bool):
        backlogs = []
        if stall:
            while _free(engine):
                await asyncio.sleep(0.005)
            while not _free(engine):
                backlogs.append(stream.backlog)
                await asyncio.sleep(0.01)
        return backlogs, [output async for output in stream]

    async def main():
        lagging = await engine.add_request("lagging", tokens, SamplingParams(
            **params, output_kind=RequestOutputKind.DELTA))
        backlogs, deltas = await read(lagging, stall=True)
        whole = await engine.add_request("whole", tokens, SamplingParams(**params))
        return backlogs, deltas, (await read(whole, stall=False))[1][-1]

    backlogs, deltas, whole = asyncio.run(main())
    assert max(backlogs) <= 1 and len(deltas) == 1 and deltas[0].finished
    assert [(c.text, c.token_ids, c.logprobs) for c in deltas[0].outputs] == [
        (c.text, c.token_ids, c.logprobs) for c in whole.outputs]
    assert all(len(c.token_ids) == 40 for c in deltas[0].outputs)


def test_request_stream_appends_deltas_and_replaces_cumulative_outputs():
    from llmctl.engine.async_engine import RequestStream
    from llmctl.engine.outputs import CompletionOutput, RequestOutput

    def out(pieces, finished=False):  # pieces: (index, text, token ids)
        return RequestOutput("r", None, [1], [CompletionOutput(i, text, ids, None, None) for i, text, ids in pieces],
                             finished)

    async def main(aggregate: bool):
        stream = RequestStream("r", asyncio.get_running_loop(), lambda _rid: None, aggregate=aggregate)
        for item in (out([(0, "a", [1])]), out([(1, "x", [7])]), out([(0, "b", [2]), (1, "y", [8])]),
                     out([(0, "c", [3])], finished=True)):
            stream.put_now(item)
        backlog = stream.backlog
        return backlog, [o async for o in stream]

    backlog, read = asyncio.run(main(aggregate=True))
    assert backlog == 1 and len(read) == 1 and read[0].finished
    assert [(c.index, c.text, c.token_ids) for c in read[0].outputs] == [(0, "abc", [1, 2, 3]), (1, "xy", [7, 8])]
    backlog, read = asyncio.run(main(aggregate=False))  # cumulative: the newest is all there is to read
    assert backlog == 1 and [(c.index, c.text) for c in read[0].outputs] == [(0, "c")]


def test_admission_control_refuses_beyond_the_waiting_limit():
    eng = AsyncLLMEngine.from_engine_args(EngineArgs(device="cpu", max_num_seqs=1), max_waiting_requests=1)
    eng.start()
    frozen, release = threading.Event(), threading.Event()

    def hold_when_one_waits(_step, stats):  # freeze the engine so the first request cannot finish first
        if stats.get("num_waiting", 0) >= 1 and not release.is_set():
            frozen.set()
            release.wait(30)

    eng.add_step_listener(hold_when_one_waits)
    try:
        async def main():
            first = asyncio.create_task(_run(eng, "running", 300))
            while eng.get_stats()["num_running"] < 1:
                await asyncio.sleep(0.005)
            second = asyncio.create_task(_run(eng, "waiting", 2))
            assert await asyncio.to_thread(frozen.wait, 30)
            try:
                with pytest.raises(EngineOverloadedError, match="over capacity"):
                    await eng.add_request("refused", "x", SamplingParams())
            finally:
                release.set()
            return await asyncio.gather(first, second)

        outputs = asyncio.run(main())
        assert [len(o.outputs[0].token_ids) for o in outputs] == [300, 2]
    finally:
        release.set()
        eng.shutdown()


def test_deadline_aborts_the_request():
    # 10 ms: the default model's 500 tokens took 85 ms on a fast host (Zen 5), inside the 0.1 s this had before
    eng = AsyncLLMEngine.from_engine_args(EngineArgs(device="cpu"), request_timeout_s=0.01)
    eng.start()
    try:
        with pytest.raises(RequestTimeoutError):
            asyncio.run(_run(eng, "slow", 500))
        assert _wait_free(eng)
    finally:
        eng.shutdown()


def test_a_failing_step_fails_only_its_requests_and_the_engine_serves_on(engine):
    engine.start()
    _poison_runner(engine, {"poison"})

    async def main():
        with pytest.raises(StepFailedError, match="boom"):
            await _run(engine, "poison")
        return await _run(engine, "after", 5)

    assert len(asyncio.run(main()).outputs[0].token_ids) == 5
    assert engine.is_healthy and _wait_free(engine)


def test_consecutive_step_failures_kill_the_engine_and_fail_pending_requests_promptly(engine):
    engine.start()
    _poison_runner(engine, {"p0", "p1", "p2"})

    async def one_after_another():
        results = []
        for i in range(3):
            try:
                await _run(engine, f"p{i}")
            except Exception as exc:  # noqa: BLE001 - collected for the assertions
                results.append(exc)
        return results

    results = asyncio.run(one_after_another())
    assert [type(r) for r in results] == [StepFailedError, StepFailedError, EngineDeadError]
    assert engine.dead_error is not None and not engine.is_healthy

    async def late():
        with pytest.raises(EngineDeadError):
            await engine.add_request("late", "x", SamplingParams())

    asyncio.run(late())


def test_fatal_failure_marks_unhealthy_and_fails_everything_at_once():
    with running_server() as srv:
        _poison_runner(srv.engine, {"killer"}, message="CUDA error: an illegal memory access was encountered")

        async def main():
            async with httpx.AsyncClient(base_url=srv.base_url, timeout=30) as http:
                bystander = asyncio.create_task(http.post("/v1/completions", json={
                    "prompt": "A tale", "max_tokens": 400, "ignore_eos": True}))
                while srv.engine.get_stats().get("num_running", 0) < 1:
                    await asyncio.sleep(0.01)
                await srv.engine.add_request("killer", "x", SamplingParams(max_tokens=2))
                started = time.monotonic()
                response = await bystander
                return response, time.monotonic() - started

        response, waited = asyncio.run(main())
        assert response.status_code == 503 and "engine" in response.json()["error"]["message"]
        assert waited < 5
        health = httpx.get(srv.base_url + "/health")
        assert health.status_code == 503 and health.json()["status"] == "unhealthy"
        late = httpx.post(srv.base_url + "/v1/completions", json={"prompt": "x"})
        assert late.status_code == 503
