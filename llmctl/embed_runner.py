"""`llmctl generate --embed`: embed a batch of prompts with the engine (pooling requests, batched like any
other) and write one JSON line per input with its vector; progress on a TTY only, a summary at the end
(on a TTY, or as JSON on stderr with --json)."""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from typing import Any, Optional

from llmctl.errors import UserError
from llmctl.generate_runner import run_with_progress, status_on_tty
from llmctl.output import is_interactive, print_json, stderr_console
from llmctl.prompt_file import PromptSpec


@dataclass
class EmbedJob:
    specs: list[PromptSpec]
    dimensions: Optional[int]
    json_output: bool


def run_embed(args, job: EmbedJob) -> None:
    _check_specs(job.specs)  # before importing the engine (torch): a refusal is instant
    from llmctl.engine import LLM, PoolingParams
    from llmctl.engine.errors import InvalidRequestError
    from llmctl.engine_options import missing_tokenizer

    try:
        params = PoolingParams(dimensions=job.dimensions)
    except InvalidRequestError as exc:
        raise UserError(f"--dimensions: {exc}") from None
    if missing_tokenizer(args) is not None:  # token-id prompts run without one; text prompts are refused by name
        args.skip_tokenizer_init = True
    err = stderr_console()
    with status_on_tty(err, "Loading model"):
        llm = LLM.from_engine_args(args)
    prompts = [spec.prompt_token_ids if spec.prompt_token_ids is not None else spec.prompt for spec in job.specs]
    start = time.perf_counter()
    try:
        outputs = run_with_progress(err, "embedding", len(prompts),
                                    lambda on_output: llm.embed(prompts, params, on_output=on_output))
    except InvalidRequestError as exc:
        raise UserError(str(exc)) from None
    seconds = time.perf_counter() - start
    for index, (spec, output) in enumerate(zip(job.specs, outputs)):
        print_json({"index": index, "prompt": spec.prompt, "prompt_tokens": len(output.prompt_token_ids),
                    "embedding": output.outputs.embedding})
    _report(err, _summary(llm, outputs, seconds), job.json_output)


def _check_specs(specs: list[PromptSpec]) -> None:
    for index, spec in enumerate(specs):
        if spec.messages is not None:
            raise UserError(f"prompt {index}: --embed takes `prompt` or `prompt_token_ids` lines, not `messages`")
        if spec.params:
            raise UserError(f"prompt {index}: --embed takes no sampling parameters ({', '.join(sorted(spec.params))})")


def _summary(llm, outputs, seconds: float) -> dict[str, Any]:
    tokens = sum(len(o.prompt_token_ids) for o in outputs)
    return {"embeddings": len(outputs), "dimensions": len(outputs[0].outputs.data), "prompt_tokens": tokens,
            "pooling_type": llm.engine.pooler_config.pooling_type, "seconds": round(seconds, 6),
            "prompt_tokens_per_s": round(tokens / seconds, 1) if seconds > 0 else None}


def _report(err, summary: dict[str, Any], json_output: bool) -> None:
    if json_output:
        print_json({"summary": summary}, stream=sys.stderr)
    elif is_interactive(err):
        err.print(f"[dim]{summary['embeddings']} embedding(s) of {summary['dimensions']} dimensions, "
                  f"{summary['prompt_tokens']} tokens, {summary['prompt_tokens_per_s']} tok/s "
                  f"({summary['pooling_type']} pooling)[/dim]")
