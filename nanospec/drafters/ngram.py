"""Prompt-lookup (n-gram) drafter: copy what followed the most recent earlier occurrence of the
current suffix in the sequence's own context.

Why: RL answers on math/code repeat spans of their own prompt and of their own earlier reasoning
(numbers, names, running sums). Matching the last n tokens (n = n_max down to n_min, longest
first) and drafting the tokens that followed needs no model and costs a few dict lookups.

Incremental: per sequence, `index[ngram] = position right after its most recent occurrence`, updated
only with the tokens appended since the last call (O(n_max * new tokens + k) per call, not O(len)).
"""
from __future__ import annotations

from nanospec.engine.sequence import Sequence
from nanospec.drafters.base import Drafter


class NgramDrafter(Drafter):
    name = "ngram"

    def __init__(self, n_max: int = 4, n_min: int = 1):
        if n_min < 1 or n_max < n_min:
            raise ValueError(f"NgramDrafter: need 1 <= n_min <= n_max, got n_min={n_min}, n_max={n_max}")
        self.n_max, self.n_min = n_max, n_min
        self._state: dict[int, tuple[int, dict[tuple, int]]] = {}   # seq_id -> (indexed up to, index)

    def _index(self, seq: Sequence) -> dict[tuple, int]:
        toks, end = seq.token_ids, len(seq.token_ids) - 1
        done, index = self._state.get(seq.seq_id, (0, None))
        if index is None or done > end:        # new sequence (or it shrank): index from scratch
            done, index = 0, {}
        # j = position right after an n-gram; only j <= len-1 so at least one token follows it
        for j in range(done + 1, end + 1):
            for n in range(self.n_min, min(self.n_max, j) + 1):
                index[tuple(toks[j - n:j])] = j     # later j overwrites: most recent occurrence wins
        self._state[seq.seq_id] = (max(done, end), index)
        return index

    def draft_one(self, seq: Sequence, k: int) -> list[int]:
        index, toks = self._index(seq), seq.token_ids
        L = len(toks)
        for n in range(min(self.n_max, L - 1), self.n_min - 1, -1):
            j = index.get(tuple(toks[L - n:]))
            if j is not None:
                draft: list[int] = []
                for i in range(k):                  # past the context end, copy our own draft:
                    p = j + i                       # a period-(L-j) pattern continues periodically
                    draft.append(toks[p] if p < L else draft[p - L])
                return draft
        return []

    def free(self, seq: Sequence) -> None:
        self._state.pop(seq.seq_id, None)
