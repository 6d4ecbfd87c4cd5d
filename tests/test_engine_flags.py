"""Engine flags are declared once (`EngineArgs` field metadata, built by `llmctl.engine_options`) and
every command that runs the engine has all of them, with the config precedence of every flag."""

from __future__ import annotations

import ast
import os
import shutil
import subprocess
from pathlib import Path
from typing import Optional

import pytest
import typer

from llmctl import engine_options as eo
from llmctl import help as help_format
from llmctl.cli import build_cli, run
from llmctl.completion import _short_help
from llmctl.config import ConfigOption, assign_env_vars
from llmctl.engine.args import EngineArgs
from test_cli import parsed

ROOT = Path(__file__).resolve().parent.parent
ENGINE_COMMANDS = {("generate",), ("serve",), ("bench", "throughput"), ("bench", "latency"), ("profile", "torch"),
                   ("profile", "leak")}
FLAG_FIELDS = {f.name: f for f in eo.flag_fields()}
# Client and hardware commands whose own flags share a name with an engine flag but mean something else
# there (each reads its own LLMCTL_<COMMAND>_<FLAG> or a shared meaning in llmctl.config).
OWN_FLAGS = {("bench.py", "bench"): {"model"}, ("bench_serve.py", "serve"): {"model", "tokenizer", "seed"},
             ("profile.py", "server"): {"seed"}, ("doctor.py", "doctor"): {"model", "gpu_memory_utilization"}}


def commands(command=None, path=()):
    command = command or build_cli()
    yield path, command
    for name, sub in getattr(command, "commands", {}).items():
        yield from commands(sub, (*path, name))


def engine_panel(command) -> dict:
    return {p.name: p for p in command.params if getattr(p, "rich_help_panel", None) == eo.PANEL}


def test_the_new_scheduler_knobs_are_flags():
    assert {"batch_wait_timeout_ms", "long_prompt_penalty", "scheduling_policy"} <= set(FLAG_FIELDS)
    assert "skip_tokenizer_init" not in FLAG_FIELDS  # Python-only: it makes the engine unable to take text


def test_every_engine_command_has_every_engine_flag_and_no_other_command_has_any():
    seen = set()
    for path, command in commands():
        panel = engine_panel(command)
        if not panel:
            continue
        seen.add(path)
        assert set(panel) == set(FLAG_FIELDS), (path, sorted(set(FLAG_FIELDS) ^ set(panel)))
        for name, param in panel.items():
            assert param.help == FLAG_FIELDS[name].metadata["help"], (path, name)
            assert param.opts[0] == "--" + name.replace("_", "-"), (path, param.opts)
            assert param.envvar == "LLMCTL_" + name.upper(), (path, param.envvar)
    assert seen == ENGINE_COMMANDS


def _is_engine_flag(annotation) -> bool:
    """`eo.engine_flag("num_threads")`: the field's own flag, taken by a command that runs no engine."""
    return (isinstance(annotation, ast.Call) and isinstance(annotation.func, ast.Attribute)
            and annotation.func.attr == "engine_flag")


def test_the_hardware_bench_takes_the_engine_num_threads_flag():
    param = next(p for p in build_cli().commands["bench"].params if p.name == "num_threads")
    assert param.help == FLAG_FIELDS["num_threads"].metadata["help"] and param.envvar == "LLMCTL_NUM_THREADS"


def test_no_command_module_declares_an_engine_flag():
    """The flags come from `EngineArgs`; a command parameter named after a field would be a second
    declaration (before: 6 commands x 17 parameters, about 94 lines)."""
    found = []
    for path in sorted((ROOT / "commands").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                args = node.args.args + node.args.kwonlyargs
                if "config" not in {a.arg for a in args}:  # every command takes --config; helpers do not
                    continue
                names = {a.arg for a in args if not _is_engine_flag(a.annotation)}
                extra = (names & set(FLAG_FIELDS)) - OWN_FLAGS.get((path.name, node.name), set())
                found += [f"{path.name}:{node.lineno} {node.name}({name})" for name in sorted(extra)]
    assert not found, found


def test_per_command_defaults():
    params = {path: engine_panel(command) for path, command in commands() if path in ENGINE_COMMANDS}
    for path, panel in params.items():
        expected = path[0] != "bench"  # bench measures without prefix caching unless asked
        assert panel["enable_prefix_caching"].default is expected, path
        assert panel["enable_prefix_caching"].secondary_opts == ["--no-enable-prefix-caching"]
        assert panel["scheduling_policy"].default.value == "fcfs"


@pytest.mark.parametrize("path", sorted(ENGINE_COMMANDS), ids=" ".join)
def test_flag_beats_env_beats_yaml_beats_default(path, tmp_path, monkeypatch):
    config = tmp_path / "engine.yaml"
    config.write_text("scheduling-policy: priority\nlong-prompt-penalty: 0.25\nbatch_wait_timeout_ms: 7\n")
    args = list(path) + (["hi"] if path == ("generate",) else [])

    def policy(extra, **env):
        params = parsed(args + extra, monkeypatch, **env)
        return params["scheduling_policy"].value, params["long_prompt_penalty"], params["batch_wait_timeout_ms"]

    assert policy([]) == ("fcfs", 0.0, 0.0)
    assert policy(["--config", str(config)]) == ("priority", 0.25, 7.0)
    assert policy(["--config", str(config)], LLMCTL_SCHEDULING_POLICY="fcfs") == ("fcfs", 0.25, 7.0)
    assert policy(["--config", str(config), "--scheduling-policy", "priority", "--long-prompt-penalty", "2"],
                  LLMCTL_SCHEDULING_POLICY="fcfs", LLMCTL_LONG_PROMPT_PENALTY="1") == ("priority", 2.0, 7.0)


def test_the_command_receives_validated_engine_args(monkeypatch, tmp_path):
    received: list[EngineArgs] = []
    app = typer.Typer()

    @app.command(cls=help_format.Command)
    @eo.with_engine_flags(enable_prefix_caching=False, max_num_seqs=4)
    def probe(label: str = "x", engine_args: EngineArgs = eo.FLAGS, config: Optional[Path] = ConfigOption) -> None:
        received.append(engine_args)

    command = typer.main.get_command(app)
    assign_env_vars(command)
    monkeypatch.setenv("LLMCTL_BATCH_WAIT_TIMEOUT_MS", "2.5")
    command.main(args=["--scheduling-policy", "priority", "--dtype", "float32", "-m", "/models/x"],
                 standalone_mode=False)
    args = received[-1]
    assert isinstance(args, EngineArgs)
    assert (args.scheduling_policy, args.dtype, args.model) == ("priority", "float32", "/models/x")
    assert (args.enable_prefix_caching, args.max_num_seqs, args.batch_wait_timeout_ms) == (False, 4, 2.5)
    assert args.skip_tokenizer_init is False


def test_an_unknown_override_is_a_programming_error():
    with pytest.raises(TypeError, match="not engine flags: prefix_caching"):
        eo.with_engine_flags(prefix_caching=False)(lambda engine_args=eo.FLAGS: None)


@pytest.mark.parametrize("argv, message", [
    (["generate", "hi", "--scheduling-policy", "lifo"], "'lifo' is not one of 'fcfs', 'priority'"),
    (["generate", "hi", "--long-prompt-penalty", "-1"], "long_prompt_penalty must be >= 0"),
    (["serve", "--batch-wait-timeout-ms", "-5"], "batch_wait_timeout_ms must be >= 0"),
])
def test_bad_engine_flag_values_are_one_line_exit_2(argv, message, capsys, monkeypatch):
    for name in [k for k in os.environ if k.startswith("LLMCTL_")]:
        monkeypatch.delenv(name)
    assert run(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("llmctl: error: ") and message in err and err.count("\n") == 1, err


def test_completion_scripts_write_each_engine_flag_once():
    fish = (ROOT / "completions" / "llmctl.fish").read_text()
    zsh = (ROOT / "completions" / "_llmctl").read_text()
    bash_cases = [line for line in (ROOT / "completions" / "llmctl.bash").read_text().splitlines()
                  if line.rstrip().endswith(";;") and "return 0" in line]
    for name, f in FLAG_FIELDS.items():
        flag, text = "--" + name.replace("_", "-"), _short_help(f.metadata["help"])
        assert sum(f" -l {flag[2:]} " in line and text in line for line in fish.splitlines()) == 1, flag
        assert sum(f"{flag}" in line and f"[{text}]" in line for line in zsh.splitlines()) == 1, flag
        if not isinstance(f.default, bool) and not f.metadata.get("negatable"):  # bash completes valued flags
            assert sum(f'"llmctl generate {flag}"' in line for line in bash_cases) == 1, flag


@pytest.mark.skipif(not shutil.which("fish"), reason="fish is not installed")
def test_fish_completes_engine_flags_on_engine_commands_only():
    def complete(line: str) -> list[str]:
        script = f"source {ROOT / 'completions' / 'llmctl.fish'}; complete -C '{line}'"
        out = subprocess.run(["fish", "-c", script], capture_output=True, text=True, timeout=30, check=True).stdout
        return [row.split("\t")[0] for row in out.splitlines()]

    for path in sorted(ENGINE_COMMANDS):
        assert "--scheduling-policy" in complete(f"llmctl {' '.join(path)} --sched"), path
    assert {"fcfs", "priority"} <= set(complete("llmctl serve --scheduling-policy "))
    assert complete("llmctl bench serve --sched") == [] and complete("llmctl doctor --sched") == []


@pytest.mark.skipif(not shutil.which("zsh"), reason="zsh is not installed")
def test_zsh_passes_the_shared_engine_flags_to_each_engine_command():
    script = f'_arguments() {{ print -l -- "$@" }}; source {ROOT / "completions" / "_llmctl"} >/dev/null; '
    for path in sorted(ENGINE_COMMANDS) + [("bench", "serve")]:
        function = "_llmctl_" + "_".join(path)
        specs = subprocess.run(["zsh", "-f", "-c", script + function], capture_output=True, text=True, timeout=30,
                               check=True).stdout.splitlines()
        has = any(s.startswith("--scheduling-policy[") and s.endswith(":value:(fcfs priority)") for s in specs)
        assert has == (path in ENGINE_COMMANDS), (path, specs)
