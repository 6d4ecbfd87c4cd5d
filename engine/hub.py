"""Model ids (`ORG/NAME`) resolved to a snapshot folder in the local Hugging Face cache, never downloaded.

`huggingface_hub` finds the cache (`HF_HUB_CACHE`, else `HF_HOME`/hub, else ~/.cache/huggingface/hub) and
the revision's snapshot (`refs/<branch>` or a commit hash); a model not cached is a one-line error naming
the cache folder it looked in.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Optional

from llmctl.engine.errors import ModelLoadError

# A Hugging Face repo id: ORG/NAME (letters, digits, '-', '_', '.'), as huggingface_hub validates them
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def is_repo_id(name: str) -> bool:
    """`name` reads as ORG/NAME and is not a path on this machine."""
    return bool(_REPO_ID.match(name)) and not Path(name).exists()


def cached_snapshot(repo_id: str, revision: Optional[str] = None) -> Path:
    """The cached snapshot folder of `repo_id` at `revision` (default: main), looked up offline."""
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        folder = snapshot_download(repo_id, revision=revision, local_files_only=True)
    except (LocalEntryNotFoundError, FileNotFoundError, OSError, ValueError):
        at = f" at revision {revision!r}" if revision else ""
        raise ModelLoadError(f"model {repo_id!r}{at} is neither a local folder nor in the Hugging Face cache "
                             f"{constants.HF_HUB_CACHE} (llmctl never downloads: fetch it first with "
                             f"`hf download {repo_id}`)") from None
    return Path(folder)


def resolve_model_folder(name: str, revision: Optional[str] = None) -> Path:
    """A local path as given; an ORG/NAME that is not one, the cached snapshot's folder."""
    return cached_snapshot(name, revision) if is_repo_id(name) else Path(name)
