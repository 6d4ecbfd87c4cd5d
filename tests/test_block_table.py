"""The persistent device block table (engine/block_table.py) and the Triton backend reading it.

Driven by the real scheduler and block manager over random workloads (sequences joining, growing by random
token counts across block boundaries, preempted and recomputed, sharing cached prefixes, verifying drafts and
rolling rejected ones back, aborted, finishing), each step's rows equal the tables built from the lists, and the
entries written are exactly the entries that changed. Then the Triton backend's metadata from the table equals
the list-built metadata, and the engine on `attention_backend="triton"` (interpreted on CPU) gives bitwise the
list path's logits through preemption and prefix-cache hits.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_block_manager import BLOCK_SIZE, NUM_BLOCKS, SchedulerBlockMachine

from llmctl.engine.block_table import PersistentBlockTable

CPU = torch.device("cpu")


def list_table(block_tables: list[list[int]], width: int) -> torch.Tensor:
    """The step's tables from the lists, cut or padded with zeros to `width` (what the list paths build)."""
    cut = [table[:width] for table in block_tables]
    return torch.tensor([table + [0] * (width - len(table)) for table in cut], dtype=torch.int32).view(-1, width)


def checked_update(table: PersistentBlockTable, seq_ids: list[int], block_tables: list[list[int]]):
    """`table.update`, checked: the step's rows equal the lists' table, the pad row stays zeros, and the
    entries written are the entries that changed. Returns (rows, entries written)."""
    before, written = table.table.clone(), table.entries_written
    view = table.update(seq_ids, block_tables)
    assert len(set(view.rows)) == len(view.rows) and view.pad_row not in view.rows
    assert torch.equal(table.table[view.rows], list_table(block_tables, table.width))
    assert not table.table[view.pad_row].any()
    count = table.entries_written - written
    assert count == int((table.table != before).sum()), "an entry written that did not change, or one missed"
    return view.rows, count


class TableMachine(SchedulerBlockMachine):
    """The scheduler machine of test_block_manager.py, its "forward" also updating a persistent table of as
    many rows as the scheduler's max_num_seqs (10 sequences may live: rows get reclaimed)."""

    counts = {"steps": 0, "reused": 0, "moved": 0, "shrunk": 0, "rebuilt": 0, "silent": 0}

    def __init__(self):
        super().__init__()
        self.table = PersistentBlockTable(self.scheduler.config.max_num_seqs, NUM_BLOCKS, CPU)
        self.seen: dict[int, tuple[int, list[int]]] = {}  # seq id -> (row, its list) at its last step
        self.owner: dict[int, int] = {}  # row -> the seq id it last held

    def _forward(self, out) -> None:
        super()._forward(out)
        ids = [item.seq.seq_id for item in out.scheduled]
        tables = [item.seq.block_table for item in out.scheduled]
        copies = [list(table) for table in tables]
        rows, written = checked_update(self.table, ids, tables)
        assert tables == copies  # the scheduler's lists are read, never changed
        self._observe(ids, rows, copies, written)

    def _observe(self, ids, rows, tables, written) -> None:
        """What kinds of change the workloads made (the test below asserts each happened)."""
        counts = type(self).counts
        counts["steps"] += 1
        counts["silent"] += written == 0
        for seq_id, row, table in zip(ids, rows, tables):
            counts["reused"] += self.owner.get(row, seq_id) != seq_id
            self.owner[row] = seq_id
            if seq_id in self.seen:
                last_row, last = self.seen[seq_id]
                counts["moved"] += last_row != row
                counts["shrunk"] += len(table) < len(last)
                counts["rebuilt"] += bool(table and last and table[0] != last[0])
            self.seen[seq_id] = (row, table)


TableMachine.TestCase.settings = settings(max_examples=25, stateful_step_count=30, deadline=None,
                                          derandomize=True, suppress_health_check=[HealthCheck.too_slow])
TestTableMachine = TableMachine.TestCase


def test_table_machine_saw_reclaimed_rows_rollbacks_rebuilds_and_silent_steps():
    """The machine above is only meaningful if rows were reclaimed for other sequences, tables shrank (rolled-back
    drafts, preemption then a smaller first chunk) and were rebuilt on other blocks (recomputed after preemption),
    and many steps wrote nothing."""
    if TableMachine.counts["steps"] == 0:  # run on its own (e.g. `-k`)
        from hypothesis.stateful import run_state_machine_as_test

        run_state_machine_as_test(TableMachine, settings=settings(max_examples=15, stateful_step_count=30,
                                                                  deadline=None, derandomize=True))
    counts = TableMachine.counts
    assert min(counts["reused"], counts["shrunk"], counts["rebuilt"]) > 0, counts
    assert counts["silent"] > counts["steps"] // 10, counts


@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_random_steps_keep_the_rows_exact_and_write_only_changes(data):
    """Sequences join (some on another's cached prefix), grow by 0-9 tokens a step across 4-token blocks, roll
    back, are preempted and rejoin on new blocks, finish; each step a random subset of at most the table's three
    rows runs. Rows come and go more than the scheduler machine's: sequences come back on other rows."""
    table = PersistentBlockTable(3, 6, CPU)
    free = list(range(24))
    tokens: dict[int, int] = {}
    lists: dict[int, list[int]] = {}
    rows_of: dict[int, int] = {}
    moved = 0
    for step in range(data.draw(st.integers(5, 25), label="steps")):
        for seq_id in list(lists):
            action = data.draw(st.sampled_from(["grow"] * 5 + ["rollback", "preempt", "finish"]), label="action")
            if action == "finish" or action == "preempt":
                free += lists.pop(seq_id)
                tokens.pop(seq_id)
                if action == "preempt":  # rejoins: recomputed on blocks it takes again
                    tokens[seq_id], lists[seq_id] = 0, []
            elif action == "rollback" and lists[seq_id]:
                free.append(lists[seq_id].pop())
                tokens[seq_id] = min(tokens[seq_id], 4 * len(lists[seq_id]))
        if len(lists) < 5 and data.draw(st.booleans(), label="join"):
            donor = data.draw(st.sampled_from(sorted(lists)), label="prefix of") if lists else None
            lists[100 + step] = list(lists[donor][:1]) if donor is not None else []  # a shared cached block
            tokens[100 + step] = 4 * len(lists[100 + step])
        for seq_id in lists:
            tokens[seq_id] = min(tokens[seq_id] + data.draw(st.integers(0, 9), label="tokens"), 24)
            while 4 * len(lists[seq_id]) < tokens[seq_id]:
                lists[seq_id].append(free.pop(data.draw(st.integers(0, len(free) - 1), label="block")))
        scheduled = data.draw(st.lists(st.sampled_from(sorted(lists)), unique=True, max_size=3), label="run") \
            if lists else []
        rows, _ = checked_update(table, scheduled, [lists[seq_id] for seq_id in scheduled])
        moved += sum(rows_of.get(seq_id, row) != row for seq_id, row in zip(scheduled, rows))
        rows_of.update(zip(scheduled, rows))
    MOVED.append(moved)


MOVED: list[int] = []


def test_random_steps_moved_sequences_to_other_rows():
    if not MOVED:
        test_random_steps_keep_the_rows_exact_and_write_only_changes()
    assert sum(MOVED) > 0


def test_a_decode_writes_only_the_block_it_crosses_into():
    table = PersistentBlockTable(2, 4, CPU)
    assert checked_update(table, [7, 8], [[5, 3], [9]]) == ([0, 1], 3)
    assert checked_update(table, [8, 7], [[9], [5, 3]]) == ([1, 0], 0)  # rows kept by seq id, any order
    assert checked_update(table, [7], [[5, 3, 0]]) == ([0], 0)  # block 0 over a zero entry: nothing changed
    assert checked_update(table, [7], [[5, 3, 0, 2, 6]]) == ([0], 1)  # cut to the table's width
    assert checked_update(table, [7], [[5]]) == ([0], 2)  # a rollback zeroes the tail


def test_the_least_recently_scheduled_row_is_reclaimed_and_a_step_over_the_rows_refused():
    table = PersistentBlockTable(2, 3, CPU)
    checked_update(table, [1, 2], [[4], [5, 6]])
    checked_update(table, [2], [[5, 6]])
    assert checked_update(table, [3, 2], [[4, 1], [5, 6]]) == ([0, 1], 1)  # 1's row: its block 4 stays
    with pytest.raises(ValueError, match="3 sequences is over the persistent block table's 2 rows"):
        table.update([1, 2, 3], [[1], [2], [3]])
    table.release()
    assert not table.table.any() and checked_update(table, [3], [[5, 1]]) == ([0], 2)


@pytest.fixture(scope="module")
def triton_backend():
    pytest.importorskip("triton")
    from llmctl.engine.kernels.triton import interpreter_enabled

    if not interpreter_enabled():
        pytest.skip("triton was imported before TRITON_INTERPRET=1 could be set")
    from llmctl.engine.layers.attention import TritonAttention

    return TritonAttention(8, 2, 64, None, dtype=torch.float32)


def batches(table: PersistentBlockTable):
    """A three-row batch (a decode, a verify row, a prompt) with tables longer than their contexts, from the lists
    and with its rows in `table`."""
    from llmctl.engine.layers.attention import CommonAttentionMetadata

    ids, tables = [4, 5, 6], [[3, 9, 4], [7, 1, 2, 8], [5, 6]]
    table.update([1, 2], [[8, 8], [1]])  # rows 0 and 1 taken, so the batch's rows are not 0..2
    rows = table.update(ids, tables)
    args = (ids, [1, 3, 20], [17, 40, 20], tables, torch.zeros(24, dtype=torch.long), 16)
    return CommonAttentionMetadata(*args), CommonAttentionMetadata(*args, table_rows=rows)


def used_blocks(meta) -> list[list[int]]:
    return [row[:-(-context // 16)] for row, context in zip(meta.block_tables.tolist(), meta.context_lens.tolist())]


def test_triton_metadata_gathers_the_lists_tables_from_the_persistent_rows(triton_backend):
    table = PersistentBlockTable(5, 4, CPU)
    from_lists, from_table = (triton_backend.build_metadata(batch) for batch in batches(table))
    assert used_blocks(from_table) == used_blocks(from_lists) == [[3, 9], [7, 1, 2], [5, 6]]
    assert from_table.block_tables.shape == (3, 3)
    assert torch.equal(from_table.query_starts, from_lists.query_starts)
    assert torch.equal(from_table.context_lens, from_lists.context_lens)


def test_full_graph_metadata_refills_from_the_persistent_rows_in_place(triton_backend):
    from llmctl.engine.layers.attention import CommonAttentionMetadata

    table = PersistentBlockTable(5, 4, CPU)
    _, batch = batches(table)
    decode = CommonAttentionMetadata(batch.seq_ids, [1, 1, 1], batch.context_lens, batch.block_tables,
                                     torch.tensor([57, 39, 82]), 16, table_rows=batch.table_rows)
    static = triton_backend.static_decode_metadata(4, 64, 16, CPU)
    addresses = [t.data_ptr() for t in (static.slot_mapping, static.context_lens, static.block_tables)]
    triton_backend.fill_decode_metadata(static, decode)
    assert static.context_lens.tolist() == [17, 40, 20, 0] and static.slot_mapping.tolist() == [57, 39, 82, -1]
    assert static.block_tables.tolist() == [[3, 9, 4, 0], [7, 1, 2, 8], [5, 6, 0, 0], [0, 0, 0, 0]]
    assert addresses == [t.data_ptr() for t in (static.slot_mapping, static.context_lens, static.block_tables)]
    wide = PersistentBlockTable(5, 3, CPU)
    _, narrow = batches(wide)
    with pytest.raises(ValueError, match="4 blocks wide are over the persistent block table's 3"):
        triton_backend.fill_decode_metadata(static, CommonAttentionMetadata(
            narrow.seq_ids, [1, 1, 1], narrow.context_lens, narrow.block_tables, torch.tensor([1, 2, 3]), 16,
            table_rows=narrow.table_rows))


def on_both_paths(folder, prompts, max_tokens, **engine) -> list:
    """The engine on the Triton backend with the persistent table, then with the lists' tables every step (as
    before the table): per run, (engine, greedy tokens, logits rows)."""
    from test_cuda_graphs import recorded_logits

    from llmctl.engine import LLM

    runs = []
    for persistent in (True, False):
        llm = LLM(str(folder), skip_tokenizer_init=True, dtype="float32", device="cpu", attention_backend="triton",
                  max_num_seqs=4, block_size=4, **engine)
        runner = llm.engine.executor.runner
        assert isinstance(runner.block_table, PersistentBlockTable)
        if not persistent:
            runner.block_table = None
        runs.append((llm.engine, *recorded_logits(llm, prompts, max_tokens=max_tokens)))
        if persistent:
            assert runner.block_table.entries_written > 0
            assert not runner.block_table.table.any()  # the idle engine released its rows
    (_, tokens, logits), (_, list_tokens, list_logits) = runs
    assert tokens == list_tokens
    for ours, expected in zip(logits, list_logits):
        assert torch.equal(ours, expected)
    return runs


def test_engine_on_the_persistent_table_gives_the_list_paths_logits_through_preemption_and_prefix_hits(
        triton_backend, tiny_models):
    """A pool of 10 blocks of 4 tokens for three 16-24-token prompts growing 6 tokens each (some preempted and
    recomputed) that share a 16-token prefix (cached blocks at the head of later tables)."""
    shared = [(5 * i + 2) % 400 + 3 for i in range(16)]
    prompts = [shared + [(11 * i + 7 * j) % 400 + 3 for j in range(4 * i)] for i in range(3)]
    for engine, *_ in on_both_paths(tiny_models["llama"], prompts, 6, max_model_len=32, num_kv_blocks=10,
                                    max_num_batched_tokens=64, enable_prefix_caching=True):
        assert engine.scheduler.num_preemptions > 0 and engine.get_stats()["prefix_cache_hit_rate"] > 0


def test_engine_on_the_persistent_table_gives_the_list_paths_logits_with_rolled_back_drafts(
        triton_backend, tiny_models):
    """n-gram drafts on repetitive prompts: verify rows on lookahead blocks, the rejected drafts' blocks handed
    back (tables shrink between steps)."""
    prompts = [[5, 6, 7, 8] * 4, [9, 10, 11] * 5]
    speculation = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
    for engine, *_ in on_both_paths(tiny_models["llama"], prompts, 10, max_model_len=64, num_kv_blocks=32,
                                    speculative_config=speculation):
        stats = engine.get_stats()
        assert stats["spec_decode_num_draft_tokens"] > stats["spec_decode_num_accepted_tokens"] > 0
