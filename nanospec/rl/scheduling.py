"""Length-aware scheduling across data-parallel ranks (DAS): predict each prompt's response length
from its earlier rollouts, then give every rank the same predicted work.
"""
from __future__ import annotations

import math
from typing import Hashable, Sequence

from nanospec.config import check, is_int


class LengthPredictor:
    """Response-length prediction per prompt (DAS) from that prompt's earlier rollouts.

    Per prompt: an EMA (weight `decay` on the newest) of a group statistic, by default the max over
    the G samples (a GRPO group is done when its slowest sample is). Unseen prompts: a least-squares
    line in the prompt's length, fitted on every group observed so far (on the embedded task a k-step
    answer has 4k+2 tokens and a 2k+1-word prompt, and long questions tend to have long answers in
    general), so balancing works from the first step instead of giving every new prompt one mean;
    the running mean when all prompts seen had one length; `prior` before any observation.
    """

    def __init__(self, prior: float = 64.0, decay: float = 0.5, reduce: str = "max"):
        check(prior >= 0, "prior", "a length >= 0", prior)
        check(0 < decay <= 1, "decay", "in (0, 1]", decay)
        check(reduce in ("max", "mean"), "reduce", "'max' or 'mean'", reduce)
        self.prior, self.decay, self.reduce = float(prior), decay, reduce
        self.ema: dict[Hashable, float] = {}
        self.sums = [0.0] * 5       # n, sum x, sum y, sum x^2, sum xy; x = prompt length, y = statistic

    def observe(self, prompt_key: Hashable, lengths: Sequence[int], prompt_len: int = 0) -> None:
        check(len(lengths) > 0 and all(x >= 0 for x in lengths), "lengths",
               "a non-empty list of lengths >= 0", lengths)
        check(prompt_len >= 0, "prompt_len", "a length >= 0", prompt_len)
        y = float(max(lengths) if self.reduce == "max" else sum(lengths) / len(lengths))
        old = self.ema.get(prompt_key)
        self.ema[prompt_key] = y if old is None else (1 - self.decay) * old + self.decay * y
        for i, v in enumerate((1.0, prompt_len, y, prompt_len * prompt_len, prompt_len * y)):
            self.sums[i] += v

    def predict(self, prompt_key: Hashable, prompt_len: int = 0) -> float:
        if prompt_key in self.ema:
            return self.ema[prompt_key]
        n, sx, sy, sxx, sxy = self.sums
        if n == 0:
            return self.prior
        var = n * sxx - sx * sx
        if var <= 1e-9 * max(n * sxx, 1.0):       # one prompt length seen: no slope to fit
            return sy / n
        slope = (n * sxy - sx * sy) / var
        return max(0.0, (sy - slope * sx) / n + slope * prompt_len)

    def state_dict(self) -> dict:
        return {"prior": self.prior, "decay": self.decay, "reduce": self.reduce,
                "sums": list(self.sums), "ema": dict(self.ema)}

    def load_state_dict(self, state: dict) -> None:
        missing = {"prior", "decay", "reduce", "sums", "ema"} - set(state)
        check(not missing, "state", f"a LengthPredictor state_dict (missing {sorted(missing)})", sorted(state))
        self.__init__(state["prior"], state["decay"], state["reduce"])
        self.sums, self.ema = [float(v) for v in state["sums"]], dict(state["ema"])


def assign_to_ranks(predicted_work: Sequence[float], world_size: int) -> list[list[int]]:
    """Longest-processing-time-first with a cardinality constraint (DAS inter-GPU balancing).

    Synchronous data parallel needs the same number of prompts per rank, so each rank holds exactly
    n / world_size; prompts in decreasing predicted work (ties: lower index first) go to the least
    loaded rank that is not full (ties: lower rank). Longest-first also spreads the longest prompts
    one per rank, the interleaving that bounds each rank's tail. Each rank's list comes out in
    decreasing predicted work, so it can start its stragglers first.
    """
    n = len(predicted_work)
    check(is_int(world_size) and world_size >= 1, "world_size", "an int >= 1", world_size)
    check(n % world_size == 0, "predicted_work", f"a length divisible by world_size={world_size}", n)
    check(all(math.isfinite(w) and w >= 0 for w in predicted_work), "predicted_work",
           "finite values >= 0", predicted_work)
    cap, ranks, load = n // world_size, [[] for _ in range(world_size)], [0.0] * world_size
    for i in sorted(range(n), key=lambda i: (-predicted_work[i], i)):
        r = min((r for r in range(world_size) if len(ranks[r]) < cap), key=lambda r: (load[r], r))
        ranks[r].append(i)
        load[r] += predicted_work[i]
    return ranks


def rank_work(predicted_work: Sequence[float], assignment: list[list[int]]) -> list[float]:
    return [float(sum(predicted_work[i] for i in idx)) for idx in assignment]


def imbalance(work_per_rank: Sequence[float]) -> float:
    """max / mean work per rank: 1.0 is perfect balance; synchronous DP waits for the max."""
    check(len(work_per_rank) > 0, "work_per_rank", "a non-empty list", work_per_rank)
    mean = sum(work_per_rank) / len(work_per_rank)
    return max(work_per_rank) / mean if mean > 0 else 1.0
