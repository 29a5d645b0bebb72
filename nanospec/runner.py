"""One model plus its paged KV cache: turns "these sequences, these new tokens" into one forward.

Every engine step is the same call: sequence b feeds `tokens[b]` (a prefill chunk, its last token, or
its last token + k drafts) at positions starts[b], starts[b]+1, ... The batch is padded to [B, Q];
padding writes to the null block and is never read back (see model.PagedKV).
A drafter with its own KV (self-drafter, draft model) owns a second Runner over the same block
tables: same slots, its own cache tensor.
"""
from __future__ import annotations

import torch

from .model import CausalLM, PagedKV
from .sequence import Sequence


class Runner:
    def __init__(self, model: CausalLM, num_blocks: int, block_size: int):
        self.model = model
        self.block_size = block_size
        self.null_block = num_blocks
        self.cache = model.new_kv_cache(num_blocks, block_size)
        self.device = self.cache.device

    def prepare(self, seqs: list[Sequence], tokens: list[list[int]], starts: list[int]):
        """-> input_ids [B, Q], positions [B, Q], PagedKV with slot_mapping [B, Q], key_slots [B, C]."""
        bs, dev, null = self.block_size, self.device, self.null_block
        Q = max(map(len, tokens))
        nb = max(len(s.block_table) for s in seqs)
        C = max(a + len(t) for a, t in zip(starts, tokens))
        rows = []   # built on the host, one H2D copy: ids | positions | slots | block table
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
        host = torch.tensor(rows, device=dev)
        input_ids, positions, slot_mapping, table = host.split([Q, Q, Q, nb], 1)
        key_slots = (table[:, :, None] * bs + torch.arange(bs, device=dev)).flatten(1)[:, :C]  # key j -> slot
        index = None
        if sum(map(len, tokens)) < len(tokens) * Q:   # ragged: pack the real tokens (model.CausalLM.forward)
            index = torch.tensor([b * Q + i for b, t in enumerate(tokens) for i in range(len(t))], device=dev)
        return input_ids, positions, PagedKV(self.cache, slot_mapping, key_slots, index)

    @torch.inference_mode()
    def forward(self, seqs: list[Sequence], tokens: list[list[int]], starts: list[int]) -> torch.Tensor:
        """-> hidden states [B, Q, D]; row b is valid for its first len(tokens[b]) positions."""
        input_ids, positions, kv = self.prepare(seqs, tokens, starts)
        return self.model(input_ids, positions, kv)
