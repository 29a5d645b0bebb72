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
        bs, dev = self.block_size, self.device
        B, Q = len(seqs), max(len(t) for t in tokens)
        lens = torch.tensor([len(t) for t in tokens], device=dev)
        start = torch.tensor(starts, device=dev)
        input_ids = torch.tensor([t + [0] * (Q - len(t)) for t in tokens], device=dev)
        nb = max(len(s.block_table) for s in seqs)
        table = torch.tensor([s.block_table + [self.null_block] * (nb - len(s.block_table)) for s in seqs],
                             device=dev)                                        # [B, nb]
        q_idx = torch.arange(Q, device=dev)
        valid = q_idx < lens[:, None]                                           # [B, Q]
        positions = torch.where(valid, start[:, None] + q_idx, 0)
        C = int((start + lens).max())
        key_pos = torch.arange(C, device=dev).expand(B, C)
        null_slot = self.null_block * bs
        slot_mapping = torch.where(valid, self.slots(table, positions), null_slot)
        return input_ids, positions, PagedKV(self.cache, slot_mapping, self.slots(table, key_pos))

    def slots(self, table: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        bs = self.block_size
        return table.gather(1, positions // bs) * bs + positions % bs

    @torch.inference_mode()
    def forward(self, seqs: list[Sequence], tokens: list[list[int]], starts: list[int]) -> torch.Tensor:
        """-> hidden states [B, Q, D]; row b is valid for its first len(tokens[b]) positions."""
        input_ids, positions, kv = self.prepare(seqs, tokens, starts)
        return self.model(input_ids, positions, kv)
