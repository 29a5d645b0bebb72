"""Continuous batching: which sequences run in the next engine step, and preemption.

Each step is either a prefill step (new or preempted sequences, as many as fit) or a decode step (all
running sequences; each feeds its last token plus its draft tokens). When KV blocks run out during
decode, the newest running sequence is preempted: its blocks are freed and it goes back to the front
of the queue to be recomputed later (vLLM's "recompute" preemption). Recomputing prefills every token
but the last and samples nothing, so preemption never changes what is sampled.
"""
from __future__ import annotations

from collections import deque

from nanospec.engine.block_manager import BlockManager
from nanospec.engine.sequence import Sequence, Status


class Scheduler:
    def __init__(self, blocks: BlockManager, max_num_seqs: int, max_num_batched_tokens: int):
        self.blocks = blocks
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    @staticmethod
    def prefill_end(seq: Sequence) -> int:
        """Fresh prompt: compute all of it and sample. Recompute: all but the last token (no sample)."""
        return seq.num_prompt_tokens if len(seq) == seq.num_prompt_tokens else len(seq) - 1

    def schedule(self) -> tuple[list[Sequence], bool]:
        """-> (sequences, is_prefill). Decode steps guarantee capacity for one new token each."""
        batch, tokens = [], 0
        while self.waiting and len(self.running) + len(batch) < self.max_num_seqs:
            seq = self.waiting[0]
            end = self.prefill_end(seq)
            if batch and tokens + end > self.max_num_batched_tokens:
                break
            if not self.blocks.allocate_prefill(seq, end):
                break
            tokens += end - seq.num_computed
            seq.status = Status.RUNNING
            batch.append(self.waiting.popleft())
        if batch:
            self.running.extend(batch)
            return batch, True
        if not self.running and self.waiting:
            raise RuntimeError(f"KV cache too small: {self.blocks.num_blocks} blocks of "
                               f"{self.blocks.block_size} cannot hold one sequence of {len(self.waiting[0])} tokens")
        decode: list[Sequence] = []
        for seq in list(self.running):
            if seq.status != Status.RUNNING:        # preempted below in this same loop
                continue
            while not self.blocks.ensure(seq, len(seq)):
                victim = self.running[-1]
                self.preempt(victim)
                if victim is seq:
                    break
            else:
                decode.append(seq)
        return decode, False

    def preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.blocks.free(seq)
        seq.status = Status.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def finish(self, seq: Sequence, reason: str) -> None:
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.blocks.free(seq)
        seq.status = Status.FINISHED
        seq.finish_reason = reason
