"""The attention-backend contract on rows of several query tokens on an existing context (speculative verify
rows of k+1 tokens): mixed with 1-token decode rows in one batch, they give the logits of decoding those tokens
one by one, on every backend (native CPU decode kernel, the torch path over the kept decode K/V, flash-attn's
paged kernel through a plain-torch model of it); the kept decode K/V never serves a sequence whose row had
several tokens or whose computed tokens went down (rolled back) since it was kept."""

from __future__ import annotations

import pytest
import torch
from conftest import cpu_kernels_while, make_tiny_model

from llmctl.engine import LLM, SamplingParams
from llmctl.engine.layers.attention import CommonAttentionMetadata
from llmctl.engine.sequence import Sequence
from llmctl.engine.step_types import ScheduledSeq

TOKENS = 120  # every sequence's known tokens; each test step computes a slice of them


@pytest.fixture(params=["native", "torch", "flash-attn"])
def backend(request, monkeypatch, tmp_path):
    """(backend name, LLM) on a GQA model (4 query heads on 2 K/V heads, head_dim 32: the native kernel's)."""
    folder = make_tiny_model(tmp_path / "qwen3", "qwen3")
    clear = cpu_kernels_while(monkeypatch, request.param == "native")
    engine = dict(num_kv_blocks=48, block_size=16)
    if request.param == "flash-attn":
        from test_cuda_logic import install_fake_flash

        install_fake_flash(monkeypatch)
        engine = dict(num_kv_blocks=6, block_size=256)
    llm = LLM(str(folder), skip_tokenizer_init=True, dtype="float32", device="cpu", max_model_len=256, **engine)
    runner = llm.engine.executor.runner
    if request.param == "native" and runner.attention.label != "torch (native CPU decode kernel)":
        pytest.skip("the native CPU decode kernel cannot run here (compiler or AVX-512)")
    assert runner.attention.name == ("flash-attn" if request.param == "flash-attn" else "torch")
    yield request.param, llm
    clear()


class Driver:
    """Runs hand-made batches through the runner; records every query token's logits with the tokens they saw."""

    def __init__(self, llm: LLM):
        self.runner = llm.engine.executor.runner
        self.seqs: list[Sequence] = []
        self.records: list[tuple[torch.Tensor, list[int]]] = []  # (logits [n, vocab], the tokens up to the last)
        self.last_meta = None

    def add(self, tokens: list[int]) -> Sequence:
        seq = Sequence(len(self.seqs), f"r{len(self.seqs)}", 0, tokens, params=SamplingParams(max_tokens=1))
        per_seq = -(-TOKENS // self.runner.block_size)
        seq.block_table = list(range(len(self.seqs) * per_seq, (len(self.seqs) + 1) * per_seq))
        self.seqs.append(seq)
        return seq

    @torch.inference_mode()
    def step(self, rows: list[tuple[Sequence, int]]) -> list[torch.Tensor]:
        """One forward of `rows` (sequence, query tokens) in this order: per row, [tokens, vocab] logits."""
        inputs, *_ = self.runner._prepare([ScheduledSeq(seq, n) for seq, n in rows])
        ids = inputs.input_ids
        meta = self.runner.attention.build_metadata(inputs.attention_batch(self.runner.block_size))
        logits = self.runner.model(ids, inputs.positions, self.runner.kv_caches, meta, self.runner.attention,
                                   torch.arange(ids.shape[0]))
        self.last_meta = meta
        out, start = [], 0
        for seq, n in rows:
            out.append(logits[start:start + n])
            seq.num_computed_tokens += n
            self.records.append((out[-1], list(seq.token_ids[:seq.num_computed_tokens])))
            start += n
        return out

    def roll_back(self, seq: Sequence, keep: int, new_tokens: list[int], tell_backend: bool) -> None:
        """Reject the sequence's tokens from `keep` on and put `new_tokens` there (a rejected speculative
        suffix); `tell_backend` says so to the backend, else only the lower count shows it."""
        seq.num_computed_tokens = keep
        seq.token_ids[keep:keep + len(new_tokens)] = new_tokens
        if tell_backend:
            self.runner.attention.truncate(seq.seq_id, keep)

    def check_against_transformers(self, name: str) -> None:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(self.runner.config.model_folder, dtype=torch.float32).eval()
        for logits, tokens in self.records:
            with torch.no_grad():
                expected = model(torch.tensor([tokens])).logits[0, -logits.shape[0]:].float()
            diff = (logits - expected).abs().max().item()
            assert diff < 1e-3, f"{name}: {logits.shape[0]} query tokens ending at {len(tokens)}: |diff| {diff}"


def test_verify_rows_mixed_with_decodes_give_the_one_by_one_logits(backend):
    name, llm = backend
    vocab = llm.engine.vocab_size
    run = Driver(llm)
    a = run.add([(7 * i + 1) % vocab for i in range(TOKENS)])
    b = run.add([(11 * i + 5) % vocab for i in range(TOKENS)])
    c = run.add([(13 * i + 2) % vocab for i in range(TOKENS)])
    workspace = (getattr(run.runner.attention, "workspaces", None) or [None])[0]  # the torch path's kept decode K/V
    run.step([(a, 21), (b, 37), (c, 50)])  # prefill chunks
    for _ in range(2):  # decode rows: the torch path keeps a's and b's K/V
        run.step([(a, 1), (b, 1)])
    if name == "torch":
        assert run.last_meta.workspace.mode == "slots" and run.last_meta.workspace.fill_rows is None

    # 1-token rows first, then a 4-token verify row on c's 50-token context: all 6 query tokens get logits
    mixed = run.step([(a, 1), (b, 1), (c, 4)])
    if name == "torch":
        spans = [(span.length, span.context_len) for span in run.last_meta.prefills]
        assert run.last_meta.num_single == 2 and spans == [(4, 54)]
        assert workspace.kept_tokens(c.seq_id) is None  # a row of 4 tokens keeps nothing

    # the same 4 tokens of c decoded one by one, after rolling c back: the verify row's logits
    run.roll_back(c, 50, c.token_ids[50:54], tell_backend=True)
    one_by_one = torch.cat([run.step([(a, 1), (b, 1), (c, 1)])[2] for _ in range(4)])
    assert (mixed[2] - one_by_one).abs().max().item() < 1e-4

    # Another verify row accepts 2 of 4; a (kept, the backend told) and b (kept, only its lower count shows it)
    # are rolled back too. The next 1-token rows must not read rejected K/V.
    run.step([(a, 1), (b, 1), (c, 4)])  # a at 29 tokens, b at 45, c at 58
    run.roll_back(c, 56, [3, 4], tell_backend=True)
    run.roll_back(a, 27, [5, 6], tell_backend=True)
    run.roll_back(b, 44, [9], tell_backend=False)
    run.step([(a, 1), (b, 1), (c, 1)])
    if name == "torch":  # a appends to its kept prefix; b (out of step) and c (new to the workspace) are gathered
        plan = run.last_meta.workspace
        assert sorted(plan.fill_rows.tolist()) == sorted(plan.rows[1:].tolist())
        assert workspace.kept_tokens(a.seq_id) == 28
    for _ in range(2):
        run.step([(a, 1), (b, 1), (c, 1)])
    run.step([(c, 3), (a, 1), (b, 1)])  # a verify row before 1-token rows: no leading 1-token rows, all spans
    if name == "torch":
        assert run.last_meta.num_single == 0 and len(run.last_meta.prefills) == 3
    run.check_against_transformers(name)


def test_the_common_batch_description_marks_the_decode_fast_path_rows(tiny_models):
    slots = torch.zeros(7, dtype=torch.long)
    mixed = CommonAttentionMetadata([1, 2, 3], [1, 1, 5], [10, 20, 30], [[0], [1, 2], [3, 4]], slots, 16)
    assert mixed.num_single == 2 and mixed.num_rows == 3 and not mixed.decode_only
    verify_first = CommonAttentionMetadata([3, 1], [5, 1], [30, 10], [[3, 4], [0]], slots[:6], 16)
    assert verify_first.num_single == 0 and not verify_first.decode_only
    decodes = CommonAttentionMetadata([1, 2], [1, 1], [10, 20], [[0], [1, 2]], slots[:2], 16)
    assert decodes.num_single == 2 and decodes.decode_only


class ReferenceAttention:
    """A new backend written in this file alone (the proof that one is one class): a token-major pool and one
    plain masked softmax per row, whatever its query length."""

    name = "reference"
    preferred_block_size = 8
    workspace_share = 0.0
    uses_persistent_block_table = False  # builds its tables from the lists

    def __init__(self, num_heads, num_kv_heads, head_dim, sliding_window, dtype, kernels=None, scale=None,
                 softcap=None):
        self.num_kv_heads, self.head_dim, self.group = num_kv_heads, head_dim, num_heads // num_kv_heads
        self.window, self.scale, self.softcap = sliding_window, scale or head_dim ** -0.5, softcap
        self.label = self.name

    def validate_block_size(self, block_size):
        return None

    def native_decode_kernels(self):
        return None  # its own attention: the runner must not bind the native decode step around it

    def kv_cache_shape(self, num_blocks, block_size):
        return (num_blocks, block_size, self.num_kv_heads, self.head_dim)

    def set_workspace_budget(self, tokens, micro_batches=1):
        pass  # keeps nothing between steps

    def truncate(self, seq_id, num_tokens):
        pass

    def release(self):
        pass

    def build_metadata(self, batch: CommonAttentionMetadata):
        rows, start = [], 0
        for length, context, table in zip(batch.query_lens, batch.context_lens, batch.block_tables):
            rows.append((start, length, context, torch.tensor(table[: -(-context // batch.block_size)])))
            start += length
        return batch.slot_mapping, rows

    def forward(self, q, k, v, k_cache, v_cache, meta, window=None):
        from llmctl.engine.layers.attention.paged import write_token_major

        window = self.window if window is None else window
        slot_mapping, rows = meta
        write_token_major(k_cache, v_cache, k, v, slot_mapping)
        out = torch.empty_like(q)
        for start, length, context, table in rows:
            keys, values = (cache[table].reshape(-1, self.num_kv_heads, self.head_dim)[:context]
                            .repeat_interleave(self.group, dim=1).float() for cache in (k_cache, v_cache))
            scores = torch.einsum("qhd,khd->hqk", q[start:start + length].float(), keys) * self.scale
            if self.softcap is not None:
                scores = torch.tanh(scores / self.softcap) * self.softcap
            q_pos = (context - length + torch.arange(length)).unsqueeze(1)
            k_pos = torch.arange(context).unsqueeze(0)
            allowed = k_pos <= q_pos
            if window is not None:
                allowed &= k_pos > q_pos - window
            probs = scores.masked_fill(~allowed, float("-inf")).softmax(-1)
            out[start:start + length] = torch.einsum("hqk,khd->qhd", probs, values).to(q.dtype)
        return out


def test_a_backend_defined_in_a_test_file_runs_the_engine(tmp_path, monkeypatch):
    """The runner needs nothing backend-specific: a backend of this file alone gives the torch backend's tokens
    and logits through chunked prefill, prefix-cache hits, prompt log-probs and a sliding window."""
    from test_cuda_logic import _run

    folder = make_tiny_model(tmp_path / "mistral", "mistral", sliding_window=48)
    with monkeypatch.context() as patch:
        patch.setattr("llmctl.engine.model_runner.select_backend", lambda *args: ReferenceAttention)
        ours_llm, ours, ours_rows = _run(folder, num_kv_blocks=512)
    runner = ours_llm.engine.executor.runner
    assert runner.attention.name == "reference" and runner.block_size == 8
    assert ours_llm.engine.get_stats()["prefix_cache_hit_rate"] > 0
    torch_llm, expected, expected_rows = _run(folder, num_kv_blocks=256, block_size=16)
    assert torch_llm.engine.executor.runner.attention.name == "torch"
    for a, b, rows_a, rows_b in zip(ours, expected, ours_rows, expected_rows):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert (rows_a - rows_b).abs().max().item() < 1e-4


def test_every_backend_of_the_package_has_each_member_of_the_protocol():
    """The runner calls the protocol's members on whichever backend `select_backend` picked; one missing from a
    backend would fail only at start-up on the machine that picks it (a CUDA one, for flash-attn)."""
    import llmctl.engine.layers.attention as attention

    members = set(attention.AttentionBackend.__annotations__) | {
        name for name in vars(attention.AttentionBackend) if not name.startswith("_")}
    assert {"native_decode_kernels", "build_metadata", "forward", "label"} <= members
    backends = [getattr(attention, name) for name in attention.__all__ if name.endswith("Attention")]
    assert len(backends) >= 2
    for backend in backends:
        assert not sorted(members - set(dir(backend))), f"{backend.__name__} lacks {sorted(members - set(dir(backend)))}"
