"""A streamed request whose reader stopped reading: its unread output is bounded
(--max-stream-backlog-tokens): past the limit the request is aborted, its output dropped, and the
reader gets the reason."""

from __future__ import annotations

import asyncio
import json
import logging
import socket

import pytest

from llmctl.engine.async_engine import RequestStream
from llmctl.engine.errors import StreamBacklogError
from llmctl.engine.outputs import CompletionOutput, RequestOutput
from server_helpers import rss_mib, running_server, shrink_server_send_buffer, wait_for


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


def test_two_stalled_sse_readers_are_aborted_and_their_memory_given_back(caplog):
    # Long streams (n=16, 20 logprobs: 336 tokens of backlog a step) whose readers never read; the
    # write timeout (60 s) is far off: only the backlog bound can free them within the test.
    body = json.dumps({"prompt": "A long tale", "max_tokens": 400, "n": 16, "logprobs": 20, "ignore_eos": True,
                       "stream": True}).encode()
    request = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
               + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
    with running_server() as srv:
        srv.engine.max_stream_backlog_tokens = 2000  # what --max-stream-backlog-tokens sets
        before = rss_mib()
        readers = []
        try:
            for _ in range(2):
                sock = socket.socket()
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
                sock.connect(("127.0.0.1", srv.port))
                shrink_server_send_buffer(srv, sock.getsockname())
                sock.sendall(request)
                readers.append(sock)
            wait_for(lambda: srv.engine.get_stats()["num_requests"] > 0, timeout_s=30, what="the requests run")
            srv.wait_idle(timeout=90)  # aborted by the bound: without it they run all 400 steps
            srv.assert_recovered(before, rss_bound_mib=50)  # every KV block free, RSS back within 50 MiB
            aborted = [r for r in caplog.records if "--max-stream-backlog-tokens" in r.getMessage()]
            assert len(aborted) == 2 and all(r.levelno == logging.WARNING for r in aborted)
        finally:
            for sock in readers:
                sock.close()
