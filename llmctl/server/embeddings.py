"""OpenAI's /v1/embeddings response: one `embedding` object per input, as floats or as base64 of the
little-endian float32 bytes (what the openai SDK asks for by default and decodes)."""

from __future__ import annotations

import base64
import time
import uuid
from typing import Any, Union

import torch

from llmctl.engine.outputs import PoolingRequestOutput


def encode_embedding(vector: torch.Tensor, encoding_format: str) -> Union[list[float], str]:
    if encoding_format == "base64":
        return base64.b64encode(vector.numpy().astype("<f4").tobytes()).decode("ascii")
    return vector.tolist()


def embedding_body(outputs: list[PoolingRequestOutput], model: str, encoding_format: str) -> dict[str, Any]:
    """The response body (vLLM's, OpenAI's fields plus `id` and `created`); `outputs` in input order."""
    prompt_tokens = sum(len(o.prompt_token_ids) for o in outputs)
    return {
        "id": f"embd-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()), "model": model,
        "data": [{"object": "embedding", "index": i, "embedding": encode_embedding(o.outputs.data, encoding_format)}
                 for i, o in enumerate(outputs)],
        "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens},
    }

