"""What the client commands (`bench serve`, `profile server`) share about the server they talk to:
the endpoint choice and its paths, and where the API key comes from. No heavy imports: the command
modules use `Endpoint` as a flag type when the CLI is built."""

from __future__ import annotations

import enum
import os
from typing import Optional

# Read when --api-key (or LLMCTL_API_KEY) is not given: the name the openai client reads, so a shell
# set up for any OpenAI-compatible server needs nothing more.
API_KEY_ENV = "OPENAI_API_KEY"


class Endpoint(str, enum.Enum):
    completions = "completions"
    chat = "chat"


ENDPOINT_PATHS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}
ENDPOINT_HELP = "/v1/completions or /v1/chat/completions."
API_KEY_HELP = f"Bearer token (default: ${API_KEY_ENV})."


def api_key(flag: Optional[str]) -> Optional[str]:
    """The key to send: --api-key (LLMCTL_API_KEY), else $OPENAI_API_KEY, else none (an empty value is none)."""
    return flag or os.environ.get(API_KEY_ENV) or None


def auth_headers(key: Optional[str]) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"} if key else {}
