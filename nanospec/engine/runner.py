"""One model plus its paged KV cache: turns "these sequences, these new tokens" into one forward.

Every engine step is the same call: sequence b feeds `tokens[b]` (a prefill chunk, its last token, or
its last token + k drafts) at positions starts[b], starts[b]+1, ... The batch is padded to [B, Q];
padding writes to the null block and is never read back (see paged_attention.PagedKV).
A drafter with its own KV (self-drafter, draft model) owns a second Runner over the same block
tables: same slots, its own cache tensor.
"""
from __future__ import annotations

import torch

from nanospec.engine.cpu_linear import prepack_linears
from nanospec.engine.paged_attention import PagedKV
from nanospec.engine.sequence import Sequence
from nanospec.models.decoder import CausalLM


class Runner:
    def __init__(self, model: CausalLM, num_blocks: int, block_size: int):
        self.model = prepack_linears(model)      # its CPU decode steps multiply by prepacked weights
        self.block_size = block_size
        self.null_block = num_blocks
        self.cache = self._fresh_cache()
        self.device = self.cache.device

    def sleep(self) -> None:
        """Free the KV cache tensor (`LLM.sleep`); `wake_up` allocates a fresh one."""
        self.cache = None

    def wake_up(self) -> None:
        if self.cache is None:
            self.cache = self._fresh_cache()

    def _fresh_cache(self) -> torch.Tensor:
        """A pool uninitialised but for the null block: `zero_new_blocks` zeroes the rest as forwards
        reach it. Zeroed up front, every page of the pool (2 GiB by default on CPU) was written at every
        wake-up, once a GRPO step, though a rollout uses a fraction of it (docs/results.md)."""
        cache = self.model.new_kv_cache(self.null_block, self.block_size)
        cache[:, :, self.null_block * self.block_size:].zero_()
        self.zeroed = 0      # blocks [0, zeroed) hold zeros or written K/V
        return cache

    def zero_new_blocks(self, seqs: list[Sequence]) -> None:
        """Zero the blocks up to the highest one these sequences hold, the first time a forward reaches
        them. A masked key is still read: its attention weight is exp(-inf) = 0, but 0 x NaN = NaN, so
        every key slot read must hold a finite value; a block gets written only by a forward that holds it.
        The block manager hands blocks out from id 0 up (and again after `LLM.sleep`), so this zeroes
        about the blocks a rollout uses."""
        top = 1 + max(max(s.block_table, default=-1) for s in seqs)
        if top > self.zeroed:
            bs = self.block_size
            self.cache[:, :, self.zeroed * bs:top * bs].zero_()
            self.zeroed = top

    def host_rows(self, seqs: list[Sequence], tokens: list[list[int]], starts: list[int], Q: int,
                  nb: int) -> list[list[int]]:
        """Row b, built on the host for one H2D copy: ids | positions | slots (Q each) | block table (nb).
        Padding: token 0 at position 0 writing to the null slot; table entries past the sequence's are
        the null block (GraphRunner's static buffers use the same layout)."""
        bs, null, rows = self.block_size, self.null_block, []
        for s, t, a in zip(seqs, tokens, starts):
            bt, pad, end = s.block_table, Q - len(t), a + len(t)
            slots, p = [], a
            while p < end:   # one run of consecutive slots per block touched
                off = p % bs
                n = min(bs - off, end - p)
                slots.extend(range(bt[p // bs] * bs + off, bt[p // bs] * bs + off + n))
                p += n
            rows.append(t + [0] * pad + [*range(a, end)] + [0] * pad + slots + [null * bs] * pad
                        + bt + [null] * (nb - len(bt)))
        return rows

    def prepare(self, seqs: list[Sequence], tokens: list[list[int]], starts: list[int]):
        """-> input_ids [B, Q], positions [B, Q], PagedKV with slot_mapping [B, Q], key_slots [B, C]."""
        bs, dev = self.block_size, self.device
        self.zero_new_blocks(seqs)
        Q = max(map(len, tokens))
        nb = max(len(s.block_table) for s in seqs)
        C = max(a + len(t) for a, t in zip(starts, tokens))
        host = torch.tensor(self.host_rows(seqs, tokens, starts, Q, nb), device=dev)
        input_ids, positions, slot_mapping, table = host.split([Q, Q, Q, nb], 1)
        key_slots = (table[:, :, None] * bs + torch.arange(bs, device=dev)).flatten(1)[:, :C]  # key j -> slot
        index = None
        if sum(map(len, tokens)) < len(tokens) * Q:   # ragged: pack the real tokens (decoder.CausalLM.forward)
            index = torch.tensor([b * Q + i for b, t in enumerate(tokens) for i in range(len(t))], device=dev)
        return input_ids, positions, PagedKV(self.cache, slot_mapping, key_slots, index)

    @torch.inference_mode()
    def forward(self, seqs: list[Sequence], tokens: list[list[int]], starts: list[int],
                features: torch.Tensor | None = None) -> torch.Tensor:
        """-> hidden states [B, Q, D]; row b is valid for its first len(tokens[b]) positions.
        features: [N, D], one per real token in row order, for a draft head (drafters/head.py)."""
        input_ids, positions, kv = self.prepare(seqs, tokens, starts)
        return self.model(input_ids, positions, kv, features)
