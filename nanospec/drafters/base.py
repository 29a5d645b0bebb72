"""The one small interface every drafter implements.

A drafter guesses the next k tokens of each running sequence; the target model then verifies all of
them in one batched forward (engine/verify.py). Two kinds exist:

* deterministic drafters (n-gram, suffix tree, prior rollout, bubble drafts): the guess is a point
  mass, q(x) = 1 for the drafted token. They return tokens only (`q=None`).
* stochastic drafters (4-bit self-drafter, draft model): the guess is *sampled* from a distribution
  q, and exact verification needs q itself (Leviathan et al. 2023, Alg. 1). They return
  `q: [B, k_max, V]` with the same temperature/top-k/top-p processing as the target.

Lifecycle hooks, all optional: `observe_hidden(...)` after a forward (only `wants_hidden` drafters),
`observe(seq)` when a sequence finishes (history-based drafters learn
from it), `free(seq)` when a sequence leaves the engine (finished or aborted; drop per-seq state),
`refresh(model)` after each policy update (weight sync), `next_step()` once per rollout step.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from nanospec.engine.sequence import Sequence


@dataclass
class Proposal:
    tokens: list[list[int]]                 # per sequence, 0..k_i draft tokens
    q: torch.Tensor | None = None           # [B, k_max, V] draft probs (stochastic drafters only)
    sources: list[str] | None = None        # per sequence, the name of the drafter that proposed
    lenient_q: torch.Tensor | None = None   # [B, k_max] LOSSY SPEC-RL rule only: q(x)=p_old(x)/lenience
    # per sequence, per draft token: the drafter's estimate of P(accepted | the drafts before it were),
    # or None (no estimate); controller.plan_drafts keeps only the drafts that pay for their verify cost
    confidence: list[list[float] | None] | None = None

    def __post_init__(self):
        if self.sources is None:
            self.sources = [""] * len(self.tokens)


@dataclass
class DraftTarget:
    """What a drafter with a model of its own sees of the engine, and no more: the target model (the
    nf4 self-drafter quantizes it), its vocabulary, the KV block geometry the drafter's own cache
    shares, the device, the tokenizer (a draft model must speak the same one), and, where the engine
    replays CUDA graphs, how to build a graph runner over that geometry for the drafter's model."""
    model: torch.nn.Module
    vocab_size: int
    num_blocks: int
    block_size: int
    device: torch.device
    tokenizer: object = None
    name: str = "the target"
    graph_runner: Callable | None = None    # (model, features: bool) -> cuda_graphs.GraphRunner, captured


def check_budget(seqs: list[Sequence], num_tokens: list[int]) -> None:
    """The propose() contract shared by every drafter: one non-negative budget per sequence."""
    if len(num_tokens) != len(seqs):
        raise ValueError(f"num_tokens: expected one budget per sequence ({len(seqs)}), got {len(num_tokens)}")
    for k in num_tokens:
        if k < 0:
            raise ValueError(f"num_tokens: budgets must be >= 0, got {k}")


class Drafter:
    name: str = "drafter"
    stochastic: bool = False   # True: propose() fills Proposal.q
    needs_kv: bool = False     # True: the engine runs prefill(seqs) for it (own KV cache)
    lossy: bool = False        # True only for explicitly lossy modes (e.g. prior-rollout lenience)
    confident: bool = False    # True: propose() fills Proposal.confidence
    wants_hidden: bool = False # True: the engine calls observe_hidden after every forward (a draft head)
    max_draft_tokens: int | None = None   # its spec's num_draft_tokens (registry.build): never asked for more

    @property
    def sources(self) -> tuple[str, ...]:
        """Every name this drafter can put in Proposal.sources (the policy tracks each one)."""
        return (self.name,)

    def propose(self, seqs: list[Sequence], num_tokens: list[int]) -> Proposal:
        """Draft up to num_tokens[i] tokens after seqs[i].token_ids (fewer, or none, is fine).
        Default: one `draft_one` call per sequence (the deterministic, per-sequence drafters)."""
        check_budget(seqs, num_tokens)
        tokens = [self.draft_one(s, k) if k > 0 else [] for s, k in zip(seqs, num_tokens)]
        return Proposal(tokens=tokens, sources=[self.name if t else "" for t in tokens])

    def draft_one(self, seq: Sequence, k: int) -> list[int]:
        """At most k draft tokens for one sequence (used by the default `propose`)."""
        raise NotImplementedError

    def observe_hidden(self, seqs: list[Sequence], starts: list[int], counts: list[int],
                       hidden: torch.Tensor) -> None:
        """The target's final hidden states [B, Q, D] of the last forward: row b's first counts[b] are
        those of positions starts[b].., the ones the sequence kept (its prompt, or last token + accepted
        drafts). Only for drafters with `wants_hidden` (drafters/head.py); the others never see them.
        `hidden` may be a view of a CUDA graph's static output buffer: copy what outlives the next step."""

    def observe(self, seq: Sequence) -> None:
        """A sequence finished: its prompt and completion may be used as future drafts."""

    def free(self, seq: Sequence) -> None:
        """A sequence left the engine (finished or aborted): forget its per-sequence state."""

    def refresh(self, model: torch.nn.Module) -> None:
        """The policy's weights changed (after an optimizer step): resync anything derived."""

    def next_step(self) -> None:
        """A new rollout step begins (history drafters age their windows)."""
