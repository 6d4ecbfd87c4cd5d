"""The paged KV cache's bookkeeping: a fixed pool of ref-counted blocks and per-sequence tables.

Owns which block holds which tokens. Full blocks are registered under a chained hash (keyed with
a per-process random secret, so one tenant cannot probe another's prompts by timing) and reused
by later sequences with the same prefix; a hit is confirmed by comparing the stored parent hash
and token ids, never by the hash alone. Freed blocks keep their contents until evicted in LRU
order.
"""

from __future__ import annotations

import hashlib
import os
import struct
from collections import OrderedDict
from typing import Optional

from llmctl.engine.sequence import Sequence


class BlockAccountingError(RuntimeError):
    """A block was freed twice or a table references a block it does not own (an engine bug)."""


class Block:
    __slots__ = ("block_id", "ref_count", "block_hash", "parent_hash", "token_ids")

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_count = 0
        self.block_hash: Optional[bytes] = None
        self.parent_hash: Optional[bytes] = None
        self.token_ids: Optional[tuple[int, ...]] = None


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        if num_blocks < 1:
            raise ValueError("the KV cache needs at least one block")
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self._cached: dict[bytes, int] = {}
        self._hash_key = os.urandom(32)
        self.prefix_queries = 0
        self.prefix_hits = 0

    # ---- capacity -------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # ---- prefix cache ---------------------------------------------------------------------
    def _caches(self, seq: Sequence) -> bool:
        return self.enable_prefix_caching or seq.shares_with_siblings

    def hash_block(self, parent: Optional[bytes], token_ids: tuple[int, ...], salt: bytes = b"") -> bytes:
        digest = hashlib.blake2b(key=self._hash_key, digest_size=16)
        digest.update(parent if parent is not None else b"root:" + salt)
        digest.update(struct.pack(f"<{len(token_ids)}q", *token_ids))
        return digest.digest()

    def find_cached_prefix(self, seq: Sequence) -> list[int]:
        """Block ids already holding this sequence's leading full blocks (never its last token).
        Sequences that want prompt log-probs or pool every token compute their whole prompt, so they get none."""
        if not self._caches(seq) or getattr(seq.params, "prompt_logprobs", None) is not None \
                or (seq.pooling is not None and seq.pooling.reads_prefix):
            return []
        found: list[int] = []
        parent: Optional[bytes] = None
        usable = (seq.num_tokens - 1) // self.block_size
        for i in range(usable):
            tokens = tuple(seq.token_ids[i * self.block_size:(i + 1) * self.block_size])
            block_hash = self.hash_block(parent, tokens, seq.cache_salt)
            block_id = self._cached.get(block_hash)
            if block_id is None:
                break
            block = self.blocks[block_id]
            if block.parent_hash != parent or block.token_ids != tokens:
                break  # hash collision: treat as a miss
            found.append(block_id)
            parent = block_hash
        return found

    def register_full_blocks(self, seq: Sequence) -> None:
        """Publish the sequence's fully computed blocks so that later prompts can share them."""
        if not self._caches(seq):
            return
        full = min(seq.num_computed_tokens // self.block_size, len(seq.block_table))
        parent: Optional[bytes] = None
        for i in range(full):
            block = self.blocks[seq.block_table[i]]
            if block.block_hash is None:
                tokens = tuple(seq.token_ids[i * self.block_size:(i + 1) * self.block_size])
                block_hash = self.hash_block(parent, tokens, seq.cache_salt)
                if block_hash not in self._cached:
                    block.block_hash, block.parent_hash, block.token_ids = block_hash, parent, tokens
                    self._cached[block_hash] = block.block_id
                else:
                    parent = block_hash
                    continue
            parent = block.block_hash

    # ---- allocation -----------------------------------------------------------------------
    def allocate(self, seq: Sequence, num_new_tokens: int, cached_blocks: Optional[list[int]] = None,
                 num_lookahead_tokens: int = 0) -> bool:
        """Give `seq` blocks for its next `num_new_tokens` plus `num_lookahead_tokens` slots past its
        known tokens (the draft tokens of a verify row); all or nothing. `cached_blocks` (from
        `find_cached_prefix`) are shared first and count as computed."""
        cached_blocks = cached_blocks or []
        computed = seq.num_computed_tokens + len(cached_blocks) * self.block_size
        # async scheduling: the tokens of a step in flight already have their slots
        ahead = seq.num_in_flight_tokens + num_new_tokens + num_lookahead_tokens
        needed = self.blocks_needed(computed + ahead) - len(seq.block_table) - len(cached_blocks)
        reusable_free = sum(1 for b in cached_blocks if self.blocks[b].ref_count == 0)
        if needed > self.num_free_blocks - reusable_free:
            return False
        if seq.num_computed_tokens == seq.num_in_flight_tokens == 0 and self._caches(seq):  # a first admission
            self.prefix_queries += (seq.num_tokens - 1) // self.block_size
            self.prefix_hits += len(cached_blocks)
        for block_id in cached_blocks:
            self._take(block_id)
        seq.block_table.extend(cached_blocks)
        seq.num_computed_tokens = computed
        for _ in range(max(needed, 0)):
            seq.block_table.append(self._take(self._evict_one()))
        return True

    def free(self, seq: Sequence) -> None:
        """Return the sequence's blocks; tail blocks are evicted first (they are least shareable)."""
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            if block.ref_count <= 0:
                raise BlockAccountingError(f"block {block_id} freed twice")
            block.ref_count -= 1
            if block.ref_count == 0:
                self._free[block_id] = None
        seq.block_table = []

    def free_lookahead(self, seq: Sequence) -> int:
        """Return the tail blocks past the sequence's known tokens: lookahead slots whose draft tokens
        were rejected. They were never published (only computed tokens' full blocks are), so they go
        to the front of the free list. Returns how many blocks came back."""
        keep = self.blocks_needed(seq.num_tokens)
        freed = 0
        while len(seq.block_table) > keep:
            block = self.blocks[seq.block_table.pop()]
            if block.ref_count != 1 or block.block_hash is not None:
                raise BlockAccountingError(f"lookahead block {block.block_id} is shared or published")
            block.ref_count = 0
            self._free[block.block_id] = None
            self._free.move_to_end(block.block_id, last=False)
            freed += 1
        return freed

    def reset_prefix_cache(self) -> bool:
        """Forget all cached prefixes; only possible when no block is in use."""
        if self.num_free_blocks != self.num_blocks:
            return False
        for block in self.blocks:
            block.block_hash = block.parent_hash = block.token_ids = None
        self._cached.clear()
        return True

    def _evict_one(self) -> int:
        block_id, _ = self._free.popitem(last=False)
        self._free[block_id] = None  # _take removes it again
        block = self.blocks[block_id]
        if block.block_hash is not None:
            if self._cached.get(block.block_hash) == block_id:
                del self._cached[block.block_hash]
            block.block_hash = block.parent_hash = block.token_ids = None
        return block_id

    def _take(self, block_id: int) -> int:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            self._free.pop(block_id)
        block.ref_count += 1
        return block_id

    def check_invariants(self, live: list[Sequence]) -> None:
        """Every block's ref count equals the number of live tables holding it; free iff unreferenced."""
        counts = [0] * self.num_blocks
        for seq in live:
            for block_id in seq.block_table:
                counts[block_id] += 1
        for block in self.blocks:
            if block.ref_count != counts[block.block_id]:
                raise BlockAccountingError(f"block {block.block_id}: ref_count {block.ref_count} != {counts[block.block_id]} holders")
            if (block.ref_count == 0) != (block.block_id in self._free):
                raise BlockAccountingError(f"block {block.block_id}: free-list membership is wrong")
