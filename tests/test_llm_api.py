"""The offline `LLM` API: prompt forms, output order, per-prompt params, n > 1 with prefix sharing,
abort, request validation (nothing leaks on refusal), finish reasons, YAML engine args, and flat
peak RSS across repeated workloads."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from llmctl.engine import LLM, EngineArgs, SamplingParams
from llmctl.engine.errors import EngineArgsError, InvalidRequestError

GREEDY = dict(temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tiny_chat_model) -> LLM:
    return LLM(str(tiny_chat_model), device="cpu", dtype="float32", max_model_len=128, num_kv_blocks=48,
               max_num_batched_tokens=64)


def all_free(llm: LLM) -> bool:
    bm = llm.engine.block_manager
    bm.check_invariants([])
    return bm.num_free_blocks == bm.num_blocks and not llm.engine.requests and not llm.engine.scheduler.has_unfinished


def ids(length: int, start: int = 10) -> list[int]:
    return [(start + 7 * i) % 500 + 5 for i in range(length)]


def test_outputs_come_back_in_input_order(llm):
    prompts = [ids(60, 1), ids(3, 2), ids(25, 3), ids(1, 4), ids(40, 5)]
    max_tokens = [2, 9, 4, 7, 1]  # finishing order differs from the input order
    params = [SamplingParams(max_tokens=m, **GREEDY) for m in max_tokens]
    outputs = llm.generate(prompts, params)
    assert [o.prompt_token_ids for o in outputs] == prompts
    assert [len(o.outputs[0].token_ids) for o in outputs] == max_tokens
    assert all(o.finished and o.outputs[0].finish_reason == "length" for o in outputs)
    # Batched results equal the ones computed alone (the mapping is right, not just the lengths).
    for i in (1, 4):
        alone = llm.generate([prompts[i]], params[i])[0]
        assert alone.outputs[0].token_ids == outputs[i].outputs[0].token_ids
    assert all_free(llm)


def test_prompt_forms(llm):
    tok = llm.get_tokenizer()
    text = "To be, or not to be"
    token_ids = tok.encode(text)
    params = SamplingParams(max_tokens=3, **GREEDY)
    outputs = llm.generate([text, token_ids, {"prompt_token_ids": token_ids}, {"prompt": text}], params)
    assert len({tuple(o.outputs[0].token_ids) for o in outputs}) == 1
    assert outputs[0].prompt == text and outputs[1].prompt is None
    assert all(o.prompt_token_ids == token_ids for o in outputs)
    single_text = llm.generate(text, params)
    single_ids = llm.generate(token_ids, params)
    assert len(single_text) == len(single_ids) == 1
    assert single_text[0].outputs[0].token_ids == outputs[0].outputs[0].token_ids
    assert outputs[0].outputs[0].text == tok.decode(outputs[0].outputs[0].token_ids)
    with pytest.raises(InvalidRequestError):
        llm.generate([{"text": "wrong key"}], params)
    assert all_free(llm)


def test_per_prompt_sampling_params(llm):
    prompts = [ids(5), ids(6), ids(7)]
    params = [SamplingParams(max_tokens=1, **GREEDY), SamplingParams(max_tokens=3, **GREEDY),
              SamplingParams(max_tokens=2, temperature=1.0, seed=0, ignore_eos=True, logprobs=2)]
    outputs = llm.generate(prompts, params)
    assert [len(o.outputs[0].token_ids) for o in outputs] == [1, 3, 2]
    assert outputs[0].outputs[0].logprobs is None
    lp = outputs[2].outputs[0].logprobs
    assert len(lp) == 2 and all(tok in step for tok, step in zip(outputs[2].outputs[0].token_ids, lp))
    with pytest.raises(InvalidRequestError, match="2 sampling params for 3 prompts"):
        llm.generate(prompts, params[:2])
    assert all_free(llm)


@pytest.mark.parametrize("caching", [True, False])
def test_n_samples_share_the_prompt_blocks(tiny_chat_model, caching):
    llm = LLM(str(tiny_chat_model), device="cpu", dtype="float32", max_model_len=128, num_kv_blocks=24,
              enable_prefix_caching=caching)
    prompt = ids(40)  # two full 16-token blocks to share
    out = llm.generate([prompt], SamplingParams(n=2, temperature=1.0, seed=11, max_tokens=4, ignore_eos=True))[0]
    assert [c.index for c in out.outputs] == [0, 1]
    assert all(len(c.token_ids) == 4 and c.finish_reason == "length" for c in out.outputs)
    stats = llm.engine.get_stats()
    assert stats["prefix_cache_hit_rate"] > 0, "the second sample should reuse the prompt's blocks"
    hits_after_first = llm.engine.block_manager.prefix_hits
    again = llm.generate([prompt], SamplingParams(n=2, temperature=1.0, seed=11, max_tokens=4, ignore_eos=True))[0]
    if not caching:  # sibling sharing is private to a request: the repeat request starts cold
        assert llm.engine.block_manager.prefix_hits - hits_after_first == 2
    assert [c.token_ids for c in again.outputs] == [c.token_ids for c in out.outputs], "seeded samples repeat"
    assert all_free(llm)


def test_abort_frees_blocks(llm):
    engine = llm.engine
    engine.add_request("long", ids(50), SamplingParams(max_tokens=60, **GREEDY))
    engine.add_request("other", ids(20, 3), SamplingParams(max_tokens=60, **GREEDY))
    for _ in range(3):
        engine.step()
    assert engine.block_manager.num_free_blocks < engine.block_manager.num_blocks
    output = engine.abort_request("long")
    assert output.finished and output.outputs[0].finish_reason == "abort"
    assert engine.abort_request("long") is None
    assert engine.abort_request("other").outputs[0].finish_reason == "abort"
    assert all_free(llm)


@pytest.mark.parametrize("prompt, message", [
    ([], "empty"),
    ({"prompt_token_ids": []}, "empty"),
    ([3, 512], "outside the vocabulary"),
    ([3, -1], "outside the vocabulary"),
    (list(range(5, 134)), "max_model_len"),
])
def test_invalid_prompts_are_refused_and_leave_nothing_behind(llm, prompt, message):
    good = ids(30)
    with pytest.raises(InvalidRequestError, match=message) as refused:
        llm.generate([good, prompt], SamplingParams(max_tokens=2))
    assert refused.value.param == "prompt"
    assert all_free(llm)


def test_prompt_of_exactly_max_model_len_yields_one_token(llm):
    out = llm.generate([list(range(5, 133))], SamplingParams(max_tokens=5, ignore_eos=True))[0]
    assert len(out.outputs[0].token_ids) == 1 and out.outputs[0].finish_reason == "length"
    assert all_free(llm)


@pytest.mark.parametrize("kwargs, param", [
    (dict(temperature=-0.5), "temperature"), (dict(top_p=0.0), "top_p"), (dict(top_p=1.5), "top_p"),
    (dict(top_k=-2), "top_k"), (dict(min_p=2.0), "min_p"), (dict(n=0), "n"), (dict(max_tokens=0), "max_tokens"),
    (dict(min_tokens=5, max_tokens=2), "min_tokens"), (dict(logprobs=50), "logprobs"),
    (dict(prompt_logprobs=-1), "prompt_logprobs"), (dict(stop=[""]), "stop"),
    (dict(repetition_penalty=0.0), "repetition_penalty"), (dict(presence_penalty=3.0), "presence_penalty"),
    (dict(frequency_penalty=-2.5), "frequency_penalty"), (dict(stop_token_ids=[-1]), "stop_token_ids"),
    (dict(temperature="hot"), "temperature"), (dict(top_p=None), "top_p"), (dict(max_tokens="16"), "max_tokens"),
])
def test_bad_sampling_params_are_invalid_requests_naming_the_field(kwargs, param):
    with pytest.raises(InvalidRequestError) as refused:
        SamplingParams(**kwargs)
    assert refused.value.param == param, refused.value


def test_sampling_params_are_validated_once_not_per_sample(llm, monkeypatch):
    params = SamplingParams(n=4, max_tokens=2, **GREEDY)
    checked = []
    monkeypatch.setattr(SamplingParams, "_validate", lambda self: checked.append(self))
    out = llm.generate([ids(5)], params)[0]
    assert len(out.outputs) == 4 and all(c.token_ids for c in out.outputs)
    assert checked == []  # the n per-sample copies are not validated again
    assert all_free(llm)


def test_duplicate_request_id_is_refused(llm):
    engine = llm.engine
    engine.add_request("dup", ids(5), SamplingParams(max_tokens=1))
    with pytest.raises(InvalidRequestError, match="already in use"):
        engine.add_request("dup", ids(5), SamplingParams(max_tokens=1))
    engine.abort_request("dup")
    assert all_free(llm)


class ForceToken:
    """A logits processor that makes `token` the argmax once `after` tokens were produced."""

    def __init__(self, token: int, after: int):
        self.token, self.after = token, after

    def __call__(self, output_ids, logits):
        if len(output_ids) >= self.after:
            logits = logits.clone()
            logits[self.token] = logits.max() + 100.0
        return logits


def test_finish_reasons(llm):
    eos = llm.get_tokenizer().eos_token_id
    prompt = ids(8)
    by_eos = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=10,
                                                   logits_processors=[ForceToken(eos, 2)]))[0].outputs[0]
    assert by_eos.finish_reason == "stop" and by_eos.stop_reason is None
    assert len(by_eos.token_ids) == 3 and by_eos.token_ids[-1] == eos
    ignored = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True,
                                                    logits_processors=[ForceToken(eos, 2)]))[0].outputs[0]
    assert ignored.finish_reason == "length" and len(ignored.token_ids) == 5
    by_stop_id = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=10, stop_token_ids=[77],
                                                       logits_processors=[ForceToken(77, 1)]))[0].outputs[0]
    assert by_stop_id.finish_reason == "stop" and by_stop_id.stop_reason == 77 and len(by_stop_id.token_ids) == 2
    min_tokens = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=10, min_tokens=4,
                                                       logits_processors=[ForceToken(eos, 0)]))[0].outputs[0]
    assert min_tokens.token_ids[:4].count(eos) == 0 and len(min_tokens.token_ids) == 5
    by_length = llm.generate([prompt], SamplingParams(max_tokens=3, **GREEDY))[0]
    assert by_length.outputs[0].finish_reason == "length" and len(by_length.outputs[0].token_ids) == 3
    metrics = by_length.metrics
    assert metrics.time_to_first_token > 0 and metrics.finished_time >= metrics.first_token_time
    # max_tokens=None runs up to the context length.
    to_context = llm.generate([ids(120)], SamplingParams(max_tokens=None, **GREEDY))[0].outputs[0]
    assert to_context.finish_reason == "length" and len(to_context.token_ids) == 128 - 120
    assert all_free(llm)


def test_engine_args_from_yaml(tiny_chat_model, tmp_path):
    config = tmp_path / "engine.yaml"
    config.write_text(f"model: {tiny_chat_model}\ndevice: cpu\ndtype: float32\nmax-num-seqs: 3\n"
                      "max_model_len: 96\nenable-prefix-caching: false\nnum_kv_blocks: 12\n")
    args = EngineArgs.from_yaml(config, max_num_batched_tokens=32)
    assert (args.max_num_seqs, args.max_model_len, args.enable_prefix_caching) == (3, 96, False)
    llm = LLM.from_engine_args(args)
    assert llm.engine.scheduler.config.max_num_seqs == 3
    assert llm.engine.scheduler.config.max_num_batched_tokens == 32
    assert llm.engine.max_model_len == 96 and llm.engine.block_manager.num_blocks == 12
    assert not llm.engine.block_manager.enable_prefix_caching
    assert len(llm.generate("hi", SamplingParams(max_tokens=2, **GREEDY))[0].outputs[0].token_ids) == 2
    bad = tmp_path / "bad.yaml"
    bad.write_text("max-num-seqs: 3\nno_such_flag: 1\n")
    with pytest.raises(EngineArgsError, match="no_such_flag"):
        EngineArgs.from_yaml(bad)
    bad.write_text("- just\n- a list\n")
    with pytest.raises(EngineArgsError, match="mapping"):
        EngineArgs.from_yaml(bad)
    bad.write_text("max_num_seqs: 0\n")
    with pytest.raises(EngineArgsError, match="max_num_seqs"):
        EngineArgs.from_yaml(bad)


RSS_SCRIPT = textwrap.dedent("""
    import json, random, resource, sys
    from llmctl.engine import LLM, SamplingParams

    # One thread: on a busy 2-core machine OpenMP's second thread makes every tiny op wait ~ms.
    llm = LLM(sys.argv[1], device="cpu", dtype="float32", max_model_len=256, max_num_seqs=16,
              max_num_batched_tokens=256, num_kv_blocks=40, num_threads=1)  # small pool: preemption too
    rng = random.Random(0)
    prompts = [[rng.randrange(5, 500) for _ in range(rng.randint(16, 200))] for _ in range(32)]
    params = SamplingParams(temperature=0.8, top_p=0.9, seed=1, max_tokens=24, ignore_eos=True, logprobs=5)

    def run():
        outputs = llm.generate(prompts, params)
        assert all(len(o.outputs[0].token_ids) == 24 for o in outputs)
        bm = llm.engine.block_manager
        assert bm.num_free_blocks == bm.num_blocks and not llm.engine.requests

    def peak_kib():
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss

    run()
    once = peak_kib()
    for _ in range(4):
        run()
    print(json.dumps({"once": once, "five": peak_kib(), "preemptions": llm.engine.get_stats()["num_preemptions"]}))
""")


def test_peak_rss_is_flat_across_repeated_workloads(tiny_chat_model):
    proc = subprocess.run([sys.executable, "-c", RSS_SCRIPT, str(tiny_chat_model)], capture_output=True,
                          text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr
    peaks = json.loads(proc.stdout.strip().splitlines()[-1])
    assert peaks["preemptions"] > 0
    # 5% as the issue asks, plus 8 MiB of slack: glibc malloc keeps per-thread arenas and trims them
    # lazily, so a few MiB of peak can move between otherwise identical runs; a real leak (every
    # request's outputs, log-probs or KV kept) grows with each of the four extra runs instead.
    limit = peaks["once"] * 1.05 + 8 * 1024
    assert peaks["five"] <= limit, f"peak RSS grew from {peaks['once']} KiB to {peaks['five']} KiB"


# ---- output kinds: CUMULATIVE (default), DELTA, FINAL_ONLY (vLLM's RequestOutputKind) ------------

def _steps(llm: LLM, params: SamplingParams) -> tuple[list, object]:
    seen = []
    final = llm.generate(["To be, or not"], params, on_output=lambda _i, out: seen.append(out))[0]
    return seen, final


def _sampled(**overrides) -> SamplingParams:
    base = dict(n=3, temperature=0.8, seed=7, max_tokens=20, logprobs=2, prompt_logprobs=1, ignore_eos=True)
    return SamplingParams(**{**base, **overrides})


def _held_back_stop(llm: LLM) -> str:
    """Two characters from inside a sampled choice's text: a stop string that ends that choice early."""
    text = llm.generate(["To be, or not"], _sampled())[0].outputs[1].text
    return next(text[i:i + 2] for i in range(3, len(text) - 2) if "\ufffd" not in text[i:i + 2])


@pytest.mark.parametrize("include_stop", [False, True])
def test_deltas_add_up_to_the_cumulative_outputs_step_by_step(llm, include_stop):
    from llmctl.engine import RequestOutputKind

    stop = _held_back_stop(llm)
    cumulative, whole = _steps(llm, _sampled(stop=[stop], include_stop_str_in_output=include_stop))
    deltas, summed = _steps(llm, _sampled(stop=[stop], include_stop_str_in_output=include_stop,
                                         output_kind=RequestOutputKind.DELTA))
    assert len(deltas) == len(cumulative) and any(c.finish_reason == "stop" for c in whole.outputs)
    so_far = {i: ("", [], []) for i in range(3)}
    for step, (delta, full) in enumerate(zip(deltas, cumulative)):
        assert (delta.prompt_logprobs is not None) == (step == 0)  # once, in the first delta
        for c in delta.outputs:
            assert c.token_ids or c.text or c.finish_reason, "a choice with nothing new is left out"
            assert so_far[c.index] is not None, "nothing comes after a choice finished"
            text, ids, lps = so_far[c.index]
            so_far[c.index] = (text + c.text, ids + c.token_ids, lps + c.logprobs)
            expected = full.outputs[c.index]
            assert so_far[c.index] == (expected.text, expected.token_ids, expected.logprobs)
            assert (c.cumulative_logprob, c.finish_reason, c.stop_reason) == (
                expected.cumulative_logprob, expected.finish_reason, expected.stop_reason)
            if c.finish_reason is not None:
                so_far[c.index] = None
        # a choice that the delta leaves out has nothing new in the cumulative output either
        for index, expected in enumerate(full.outputs):
            if so_far[index] is not None:
                assert so_far[index] == (expected.text, expected.token_ids, expected.logprobs)
    assert all(v is None for v in so_far.values())
    assert summed.outputs == whole.outputs and summed.prompt_logprobs == whole.prompt_logprobs
    assert summed.finished and all_free(llm)


def test_final_only_is_one_output_and_generate_returns_the_same_for_every_kind(llm):
    from llmctl.engine import RequestOutputKind

    finals, whole = _steps(llm, _sampled(output_kind=RequestOutputKind.FINAL_ONLY))
    assert len(finals) == 1 and finals[0] is whole and whole.finished
    for kind in RequestOutputKind:
        again = llm.generate(["To be, or not"], _sampled(output_kind=kind))[0]  # no on_output
        assert again.outputs == whole.outputs and again.prompt_logprobs == whole.prompt_logprobs
    assert all_free(llm)
