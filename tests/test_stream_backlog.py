"""A streamed request whose reader stopped reading: its unread output is bounded
(--max-stream-backlog-tokens): past the limit the request is aborted, its output dropped, and the
reader gets the reason."""

from __future__ import annotations

import asyncio

import pytest

from llmctl.engine.async_engine import RequestStream
from llmctl.engine.errors import StreamBacklogError
from llmctl.engine.outputs import CompletionOutput, RequestOutput


def _delta(step: int, finished: bool = False) -> RequestOutput:
    completion = CompletionOutput(index=0, text="x", token_ids=[step], cumulative_logprob=None,
                                  logprobs=[{step: -0.1, step + 1: -2.0}], finish_reason="length" if finished else None)
    return RequestOutput(request_id="r", prompt=None, prompt_token_ids=[1], prompt_logprobs=None,
                         outputs=[completion], finished=finished)


def test_a_stream_nobody_reads_is_aborted_past_its_backlog_and_drops_its_output():
    async def scenario() -> None:
        aborted: list[str] = []
        stream = RequestStream("r", asyncio.get_running_loop(), aborted.append, aggregate=True, max_backlog=30)
        for step in range(10):  # 3 per delta (a token and 2 alternatives): 30 is still within the limit
            stream.put_now(_delta(step))
        assert stream.unread_tokens == 30 and not aborted
        first = await stream.__anext__()  # the reader takes all ten in one output
        assert first.outputs[0].token_ids == list(range(10)) and stream.unread_tokens == 0
        for step in range(11):
            stream.put_now(_delta(step))
        stream.put_now(_delta(99, finished=True))  # ignored: the request is aborted already
        assert aborted == ["r"] and stream.unread_tokens == 0
        with pytest.raises(StreamBacklogError, match="limit 30"):
            await stream.__anext__()

    asyncio.run(scenario())
