"""Paged KV cache bookkeeping: fixed-size blocks, a free list, ref counts, prefix caching.

A sequence's KV lives in `seq.block_table` (block ids); position p is slot
`block_table[p // block_size] * block_size + p % block_size`.

Prefix caching (as in vLLM / nano-vllm): every *full* prompt block gets a hash chained over all
tokens before it. The G samples of a GRPO group have identical prompts, so the 2nd..G-th sample find
the first sample's blocks by hash and share them (ref count), and those tokens are prefilled once.
A freed block keeps its hash until it is handed out again, so a prompt seen in the previous step can
still hit. Only tokens after the last shared full block are computed per sample; when every block of
the prompt is shared, only its last token is (its logits are needed to sample). That token's K/V is
then written again into the shared block: the same tokens at the same positions, the same values,
as in vLLM. A partial last block is never shared (it will hold the sample's own tokens).

Drafts need slots before they are verified: `ensure` grows a table ahead, `truncate` rolls it back
after rejections. The block a rollback frees goes back to its sequence on its next `ensure` (if no
one took it meanwhile). Handed to the back of the free list instead, it would go to another row and
this row would get whichever block is oldest: within a rollout every sequence's KV would be spread
over the whole pool, and gathering it costs every later step more (docs/notebook.md).
"""
from __future__ import annotations

from nanospec.engine.sequence import Sequence


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, prefix_caching: bool = True):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"num_blocks and block_size must be >= 1, got {num_blocks}, {block_size}")
        self.num_blocks, self.block_size = num_blocks, block_size
        self.prefix_caching = prefix_caching
        self.ref_count = [0] * num_blocks
        self.block_hash: list[int | None] = [None] * num_blocks
        self.hash_to_block: dict[int, int] = {}
        self.free_blocks = dict.fromkeys(range(num_blocks))   # insertion-ordered set, O(1) removal

    @property
    def num_free(self) -> int:
        return len(self.free_blocks)

    def _take(self, block: int | None = None) -> int:
        if block is None:
            block = next(iter(self.free_blocks))
        del self.free_blocks[block]
        h = self.block_hash[block]
        if h is not None and self.hash_to_block.get(h) == block and self.ref_count[block] == 0:
            # a fresh allocation overwrites this block: forget the cached prefix it held
            del self.hash_to_block[h]
            self.block_hash[block] = None
        self.ref_count[block] += 1
        return block

    def blocks_needed(self, seq: Sequence, length: int) -> int:
        return max(0, -(-length // self.block_size) - len(seq.block_table))

    def allocate_prefill(self, seq: Sequence, length: int) -> bool:
        """Blocks for positions [0, length) of a sequence with no blocks; reuses cached prompt blocks.

        Sets seq.num_computed to the number of tokens whose KV is already there, at most length - 1:
        the last position is always computed (its logits are needed). Returns False if it does not fit.
        """
        assert not seq.block_table
        bs, tokens = self.block_size, seq.token_ids
        hashes, h = [], 0
        for b in range(min(seq.num_prompt_tokens, length) // bs):   # full blocks only
            h = hash((h, tuple(tokens[b * bs:(b + 1) * bs])))
            hashes.append(h)
        hits = []
        if self.prefix_caching:
            for h in hashes:
                block = self.hash_to_block.get(h)
                if block is None:
                    break
                hits.append(block)
        fresh_needed = -(-length // bs) - len(hits)
        fresh_free = self.num_free - sum(1 for b in hits if self.ref_count[b] == 0)
        if fresh_needed > fresh_free:
            return False
        for block in hits:
            if self.ref_count[block] == 0:
                del self.free_blocks[block]
            self.ref_count[block] += 1
            seq.block_table.append(block)
        seq.num_computed = min(len(hits) * bs, length - 1)
        for i in range(len(hits), -(-length // bs)):
            block = self._take()
            if self.prefix_caching and i < len(hashes):
                # registered now, written by this same prefill forward: a sibling scheduled in the
                # same batch reads it after every layer has stored its K/V (see decoder.Attention)
                self.block_hash[block] = hashes[i]
                self.hash_to_block[hashes[i]] = block
            seq.block_table.append(block)
        return True

    def ensure(self, seq: Sequence, length: int) -> bool:
        """Grow seq's block table to hold `length` tokens. False (and no change) if out of blocks."""
        need = self.blocks_needed(seq, length)
        if need > self.num_free:
            return False
        for _ in range(need):
            spare, seq.spare_block = seq.spare_block, None
            back = spare in self.free_blocks and self.block_hash[spare] is None   # not a cached prefix
            seq.block_table.append(self._take(spare if back else None))
        return True

    def truncate(self, seq: Sequence, length: int) -> None:
        """KV rollback after rejected drafts: drop blocks beyond `length` tokens."""
        keep = -(-length // self.block_size)
        while len(seq.block_table) > keep:
            seq.spare_block = seq.block_table.pop()     # the first block past `length`, last popped
            self._release(seq.spare_block)

    def free(self, seq: Sequence) -> None:
        for block in reversed(seq.block_table):
            self._release(block)
        seq.block_table = []
        seq.num_computed = seq.num_draft_computed = 0

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix: after a weight update the stored KV is from the old policy."""
        self.hash_to_block.clear()
        self.block_hash = [None] * self.num_blocks

    def rewind(self) -> None:
        """Hand free blocks out from the lowest id again (`LLM.sleep`, which frees the pool): the fresh
        pool is then zeroed only as far as the next requests reach (runner.Runner.zero_new_blocks)."""
        self.free_blocks = dict.fromkeys(sorted(self.free_blocks))

    def _release(self, block: int) -> None:
        self.ref_count[block] -= 1
        assert self.ref_count[block] >= 0, f"block {block} freed twice"
        if self.ref_count[block] == 0:
            self.free_blocks[block] = None
