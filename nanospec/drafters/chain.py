"""Several drafting methods tried in order per sequence (`speculative: [prior, suffix, ...]`).

Why: history drafters are free but often have nothing to say (a new prompt, a diverged sample),
while a model drafter always guesses but costs a forward. `ChainDrafter([prior, suffix, self_nf4])`
asks each member only about the sequences that earlier members left without a draft.

Mixing point-mass and sampled drafts in one verify: if any member returns q [b, k, V], the chain's
q [B, k_max, V] holds that member's rows as is and one-hot rows (q = 1 on the drafted token) for
rows drafted deterministically, which is exactly the point-mass case of the same acceptance rule.
Entries past a row's draft length are 0 and ignored by verify. `lenient_q` is merged the same way
with 1.0 (the exact rule) where a member gave none.
"""
from __future__ import annotations

import torch

from nanospec.engine.sequence import Sequence
from nanospec.drafters.base import Drafter, Proposal, check_budget


class ChainDrafter(Drafter):
    name = "chain"

    def __init__(self, drafters: list[Drafter]):
        if not drafters:
            raise ValueError("ChainDrafter: drafters must be a non-empty list")
        self.drafters = list(drafters)
        self.stochastic = any(d.stochastic for d in self.drafters)
        self.needs_kv = any(d.needs_kv for d in self.drafters)
        self.lossy = any(d.lossy for d in self.drafters)
        self.confident = any(d.confident for d in self.drafters)
        self.wants_hidden = any(d.wants_hidden for d in self.drafters)

    @property
    def sources(self) -> tuple[str, ...]:
        return tuple(n for d in self.drafters for n in d.sources)

    def propose(self, seqs: list[Sequence], num_tokens: list[int]) -> Proposal:
        check_budget(seqs, num_tokens)
        B = len(seqs)
        tokens: list[list[int]] = [[] for _ in range(B)]
        sources, owner, props = [""] * B, [None] * B, []   # owner[i] = (member proposal, its row)
        todo = [i for i in range(B) if num_tokens[i] > 0]
        everyone = None                          # a proposal made for all B rows, in their order
        for d in self.drafters:
            if not todo:
                break
            # each member drafts at most its own num_draft_tokens (the engine's budget is the chain's max)
            p = d.propose([seqs[i] for i in todo], [min(num_tokens[i], d.max_draft_tokens or num_tokens[i])
                                                    for i in todo])
            props.append(p)
            everyone = p if len(todo) == B else everyone     # the last member asked about every row
            rest = []
            for r, i in enumerate(todo):
                if len(p.tokens[r]) > num_tokens[i]:
                    raise ValueError(f"ChainDrafter: member {d.name!r} drafted {len(p.tokens[r])} tokens, "
                                     f"budget {num_tokens[i]}")
                if p.tokens[r]:
                    tokens[i], sources[i], owner[i] = list(p.tokens[r]), p.sources[r] or d.name, (p, r)
                else:
                    rest.append(i)
            todo = rest
        k_max = max((len(t) for t in tokens), default=0)
        q = lenient_q = None
        q_ref = next((p.q for p in props if p.q is not None), None)
        if q_ref is not None and everyone is not None and everyone.q is not None and \
                all(o is None or o[0] is everyone for o in owner):
            q = everyone.q[:, :k_max]     # it drafted every row that has drafts: its q as is, no [B, k, V] copy
        elif q_ref is not None:
            q = q_ref.new_zeros(B, k_max, q_ref.shape[-1])                 # [B, k_max, V]
            for i, o in enumerate(owner):
                if o is None:
                    continue
                (p, r), n = o, len(tokens[i])
                if p.q is not None:
                    q[i, :n] = p.q[r, :n]
                else:
                    if max(tokens[i]) >= q.shape[-1]:
                        raise ValueError(f"ChainDrafter: draft token {max(tokens[i])} >= vocab size {q.shape[-1]}")
                    q[i, torch.arange(n), torch.tensor(tokens[i])] = 1.0
        if any(p.lenient_q is not None for p in props):
            lenient_q = torch.ones(B, k_max)                                # [B, k_max]
            for i, o in enumerate(owner):
                if o is not None and o[0].lenient_q is not None:
                    n = len(tokens[i])
                    lenient_q[i, :n] = o[0].lenient_q[o[1], :n].to(lenient_q)
        confidence = None
        if any(p.confidence is not None for p in props):
            rows = [None if o is None or o[0].confidence is None else o[0].confidence[o[1]] for o in owner]
            confidence = [None if c is None else c[:len(t)] for c, t in zip(rows, tokens)]
        return Proposal(tokens=tokens, q=q, sources=sources, lenient_q=lenient_q, confidence=confidence)

    def prefill(self, seqs: list[Sequence], *args, **kwargs) -> None:
        for d in self.drafters:
            if d.needs_kv:
                d.prefill(seqs, *args, **kwargs)

    def observe_hidden(self, *args) -> None:
        for d in self.drafters:
            if d.wants_hidden:
                d.observe_hidden(*args)

    def observe(self, seq: Sequence) -> None:
        for d in self.drafters:
            d.observe(seq)

    def free(self, seq: Sequence) -> None:
        for d in self.drafters:
            d.free(seq)

    def refresh(self, model: torch.nn.Module) -> None:
        for d in self.drafters:
            d.refresh(model)

    def next_step(self) -> None:
        for d in self.drafters:
            d.next_step()


def members(drafter: Drafter | None) -> list[Drafter]:
    """The drafters behind an engine's `drafter`: a chain's members, the drafter itself, or none."""
    return [] if drafter is None else list(getattr(drafter, "drafters", [drafter]))


def find_drafter(drafter: Drafter | None, name: str) -> Drafter | None:
    """The drafter called `name`, itself or a chain member (e.g. the "prior" one, to add() bubble drafts)."""
    return next((d for d in members(drafter) if d.name == name), None)
