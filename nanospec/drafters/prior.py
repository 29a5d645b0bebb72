"""Prior-rollout drafter (SPEC-RL) and the landing place for bubble drafts (BubbleSpec).

Why: consecutive epochs sample the same prompt with a slightly updated policy, so last epoch's
responses overlap heavily with this epoch's. While a running sample's completion is still an exact
prefix of a cached response, the rest of that response is a free draft; verification keeps it exact.

* Cache: per prompt_key, the newest `max_per_prompt` responses (tokens + their logprobs + source).
  `observe(seq)` adds a finished response at once (its running siblings can follow it within the
  same step); `add(..., source="bubble")` inserts drafts pre-generated elsewhere (idle ranks).
* Memory: at most `max_prompts` prompts, so max_prompts * max_per_prompt responses (default 1024 *
  16); a cached token costs ~85 bytes with its logprob (Python int + float in lists). Eviction:
  1. a prompt's oldest response, once it has more than `max_per_prompt`;
  2. with more than `max_prompts` prompts: the least recently used prompt, all its responses (used:
     a response added, or a sample of it drafted from the cache). To draft from one epoch's
     rollouts in the next, max_prompts must cover the prompts of an epoch (LRU keeps none otherwise).
  A running sample keeps following an entry it already matches even after the entry leaves the
  cache (eviction only hides it from new matches), so history is not lost mid-step.
* Choice: among entries that match the whole current completion, take the most common next token
  (the empirical mode); ties are spread over the group by sample_index, newest entry first.
* Incremental: per sequence we keep the matching entries and how far they were checked; a call
  compares only the new tokens (and only entries added since, in full).
* LOSSY option `lenience` l > 1 (SPEC-RL's lenient acceptance): `Proposal.lenient_q` = p_old / l per
  draft token, so the verifier accepts with min(1, l * p_new / p_old). Not exact; warned about.
"""
from __future__ import annotations

import math
import warnings
from collections import Counter, deque

import torch

from nanospec.engine.sequence import Sequence
from nanospec.drafters.base import Drafter, Proposal, check_budget


class _Entry:
    __slots__ = ("tokens", "logprobs", "source", "id")

    def __init__(self, tokens, logprobs, source, id_):
        self.tokens, self.logprobs, self.source, self.id = tokens, logprobs, source, id_


class PriorRolloutDrafter(Drafter):
    name = "prior"
    sources = ("prior", "bubble")      # bubble drafts (rl/rollout.py) keep their own name and stats
    confident = True                   # from the cached response's logprobs, where it has them

    def __init__(self, max_per_prompt: int = 16, lenience: float = 1.0, max_prompts: int = 1024):
        if max_per_prompt < 1:
            raise ValueError(f"PriorRolloutDrafter: max_per_prompt must be >= 1, got {max_per_prompt}")
        if max_prompts < 1:
            raise ValueError(f"PriorRolloutDrafter: max_prompts must be >= 1, got {max_prompts}")
        if not lenience >= 1.0:
            raise ValueError(f"PriorRolloutDrafter: lenience must be >= 1 (1 = exact), got {lenience}")
        self.max_per_prompt, self.lenience, self.max_prompts = max_per_prompt, float(lenience), max_prompts
        self.lossy = self.lenience > 1.0
        if self.lossy:
            warnings.warn(f"PriorRolloutDrafter(lenience={lenience}) is LOSSY: drafts are accepted with "
                          f"min(1, {lenience} * p_new / p_old), so rollouts no longer follow the policy exactly",
                          stacklevel=2)
        self._cache: dict = {}            # prompt_key -> deque[_Entry] (oldest first), least recently used first
        self._next_id = 0
        self._state: dict[int, tuple[int, int, list[_Entry]]] = {}   # seq_id -> (checked, next id, matches)

    def add(self, prompt_key, token_ids: list[int], logprobs: list[float] | None = None,
            source: str = "prior") -> None:
        """Cache a response for prompt_key. logprobs (the policy's, per token) are needed only by the
        lenient rule; without them those positions are verified exactly."""
        token_ids = [int(t) for t in token_ids]
        if logprobs is not None and len(logprobs) != len(token_ids):
            raise ValueError(f"add: logprobs must have one entry per token ({len(token_ids)}), got {len(logprobs)}")
        if not source:
            raise ValueError("add: source must be a non-empty name (e.g. 'prior' or 'bubble')")
        if not token_ids:
            return
        entries = self._cache[prompt_key] = self._cache.pop(prompt_key, None) or deque()   # moved last: LRU order
        entries.append(_Entry(token_ids, None if logprobs is None else list(logprobs), source, self._next_id))
        self._next_id += 1
        while len(entries) > self.max_per_prompt:
            entries.popleft()
        while len(self._cache) > self.max_prompts:
            del self._cache[next(iter(self._cache))]     # the least recently used prompt

    def observe(self, seq: Sequence) -> None:
        if not seq.bubble:      # bubble responses are shared with every rank as source "bubble" instead
            self.add(seq.prompt_key, seq.completion_token_ids, seq.logprobs, "prior")

    def _matches(self, seq: Sequence) -> list[_Entry]:
        """Cached entries whose tokens start with the whole current completion."""
        P, n = seq.num_prompt_tokens, len(seq.token_ids) - seq.num_prompt_tokens
        checked, seen, found = self._state.get(seq.seq_id, (0, 0, []))
        if checked > n:
            checked, seen, found = 0, 0, []
        if n > checked:
            new = seq.token_ids[P + checked:]
            found = [e for e in found if e.tokens[checked:n] == new]
        entries = self._cache.pop(seq.prompt_key, None)
        if entries:
            self._cache[seq.prompt_key] = entries       # re-inserted last: the most recently used
        if entries and entries[-1].id >= seen:
            completion = seq.token_ids[P:]
            found += [e for e in entries if e.id >= seen and e.tokens[:n] == completion]
        self._state[seq.seq_id] = (n, self._next_id, found)
        return found

    def _pick(self, seq: Sequence, n: int) -> _Entry | None:
        live = [e for e in reversed(self._matches(seq)) if len(e.tokens) > n]   # newest first
        if not live:
            return None
        votes = Counter(e.tokens[n] for e in live)
        best = max(votes.values())
        top = [e for e in live if votes[e.tokens[n]] == best]
        return top[seq.sample_index % len(top)]

    def propose(self, seqs: list[Sequence], num_tokens: list[int]) -> Proposal:
        check_budget(seqs, num_tokens)
        tokens, sources, confidence, lenient = [], [], [], []
        for seq, k in zip(seqs, num_tokens):
            n = seq.num_completion_tokens
            e = self._pick(seq, n) if k > 0 else None
            tokens.append(e.tokens[n:n + k] if e else [])
            sources.append(e.source if e else "")
            # p_old(x) estimates p_new(x), a point-mass draft's acceptance probability when sampling
            p_old = [math.exp(lp) for lp in e.logprobs[n:n + k]] if e and e.logprobs is not None else None
            confidence.append(p_old)
            lenient.append([p / self.lenience for p in p_old] if p_old else [])
        lenient_q = None
        if self.lossy:
            lenient_q = torch.ones(len(seqs), max((len(t) for t in tokens), default=0))   # [B, k_max]
            for i, row in enumerate(lenient):
                lenient_q[i, :len(row)] = torch.tensor(row)
        return Proposal(tokens=tokens, sources=sources, lenient_q=lenient_q, confidence=confidence)

    def free(self, seq: Sequence) -> None:
        self._state.pop(seq.seq_id, None)
