"""docs/engine.md's engine-flag table is the one `EngineArgs` gives (tools/gen_engine_docs.py), so it cannot drift."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from llmctl.engine_options import flag_fields

ROOT = Path(__file__).resolve().parent.parent


def _generator():
    spec = importlib.util.spec_from_file_location("gen_engine_docs", ROOT / "tools" / "gen_engine_docs.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_engine_flag_table_is_current():
    text = (ROOT / "docs" / "engine.md").read_text()
    assert _generator().with_flag_table(text) == text, "docs/engine.md is stale: run python tools/gen_engine_docs.py"


def test_every_engine_flag_has_a_row():
    text = (ROOT / "docs" / "engine.md").read_text()
    missing = [f.name for f in flag_fields() if f"| `--{f.name.replace('_', '-')}`" not in text]
    assert not missing, missing
