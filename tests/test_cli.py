"""CLI plumbing: version, help, error lines and exit codes, config precedence, completions."""

from __future__ import annotations

import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from llmctl.cli import build_cli, run
from llmctl.completion import SHELLS, render

ROOT = Path(__file__).resolve().parent.parent


def llmctl(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "llmctl.cli", *args], capture_output=True, text=True, env=env, timeout=120
    )


def test_version_and_help_list_subcommands(capsys):
    assert run(["--version"]) == 0
    assert capsys.readouterr().out.startswith("llmctl ")
    assert run(["--help"]) == 0
    out = capsys.readouterr().out
    for name in build_cli().commands:
        assert name in out


@pytest.mark.parametrize("args", [(), ("profile",)])
def test_a_group_without_a_subcommand_prints_its_help(args, capsys):
    assert run(list(args)) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"Usage: llmctl {' '.join(args)}".rstrip() + " [OPTIONS] COMMAND") and "Commands:" in out


def test_usage_error_is_one_line_exit_2():
    proc = llmctl("--no-such-flag")
    assert proc.returncode == 2
    assert proc.stderr.strip().count("\n") == 0
    assert "Traceback" not in proc.stderr
    assert "--no-such-flag" in proc.stderr


def test_user_error_is_one_line_exit_2():
    proc = llmctl("completion", "tcsh")
    assert proc.returncode == 2
    assert proc.stderr.strip() == "llmctl: error: unknown shell 'tcsh'; choose one of bash, zsh, fish"


@pytest.mark.parametrize("shell", SHELLS)
def test_completion_files_are_up_to_date(shell):
    names = {"bash": "llmctl.bash", "zsh": "_llmctl", "fish": "llmctl.fish"}
    on_disk = (ROOT / "completions" / names[shell]).read_text()
    assert on_disk == render(shell, build_cli()), "run: python tools/gen_completions.py"


def test_bash_completion_parses_and_completes_subcommands(tmp_path):
    script = ROOT / "completions" / "llmctl.bash"
    probe = f"""
source {script}
COMP_WORDS=(llmctl comp); COMP_CWORD=1; _llmctl; echo "${{COMPREPLY[@]}}"
"""
    proc = subprocess.run(["bash", "-c", probe], capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0, proc.stderr
    assert "completion" in proc.stdout.split()


def test_every_package_folder_is_listed_in_pyproject():
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(config["packages"])
    mapping = config["package-dir"]
    for package, folder in mapping.items():
        for init in (ROOT / folder).rglob("__init__.py"):
            rel = init.parent.relative_to(ROOT / folder)
            name = ".".join([package, *rel.parts]) if rel.parts else package
            if "__pycache__" in name or "default_model" in name:
                continue
            assert name in listed, f"{name} missing from [tool.setuptools] packages"


def test_every_test_file_the_repository_names_exists():
    # Comments, docs and CI that name a test file under tests/ (and maybe a test in it) stay true.
    import re

    skip = {".git", ".venv", "node_modules", "__pycache__", "llmctl.egg-info", "default_model"}
    named = re.compile(r"tests/(test_\w+\.py)(?:::(\w+))?")
    stale = []
    for path in ROOT.rglob("*"):
        if not path.is_file() or skip & set(path.relative_to(ROOT).parts) or path.suffix not in {
                ".py", ".md", ".toml", ".sh", ".yaml", ".yml", ".cfg", ""}:
            continue
        text = path.read_text(errors="replace")
        for file, test in named.findall(text):
            target = ROOT / "tests" / file
            if not target.is_file() or (test and f"def {test}(" not in target.read_text()):
                stale.append(f"{path.relative_to(ROOT)}: tests/{file}{'::' + test if test else ''}")
    assert not stale, stale


def test_readme_test_command_is_what_ci_runs():
    ci = (ROOT / ".ci" / "run").read_text()
    readme = (ROOT / "README.md").read_text()
    command = next(line for line in ci.splitlines() if line.startswith("pip install"))
    assert command in readme


# ---------------------------------------------------------------- option names, env names, help pages


def all_commands(command=None, path=("llmctl",)):
    """(path, click command) for the root and every subcommand, depth first."""
    command = command or build_cli()
    yield path, command
    for name, sub in getattr(command, "commands", {}).items():
        yield from all_commands(sub, (*path, name))


def all_options():
    for path, command in all_commands():
        for param in command.params:
            if param.param_type_name == "option" and param.envvar:
                yield path, param


def parsed(args: list[str], monkeypatch, **env: str) -> dict:
    """The parameters the real CLI parses for `args` (a subcommand path and its flags), run nothing."""
    for name in [k for k in os.environ if k.startswith("LLMCTL_")]:
        monkeypatch.delenv(name)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    command = build_cli()
    ctx = command.make_context("llmctl", [], resilient_parsing=True)
    while args and args[0] in getattr(command, "commands", {}):
        name = args.pop(0)
        command = command.commands[name]
        if args and args[0] in getattr(command, "commands", {}):
            ctx = command.make_context(name, [], parent=ctx, resilient_parsing=True)
    return command.make_context(command.name, args, parent=ctx).params


def test_every_env_name_has_one_meaning():
    from llmctl.config import PROCESS_ENV_NAMES, SHARED_ENV_MEANINGS, env_var_name, long_flag

    readers: dict[str, list] = {}
    for path, param in all_options():
        name, flag = param.envvar, long_flag(param)
        assert isinstance(name, str) and name not in PROCESS_ENV_NAMES, (path, flag, name)
        per_command = {env_var_name("-".join([*path[1:i], flag.lstrip("-")])) for i in range(2, len(path) + 1)}
        assert name == env_var_name(flag) or name in per_command, (
            f"{' '.join(path)} {flag} reads {name}: use {env_var_name(flag)} or a per-command name {sorted(per_command)}")
        readers.setdefault(name, []).append((path, param))
    for name, options in readers.items():
        kinds = {(p.is_flag, p.multiple, long_flag(p)) for _, p in options}
        assert len(kinds) == 1, f"{name} is read as different kinds of value: {kinds}"
        helps = {p.help for _, p in options}
        if len(helps) > 1:
            assert name in SHARED_ENV_MEANINGS, (
                f"{name} is read by {[' '.join(path) for path, _ in options]} with different help texts: "
                "give one of them a per-command name (LLMCTL_<COMMAND>_<FLAG>) or, if it means the same "
                "thing there, state that meaning in llmctl.config.SHARED_ENV_MEANINGS")
    stale = sorted(set(SHARED_ENV_MEANINGS) - {n for n, o in readers.items() if len({p.help for _, p in o}) > 1})
    assert not stale, f"SHARED_ENV_MEANINGS lists names no longer shared: {stale}"


def test_json_is_llmctl_json_in_every_command(monkeypatch):
    json_options = [(path, p) for path, p in all_options() if "--json" in p.opts]
    assert len(json_options) >= 10
    assert {p.envvar for _, p in json_options} == {"LLMCTL_JSON"}
    assert parsed(["doctor"], monkeypatch, LLMCTL_JSON="1")["json"] is True
    assert parsed(["generate", "hi"], monkeypatch, LLMCTL_JSON="true")["json_output"] is True


def test_serve_port_env_leaves_profile_commands_alone(monkeypatch):
    """LLMCTL_PORT is where `serve` listens; set for it, `profile cpu -- CMD` used to refuse to run."""
    assert parsed(["profile", "cpu", "--", "python", "-c", "pass"], monkeypatch, LLMCTL_PORT="8000")["port"] is None
    assert parsed(["profile", "server"], monkeypatch, LLMCTL_PORT="8000")["port"] is None
    assert parsed(["profile", "mem", "--pid", "1"], monkeypatch, LLMCTL_PROFILE_PORT="8123")["port"] == 8123
    assert parsed(["serve"], monkeypatch, LLMCTL_PORT="8123")["port"] == 8123


def test_profile_cpu_runs_a_workload_with_serve_port_set(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("LLMCTL_")}
    proc = llmctl("profile", "cpu", "--dry-run", "-o", str(tmp_path / "p"), "--", sys.executable, "-c", "pass",
                  env={**env, "LLMCTL_PORT": "8000", "NO_COLOR": "1"})
    assert proc.returncode == 0, proc.stderr


def test_model_env_does_not_change_the_hardware_bench_shape(monkeypatch):
    assert parsed(["bench", "--cpu"], monkeypatch, LLMCTL_MODEL="./my-llama")["model"] is None
    assert parsed(["bench", "--cpu"], monkeypatch, LLMCTL_BENCH_MODEL="smollm-135m")["model"] == "smollm-135m"
    assert parsed(["bench", "throughput"], monkeypatch, LLMCTL_MODEL="./my-llama")["model"] == "./my-llama"


def test_env_names_follow_the_flag_not_the_parameter(monkeypatch):
    assert parsed(["generate", "hi"], monkeypatch, LLMCTL_STOP_TOKEN_ID="3 4")["stop_token_ids"] == [3, 4]
    assert parsed(["doctor"], monkeypatch, LLMCTL_LIST="1")["list_checks"] is True


def test_yaml_keys_are_the_long_flag_names(tmp_path, monkeypatch):
    config = tmp_path / "gen.yaml"
    config.write_text("json: true\nstop-token-id: [7]\nmax-tokens: 3\n")
    params = parsed(["generate", "hi", "--config", str(config)], monkeypatch)
    assert (params["json_output"], params["stop_token_ids"], params["max_tokens"]) == (True, [7], 3)


def test_yaml_type_error_names_the_file_not_the_env_var(tmp_path):
    config = tmp_path / "gen.yaml"
    config.write_text("max-tokens: lots\n")
    proc = llmctl("generate", "hi", "--config", str(config))
    assert proc.returncode == 2
    assert proc.stderr.startswith(f"llmctl: error: config file {config}: invalid value for 'max-tokens': ")
    assert "LLMCTL_MAX_TOKENS" not in proc.stderr and proc.stderr.count("\n") == 1


@pytest.mark.parametrize("path", [path for path, _ in all_commands()], ids=" ".join)
def test_help_at_80_columns_shows_every_flag_whole(path, capsys, monkeypatch):
    import re

    monkeypatch.setenv("COLUMNS", "80")
    command = dict(all_commands())[path]
    assert run([*path[1:], "--help"]) == 0
    out = capsys.readouterr().out
    assert max(len(line) for line in out.splitlines()) <= 80
    assert "…" not in out and "<bool>" not in out
    for param in command.params:
        if param.param_type_name != "option" or param.hidden:
            continue
        for flag in [*param.opts, *param.secondary_opts]:
            assert re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", out), f"{flag} cut or missing in:\n{out}"
        if param.envvar and param.envvar != "LLMCTL_HELP":
            assert param.envvar in out.replace("\n", " ").replace("  ", " ") or param.envvar in re.sub(r"\s+", "", out)


def test_boolean_flags_take_no_value():
    proc = llmctl("generate", "hi", "--json", "true")
    assert proc.returncode == 2
    assert "unexpected extra argument" in proc.stderr


def test_bash_completes_doctor_check_ids():
    script = ROOT / "completions" / "llmctl.bash"
    probe = f"""
source {script}
COMP_WORDS=(llmctl doctor --only gpu-m); COMP_CWORD=3; _llmctl; echo "${{COMPREPLY[@]}}"
COMP_WORDS=(llmctl doctor --explain sh); COMP_CWORD=3; _llmctl; echo "${{COMPREPLY[@]}}"
"""
    proc = subprocess.run(["bash", "-c", probe], capture_output=True, text=True, timeout=30)
    assert proc.stdout.splitlines() == ["gpu-memory-health gpu-memory-free gpu-mig-mode", "shm-size"], proc.stderr
