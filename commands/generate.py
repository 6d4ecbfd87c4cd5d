"""`llmctl generate`: run prompts through the engine; stream one, batch many, or print JSON."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated, Optional

import typer

from llmctl import engine_options as eo
from llmctl.config import ConfigOption

SAMPLING = "Sampling"


def _s(*names: str, help: str):
    return typer.Option(*names, help=help, rich_help_panel=SAMPLING)


@eo.with_engine_flags()
def generate(
    prompt: Annotated[Optional[str], typer.Argument(help="Prompt text (omit with --file).")] = None,
    file: Annotated[Optional[Path], typer.Option("--file", "-f", help="Prompts file: one per line, or JSON lines with per-prompt params; '-' reads stdin.", allow_dash=True)] = None,
    chat: Annotated[bool, typer.Option("--chat", help="Apply the model's chat template (the prompt is a user message).")] = False,
    system: Annotated[Optional[str], typer.Option("--system", help="System message for --chat.")] = None,
    json_output: Annotated[bool, typer.Option("--json", help="Print one JSON object per prompt (--embed: a JSON summary on stderr).")] = False,
    embed: Annotated[bool, typer.Option("--embed", help="Embed the prompts instead (pooled final hidden states, --pooling-type): one JSON line per prompt with its vector.")] = False,
    dimensions: Annotated[Optional[int], typer.Option("--dimensions", help="--embed: truncate to this many dimensions (Matryoshka models only).")] = None,
    max_tokens: Annotated[int, _s("--max-tokens", help="Most tokens to generate per prompt.")] = 128,
    min_tokens: Annotated[int, _s("--min-tokens", help="Fewest tokens before stop conditions apply.")] = 0,
    temperature: Annotated[float, _s("--temperature", "-t", help="0 is greedy.")] = 0.8,
    top_p: Annotated[float, _s("--top-p", help="Nucleus sampling mass.")] = 1.0,
    top_k: Annotated[int, _s("--top-k", help="Sample among the k likeliest tokens (0: all).")] = 0,
    min_p: Annotated[float, _s("--min-p", help="Drop tokens below min_p x the top probability.")] = 0.0,
    repetition_penalty: Annotated[float, _s("--repetition-penalty", help="> 1 discourages repeating prompt or output tokens.")] = 1.0,
    presence_penalty: Annotated[float, _s("--presence-penalty", help="OpenAI presence penalty.")] = 0.0,
    frequency_penalty: Annotated[float, _s("--frequency-penalty", help="OpenAI frequency penalty.")] = 0.0,
    stop: Annotated[Optional[list[str]], _s("--stop", help="Stop string (repeatable).")] = None,
    stop_token_ids: Annotated[Optional[list[int]], _s("--stop-token-id", help="Stop token id (repeatable).")] = None,
    ignore_eos: Annotated[bool, _s("--ignore-eos", help="Keep generating past end-of-sequence.")] = False,
    n: Annotated[int, _s("--n", "-n", help="Samples per prompt.")] = 1,
    logprobs: Annotated[Optional[int], _s("--logprobs", help="Top log-probs per token in --json output.")] = None,
    sampling_seed: Annotated[Optional[int], _s("--sampling-seed", help="Per-request seed (reproducible sampling).")] = None,
    engine_args: eo.EngineArgs = eo.FLAGS,
    config: Optional[Path] = ConfigOption,
) -> None:
    """Generate text with the built-in engine (the embedded model unless --model is given)."""
    from llmctl.generate_runner import GenerateJob, run_generate
    from llmctl.prompt_file import PromptSpec, parse_prompt_lines
    from llmctl.errors import UserError

    if (prompt is None) == (file is None):
        raise UserError("give a PROMPT or --file (one of them)")
    if file is not None:
        stream = sys.stdin if str(file) == "-" else _open(file)
        specs = parse_prompt_lines(stream, "stdin" if str(file) == "-" else str(file))
    else:
        specs = [PromptSpec(prompt=prompt)]
    if embed:
        _embed(engine_args, specs, dimensions, json_output, chat=chat or system is not None, n=n, logprobs=logprobs)
        return
    if dimensions is not None:
        raise UserError("--dimensions is for --embed")
    sampling = dict(
        max_tokens=max_tokens, min_tokens=min_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
        min_p=min_p, repetition_penalty=repetition_penalty, presence_penalty=presence_penalty,
        frequency_penalty=frequency_penalty, stop=list(stop or []), stop_token_ids=list(stop_token_ids or []),
        ignore_eos=ignore_eos, n=n, logprobs=logprobs, seed=sampling_seed,
    )
    job = GenerateJob(specs=specs, sampling=sampling, chat=chat, system=system, json_output=json_output)
    run_generate(engine_args, job)


def _embed(engine_args, specs, dimensions: Optional[int], json_output: bool, *, chat: bool, n: int,
           logprobs: Optional[int]) -> None:
    from llmctl.embed_runner import EmbedJob, run_embed
    from llmctl.errors import UserError

    refused = [flag for flag, given in (("--chat/--system", chat), ("-n", n != 1), ("--logprobs", logprobs is not None))
               if given]
    if refused:
        raise UserError(f"--embed does not take {', '.join(refused)}")
    run_embed(engine_args, EmbedJob(specs=specs, dimensions=dimensions, json_output=json_output))


def _open(path: Path):
    from llmctl.errors import UserError

    try:
        return path.open()
    except OSError as exc:
        raise UserError(f"cannot read {path}: {exc.strerror}") from None
