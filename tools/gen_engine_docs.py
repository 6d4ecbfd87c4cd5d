"""Rewrite docs/engine.md's engine-flag table from the `EngineArgs` fields: `python tools/gen_engine_docs.py`."""

from __future__ import annotations

from pathlib import Path

from llmctl.engine_options import flags_markdown

DOC = Path(__file__).resolve().parent.parent / "docs" / "engine.md"
BEGIN, END = "<!-- engine-flags: begin (tools/gen_engine_docs.py) -->", "<!-- engine-flags: end -->"


def with_flag_table(text: str) -> str:
    """`text` with the part between the markers replaced by the current flag table."""
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    return f"{head}{BEGIN}\n{flags_markdown()}\n{END}{tail}"


def main() -> None:
    DOC.write_text(with_flag_table(DOC.read_text()))
    print(f"wrote {DOC.relative_to(DOC.parent.parent)}")


if __name__ == "__main__":
    main()
