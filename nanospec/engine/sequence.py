"""One request's state as it moves through the engine: tokens, KV bookkeeping, sampling RNG.

Invariant used everywhere (prefill, decode, verify, preemption):
    target KV is valid for positions [0, num_computed); while decoding num_computed == len - 1,
    i.e. the last token is the one the next forward feeds.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from enum import Enum, auto

import torch


@dataclass
class SamplingParams:
    """vLLM-shaped sampling knobs. temperature 0 means greedy."""
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_tokens: int = 128
    seed: int | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    n: int = 1
    ignore_eos: bool = False

    def validate(self, where: str = "SamplingParams") -> None:
        if self.temperature < 0:
            raise ValueError(f"{where}: temperature must be >= 0, got {self.temperature}")
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"{where}: top_p must be in (0, 1], got {self.top_p}")
        if self.top_k == 0 or self.top_k < -1:
            raise ValueError(f"{where}: top_k must be -1 (off) or >= 1, got {self.top_k}")
        if self.max_tokens <= 0:
            raise ValueError(f"{where}: max_tokens must be > 0, got {self.max_tokens}")
        if self.n < 1:
            raise ValueError(f"{where}: n must be >= 1, got {self.n}")


class Status(Enum):
    WAITING = auto()
    RUNNING = auto()
    FINISHED = auto()


class Sequence:
    _ids = itertools.count()

    def __init__(self, prompt_token_ids: list[int], params: SamplingParams, *,
                 request_id: int = 0, sample_index: int = 0, prompt_key=None,
                 generator: torch.Generator | None = None):
        self.seq_id = next(Sequence._ids)
        self.request_id = request_id          # index of the prompt in generate()'s input
        self.sample_index = sample_index      # 0..n-1 within the request (GRPO group member)
        self.prompt_key = prompt_key if prompt_key is not None else tuple(prompt_token_ids)
        self.params = params
        self.token_ids: list[int] = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.logprobs: list[float] = []       # one per completion token, see sampler.py
        self.from_verify: list[bool] = []     # was the token emitted by a verify step with drafts
        self.status = Status.WAITING
        self.finish_reason: str | None = None
        self.block_table: list[int] = []
        self.spare_block: int | None = None   # the block the last KV rollback freed (BlockManager.truncate)
        self.num_computed = 0                 # target KV valid for positions < num_computed
        self.num_draft_computed = 0           # same for a drafter with its own KV (self/draft model)
        self.num_forwards = self.num_drafted = 0   # target forwards that emitted its tokens; drafts verified
        self.generator = generator            # per-request RNG (seeded requests); None = engine RNG
        # set by the RL rollout (rl/rollout.py), read by the draft controller and the prior drafter:
        self.predicted_len = 0.0              # predicted response length -> a length-class draft budget
        self.bubble = False                   # pre-generated in a bubble: shared as drafts, not a rollout

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[:self.num_prompt_tokens]

    @property
    def completion_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_completion_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def last_token(self) -> int:
        return self.token_ids[-1]

    @property
    def is_finished(self) -> bool:
        return self.status == Status.FINISHED

    def __repr__(self) -> str:
        return (f"Sequence(id={self.seq_id}, req={self.request_id}.{self.sample_index}, "
                f"len={len(self)}, computed={self.num_computed}, {self.status.name})")
