"""What `llmctl generate` does once its flags are parsed: build the engine, run the prompts,
stream or render the results (Rich progress on a TTY; plain text or JSON lines when piped)."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, replace
from typing import Any, Callable, Optional

from llmctl.errors import UserError
from llmctl.output import format_bytes, is_interactive, print_json, stderr_console, stdout_console
from llmctl.prompt_file import PromptSpec


@dataclass
class GenerateJob:
    specs: list[PromptSpec]
    sampling: dict[str, Any]
    chat: bool
    system: Optional[str]
    json_output: bool


def run_generate(args, job: GenerateJob) -> None:
    from llmctl.engine import LLM

    err = stderr_console()
    params = [_sampling_params({**job.sampling, **spec.params}) for spec in job.specs]  # fail before loading
    _run_without_tokenizer_if_possible(args, job, params)
    with status_on_tty(err, "Loading model"):
        llm = LLM.from_engine_args(args)
    prompts = [_prompt_input(llm, spec, job) for spec in job.specs]
    # No tokenizer: no text to stream; the token ids are printed at the end.
    streaming = len(prompts) == 1 and params[0].n == 1 and not job.json_output and llm.get_tokenizer() is not None
    if streaming:
        outputs = _run_streaming(llm, prompts, params)
    else:
        outputs = _run_batch(llm, prompts, params, err)
    memory = _memory(llm.engine.model_info)
    for index, (spec, output) in enumerate(zip(job.specs, outputs)):
        if job.json_output:
            print_json({**_as_json(index, spec, output), **memory})
        elif not streaming:
            _print_text(index, spec, output, len(outputs))
    if not job.json_output and is_interactive(err):
        _print_summary(err, outputs, memory)
    failed = [(index, output.error) for index, output in enumerate(outputs) if output.error is not None]
    if failed:  # the others were printed; these did not fit in memory even alone
        index, error = failed[0]
        raise UserError(f"{len(failed)} of {len(outputs)} prompt(s) failed; prompt {index}: {error}", exit_code=1)


def _run_without_tokenizer_if_possible(args, job: GenerateJob, params) -> None:
    """A model folder without tokenizer.json (`--load-format dummy` from config.json alone) runs
    token-id prompts; text, chat and stop strings need a tokenizer, and the error says so."""
    from llmctl.engine_options import missing_tokenizer

    folder = missing_tokenizer(args)
    if folder is None:
        return
    needs = [what for what, present in (
        ("text prompts", any(s.prompt_token_ids is None and s.messages is None for s in job.specs)),
        ("chat prompts", job.chat or any(s.messages is not None for s in job.specs)),
        ("stop strings", any(p.stop for p in params))) if present]
    if needs:
        raise UserError(f"no tokenizer.json in {folder}: {' and '.join(needs)} need a tokenizer; pass --tokenizer "
                        "FOLDER, or give token-id prompts: -f FILE with lines like {\"prompt_token_ids\": [1, 2, 3]}")
    args.skip_tokenizer_init = True


def _prompt_input(llm, spec: PromptSpec, job: GenerateJob):
    tokenizer = llm.get_tokenizer()
    if spec.prompt_token_ids is not None:
        return spec.prompt_token_ids
    messages = spec.messages
    if messages is None and job.chat:
        messages = ([{"role": "system", "content": job.system}] if job.system else []) + [
            {"role": "user", "content": spec.prompt}]
    if messages is not None:
        return tokenizer.encode_chat(messages)
    return spec.prompt


def _sampling_params(values: dict[str, Any]):
    from llmctl.engine import SamplingParams

    try:
        return SamplingParams(**values)
    except TypeError as exc:
        raise UserError(f"bad sampling parameter: {exc}") from None


@contextlib.contextmanager
def status_on_tty(console, message: str):
    if is_interactive(console):
        with console.status(message):
            yield
    else:
        yield


def _run_streaming(llm, prompts, params):
    from llmctl.engine import RequestOutputKind

    out = stdout_console()

    def on_output(_index, output):
        if output.outputs and output.outputs[0].text:  # a delta: only the new text
            out.file.write(output.outputs[0].text)
            out.file.flush()

    deltas = [replace(p, output_kind=RequestOutputKind.DELTA) for p in params]
    outputs = llm.generate(prompts, deltas, on_output=on_output)
    out.file.write("\n")
    out.file.flush()
    return outputs


def _run_batch(llm, prompts, params, err):
    return run_with_progress(err, "generating", len(prompts),
                             lambda on_output: llm.generate(prompts, params, on_output=on_output))


def run_with_progress(err, label: str, total: int, run: Callable[[Optional[Callable]], list]) -> list:
    """`run(on_output)` (an `LLM` batch call) with a progress bar of finished requests on a TTY only."""
    if not is_interactive(err):
        return run(None)
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    with Progress(TextColumn(label), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=err, transient=True) as progress:
        task = progress.add_task(label, total=total)

        def on_output(_index, output):
            if output.finished:
                progress.advance(task)

        return run(on_output)


def _print_text(index: int, spec: PromptSpec, output, total: int) -> None:
    out = stdout_console()
    for completion in output.outputs:
        if total > 1 or len(output.outputs) > 1:
            label = spec.prompt if spec.prompt is not None else f"{len(output.prompt_token_ids)} tokens"
            suffix = f" #{completion.index}" if len(output.outputs) > 1 else ""
            out.print(f"### [{index}{suffix}] {label[:60]!r}", markup=False, style="bold")
        # Without a tokenizer (token-id prompts on a config.json-only folder) there is no text.
        shown = completion.text if completion.text or not completion.token_ids else " ".join(map(str, completion.token_ids))
        out.print(shown, markup=False, highlight=False)


def _request_timing(output) -> dict[str, Optional[float]]:
    m = output.metrics
    tokens = sum(len(c.token_ids) for c in output.outputs)
    e2e = (m.finished_time - m.arrival_time) if m.finished_time else None
    decode = (m.finished_time - m.first_token_time) if m.finished_time and m.first_token_time else None
    return {
        "ttft_s": _round(m.time_to_first_token),
        "e2e_s": _round(e2e),
        "tokens_per_s": _round(tokens / e2e) if e2e else None,
        "decode_tokens_per_s": _round((tokens - len(output.outputs)) / decode) if decode else None,
    }


def _round(value: Optional[float]) -> Optional[float]:
    return None if value is None else round(value, 6)


def _as_json(index: int, spec: PromptSpec, output) -> dict[str, Any]:
    first = output.outputs[0]
    return {
        "index": index,
        "prompt": spec.prompt,
        "text": first.text,
        "finish_reason": first.finish_reason,
        "error": None if output.error is None else str(output.error),
        "prompt_tokens": len(output.prompt_token_ids),
        "completion_tokens": sum(len(c.token_ids) for c in output.outputs),
        **_request_timing(output),
        "outputs": [
            {
                "index": c.index, "text": c.text, "token_ids": c.token_ids, "finish_reason": c.finish_reason,
                "stop_reason": c.stop_reason, "cumulative_logprob": c.cumulative_logprob,
                "logprobs": [{str(k): v for k, v in step.items()} for step in c.logprobs] if c.logprobs else None,
            }
            for c in output.outputs
        ],
    }


def _memory(info) -> dict[str, Any]:
    """What the engine holds, on every JSON line: the weights (quantised linears at their quantised
    size) and the KV pool, in bytes; with expert parallelism each tensor-parallel rank's experts."""
    held = {"expert_placement": [list(ids) for ids in info.expert_placement]} if info.expert_placement else {}
    return {"dtype": info.dtype, "quantization": info.quantization, "weight_bytes": info.weight_bytes,
            "kv_cache_bytes": info.kv_cache_bytes, **held}


def _print_summary(err, outputs, memory: dict[str, Any]) -> None:
    tokens = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    starts = min(o.metrics.arrival_time for o in outputs)
    ends = max(o.metrics.finished_time or starts for o in outputs)
    rate = tokens / (ends - starts) if ends > starts else 0.0
    err.print(f"[dim]{len(outputs)} prompt(s), {tokens} tokens, {rate:.1f} tok/s; weights "
              f"{format_bytes(memory['weight_bytes'])} ({memory['quantization'] or memory['dtype']}), KV cache "
              f"{format_bytes(memory['kv_cache_bytes'])}[/dim]")
