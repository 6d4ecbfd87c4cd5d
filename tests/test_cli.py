"""CLI plumbing: version, help, error lines and exit codes, config precedence, completions."""

from __future__ import annotations

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


def test_readme_test_command_is_what_ci_runs():
    ci = (ROOT / ".ci" / "run").read_text()
    readme = (ROOT / "README.md").read_text()
    command = next(line for line in ci.splitlines() if line.startswith("pip install"))
    assert command in readme
