"""When and how much to speculate: the engine's draft controller and the pieces it is made of.

Everything here only chooses *how much* to speculate (on/off, k per row); none of it touches what is
sampled, so every choice is exact by construction (verify.py). Sources: EfficientRollout:
system-aware toggle, acceptance-aware draft length; DAS (distribution-aware speculative decoding):
per-length speculation budgets; Leviathan et al. 2023, eq. 1: expected tokens per verify step under
i.i.d. acceptance.
"""
from __future__ import annotations

import bisect
import itertools
import math
import operator
from collections import defaultdict
from dataclasses import replace
from typing import Callable, Sequence

import numpy as np

from nanospec.config import check, is_int
from nanospec.engine.latency import LatencyModel, profiled_latency, replayed_profile


def _rates(alpha: float | Sequence[float], k: int) -> list[float]:
    """Conditional acceptance at draft positions 0..k-1: a float is the same at every position; a
    sequence gives P(draft j accepted | drafts before it were) per position, its last entry repeated."""
    rates = [alpha] * k if isinstance(alpha, (int, float)) else list(alpha[:k]) + [alpha[-1]] * (k - len(alpha))
    check(all(0.0 <= a <= 1.0 for a in rates), "alpha", "probabilities in [0, 1]", alpha)
    return rates


def expected_accepted(alpha: float | Sequence[float], k: int) -> float:
    """E[accepted drafts] of k, each accepted w.p. alpha until the first rejection:
    (1 - alpha^(k+1)) / (1 - alpha) - 1 (Leviathan et al. eq. 1 minus the bonus token)
    = alpha + ... + alpha^k, summed directly so alpha = 1 gives k without cancellation. With a rate per
    position (`_rates`): a_0 + a_0 a_1 + ... + a_0 ... a_(k-1)."""
    check(is_int(k) and k >= 0, "k", "an int >= 0", k)
    return float(sum(itertools.accumulate(_rates(alpha, k), operator.mul)))


def _speedup(latency, batch_size, ctx_len, k, expected_accepted_tokens, draft_time, t_ar) -> float:
    """(E[accepted] + 1 bonus) tokens per verify step, over the tokens one plain decode gives in the
    same time: (E + 1) * t(B, C, 1) / (draft_time + t(B, C, k + 1)); t_ar = t(B, C, 1) is passed in
    because best_k evaluates this for every k of a step."""
    return (expected_accepted_tokens + 1) * t_ar / (draft_time + latency.predict(batch_size, ctx_len, k + 1))


def best_k(latency: LatencyModel, batch_size: float, ctx_len: float, alpha: float | Sequence[float],
           max_k: int = 8, draft_time: float = 0.0, draft_time_per_token: float = 0.0) -> tuple[int, float]:
    """The k in 1..max_k with the highest predicted speedup, drafting k tokens costing
    draft_time + k * draft_time_per_token seconds: a history drafter's propose() costs about the same
    for any k, a model drafter runs one forward of its own per draft token. `alpha`: one acceptance
    rate, or one per draft position (`_rates`). Ties go to the shorter draft."""
    check(is_int(max_k) and max_k >= 1, "max_k", "an int >= 1", max_k)
    t_ar, best, accepted, alpha_k = latency.predict(batch_size, ctx_len, 1), (1, -1.0), 0.0, 1.0
    for k, a in enumerate(_rates(alpha, max_k), 1):     # expected_accepted(alpha, k), summed as k grows
        alpha_k *= a
        accepted += alpha_k
        s = _speedup(latency, batch_size, ctx_len, k, accepted, draft_time + k * draft_time_per_token, t_ar)
        if s > best[1]:
            best = (k, s)
    return best


def trim_drafts(probs: list[list[float]], base_tokens: float, base_seconds: float, token_cost: float,
                verify_overhead: float = 0.0) -> list[int]:
    """Per row, how many of its drafts to verify so that the step's expected tokens per second is highest.

    probs[i][j]: estimated probability that row i's drafts 0..j are all accepted (non-increasing in j),
    i.e. the expected tokens draft j adds. The step already yields `base_tokens` (one per row, plus
    drafts kept elsewhere) in `base_seconds`; each verified draft costs `token_cost` more (packed
    steps: time is linear in the verified tokens), and verifying any at all costs `verify_overhead`
    once. Maximising E / T over prefixes: take drafts in decreasing probability while
    p > token_cost * E / T (a ratio's optimum keeps exactly the items whose gain / cost beats the
    ratio itself; Dinkelbach), starting from T + verify_overhead; then keep them only if that beats
    verifying nothing. At a full CPU batch a draft must be likely (p ~ 0.5: a verified token costs
    nearly a decoded one); for a lone straggler almost any draft pays.
    """
    E, T, keep = base_tokens, base_seconds + verify_overhead, [0] * len(probs)
    for p, i in sorted(((p, i) for i, row in enumerate(probs) for p in row), key=lambda x: -x[0]):
        if p * T < token_cost * E:
            break
        E, T, keep[i] = E + p, T + token_cost, keep[i] + 1
    return keep if E * base_seconds > base_tokens * T else [0] * len(probs)


class ConfidenceCalibration:
    """Per source, (draft position, confidence) -> the acceptance measured there (histogram binning).

    Why: a suffix tree's frequencies come from ~16 samples and its most frequent child is the one
    drafted, so they overstate, most at the first drafts: on the embedded task (SFT model, T=1)
    confidence >= 0.9 was accepted 87% of the time at draft positions 0-1 but 96-99.8% at 2-5 (a
    sample that followed the history for two tokens is on its track), and 0.5-0.6 only 24%. Each
    (position, bin) cell keeps counts of (tested, accepted) draft tokens, halved once `max_count` are
    held so they follow the current weights; estimate = (accepted + m * c) / (tested + m): the raw
    confidence c until its cell has data. Tested = up to and including the first rejection.
    """

    def __init__(self, bins: int = 10, positions: int = 8, prior_weight: float = 8.0, max_count: int = 16384):
        check(is_int(bins) and bins >= 1, "bins", "an int >= 1", bins)
        check(is_int(positions) and positions >= 1, "positions", "an int >= 1", positions)
        check(prior_weight > 0, "prior_weight", "> 0", prior_weight)
        self.bins, self.positions, self.m, self.max_count = bins, positions, prior_weight, max_count
        # source -> (flat [positions * bins] lists of tested and accepted counts, total tested); plain
        # Python lists: this runs per draft token, where numpy's per-call overhead would dominate
        self._counts: dict[str, tuple[list[float], list[float], list[float]]] = {}

    def _cell(self, j: int, c: float) -> int:
        return min(j, self.positions - 1) * self.bins + min(int(c * self.bins), self.bins - 1)

    def __call__(self, source: str, j: int, c: float) -> float:
        """Calibrated P(draft j accepted | drafts before it were), from its raw confidence c."""
        counts = self._counts.get(source)
        if counts is None:
            return c
        cell = self._cell(j, c)
        return (counts[1][cell] + self.m * c) / (counts[0][cell] + self.m)

    def observe(self, source: str, confidence: Sequence[float], accepted: int) -> None:
        size = self.positions * self.bins
        tested, acc, total = self._counts.setdefault(source, ([0.0] * size, [0.0] * size, [0.0]))
        for j, c in enumerate(confidence[:accepted + 1]):
            cell = self._cell(j, c)
            tested[cell] += 1.0
            acc[cell] += j < accepted
            total[0] += 1.0
        if total[0] > self.max_count:
            for counts in (tested, acc, total):
                counts[:] = [x / 2 for x in counts]


class PositionalAcceptance:
    """Per source, P(draft j accepted | drafts 0..j-1 were) at each draft position j.

    Why not one rate: acceptance is not i.i.d. A draft that survived its first tokens is on a span the
    drafter knows, so later positions are accepted more often (the mostly-agreeing draft model of
    `bench.py --suite assisted`: docs/results.md). One pooled rate underprices the later drafts: there
    it tied k=3 with k=2 and picked the shorter one, which measured slower.
    Estimate: r_j = (accepted_j + m * r_(j-1)) / (tested_j + m), shrunk toward the position before
    (toward `prior` at position 0), so a position not drafted yet is priced like the last one measured
    and gets tried when that pays. A verify row tests its positions up to and including the first
    rejection. A source's counts halve once it has `max_count` tested drafts, so the rates follow the
    current weights.
    """

    def __init__(self, prior: float = 0.8, positions: int = 16, prior_weight: float = 4.0, max_count: int = 256):
        check(0.0 <= prior <= 1.0, "prior", "a probability in [0, 1]", prior)
        self.prior, self.positions, self.m, self.max_count = prior, positions, prior_weight, max_count
        self.counts: dict[str, tuple[list[float], list[float]]] = {}   # source -> (tested, accepted) per position
        self.version = 0            # bumped by every observation (the controller caches verdicts on it)

    def observe(self, source: str, proposed: int, accepted: int) -> None:
        self.version += 1
        tested, acc = self.counts.setdefault(source, ([0.0] * self.positions, [0.0] * self.positions))
        for j in range(min(accepted + 1, proposed, self.positions)):
            tested[j] += 1.0
            acc[j] += j < accepted
        if sum(tested) > self.max_count:
            tested[:], acc[:] = [x / 2 for x in tested], [x / 2 for x in acc]

    def rates(self, source: str, optimism: float = 0.0) -> list[float]:
        """Conditional acceptance per position (`best_k`, `expected_accepted`); [prior] if unseen. With
        `optimism` z, each rate is raised by z standard errors, sqrt(r (1 - r) / (tested + m)): an upper
        confidence bound, wide where a position has little data."""
        if source not in self.counts:
            return [self.prior]
        out, r = [], self.prior
        for t, a in zip(*self.counts[source]):
            r = (a + self.m * r) / (t + self.m)
            out.append(min(1.0, r + optimism * math.sqrt(r * (1.0 - r) / (t + self.m))))
        return out

    def pooled(self, source: str) -> float | None:
        """accepted / (accepted + rejections) over all positions: the geometric MLE; None if no data."""
        tested, acc = self.counts.get(source, ((), ()))
        return sum(acc) / sum(tested) if sum(tested) else None


class SpeculationToggle:
    """System-aware on/off (EfficientRollout): speculate this step iff predicted speedup >= min_speedup.
    The engine passes the *measured* draft time, so a drafter that is slow on this machine (the nf4
    self-drafter on CPU: bitsandbytes dequantizes per call) is switched off by the numbers, not by a rule."""

    def __init__(self, latency: LatencyModel, min_speedup: float = 1.05):
        check(min_speedup > 0, "min_speedup", "> 0", min_speedup)
        self.latency, self.min_speedup = latency, min_speedup
        self.reset_stats()

    def choose(self, batch_size: float, ctx_len: float, max_k: int, alpha: float | Sequence[float],
               draft_time: float, draft_time_per_token: float = 0.0,
               optimistic: Callable[[], Sequence[float]] | None = None) -> tuple[int, float]:
        """The draft length to use this step: the k <= max_k (the ladder's rung) with the highest
        predicted speedup, or 0 when even that one is below min_speedup. At large batch a CPU verify is
        compute-bound (every draft token costs about a decoded token), so there the best k is short.
        `optimistic()`: upper-bound rates, asked for when `alpha` says off. An off drafter is measured only by
        rare probes, so turning it off on a few unlucky rejections would leave a good drafter off for
        hundreds of steps; drafting while the upper bound pays (optimism under uncertainty) gathers the
        evidence at full rate, and a bad drafter's bound falls below the threshold within a few drafts."""
        k, s = best_k(self.latency, batch_size, ctx_len, alpha, max_k=max_k, draft_time=draft_time,
                      draft_time_per_token=draft_time_per_token)
        if s < self.min_speedup and optimistic is not None:
            k, s = best_k(self.latency, batch_size, ctx_len, optimistic(), max_k=max_k, draft_time=draft_time,
                          draft_time_per_token=draft_time_per_token)
        return (k if self._count(s >= self.min_speedup, s) else 0), s

    def _count(self, on: bool, s: float) -> bool:
        self._steps, self._on, self._sum = self._steps + 1, self._on + on, self._sum + s
        return on

    def reset_stats(self) -> None:
        self._steps, self._on, self._sum = 0, 0, 0.0

    def stats(self) -> dict:
        n = max(self._steps, 1)
        return {"toggle_steps": self._steps, "toggle_on_steps": self._on,
                "toggle_on_fraction": self._on / n, "toggle_mean_predicted_speedup": self._sum / n}


class SpeedupGuard:
    """The measured check behind every prediction above (a circuit breaker on realized speedup).

    For a step that speculated, plain decoding would have needed (tokens emitted / B) steps of t(B, C, 1)
    for the same tokens; its realized speedup is that over the seconds the step really took (drafting +
    verify). t comes from the latency model, scaled by the measured / predicted ratio of recent plain
    steps, so a model that is off at this batch and context is corrected by the steps themselves. Any
    cost the predictions leave out (a drafter's Python, an over-confident acceptance estimate, verify
    overheads) shows up here. When the realized speedup, summed over the last speculating steps, falls
    below `min_speedup` after `min_steps` of them (a margin: each side of the ratio is an estimate;
    `decay` 0.95 sums ~20 steps: over ~10, a stretch of rejections trips a drafter that wins overall),
    speculation is suspended for `gap` engine steps of plain decoding
    and then tried again on fresh evidence; the gap doubles (up to `max_gap`) while trials keep failing.
    Steps that only probe an off drafter are left out: they are the probe's cost, accounted for there.
    """

    def __init__(self, min_steps: int = 8, gap: int = 16, max_gap: int = 512, decay: float = 0.95,
                 min_speedup: float = 1.05):
        check(is_int(min_steps) and min_steps >= 1, "min_steps", "an int >= 1", min_steps)
        check(is_int(gap) and 1 <= gap <= max_gap, "gap", f"an int in [1, max_gap={max_gap}]", gap)
        check(0 < decay <= 1, "decay", "in (0, 1]", decay)
        check(min_speedup > 0, "min_speedup", "> 0", min_speedup)
        self.min_steps, self.base_gap, self.max_gap, self.decay = min_steps, gap, max_gap, decay
        self.min_speedup = min_speedup
        self.gap, self.suspended, self.ar_bias = gap, 0, 1.0
        self.trips = self.suspended_steps = 0
        self._restart()

    def _restart(self) -> None:
        self.ar_seconds = self.spent = 0.0    # decayed sums over this trial's speculating steps
        self.n = 0

    def allows(self) -> bool:
        """Once per engine step: may this step speculate?"""
        if self.suspended:
            self.suspended -= 1
            self.suspended_steps += 1
            return False
        return True

    def observe(self, speculated: bool, seconds: float, predicted_ar: float, tokens_per_row: float) -> None:
        """One step: `seconds` it took (drafting included), `predicted_ar` = t(B, C, 1) of the latency
        model, `tokens_per_row` = tokens emitted / B (1 for a plain step)."""
        if not speculated:
            self.ar_bias = 0.8 * self.ar_bias + 0.2 * seconds / predicted_ar
            return
        self.ar_seconds = self.decay * self.ar_seconds + tokens_per_row * predicted_ar * self.ar_bias
        self.spent = self.decay * self.spent + seconds
        self.n += 1
        if self.n < self.min_steps:
            return
        if self.ar_seconds < self.min_speedup * self.spent:    # no faster than plain: suspend, retry later
            self.suspended, self.trips = self.gap, self.trips + 1
            self.gap = min(2 * self.gap, self.max_gap)
            self._restart()
        elif self.n == self.min_steps:            # a trial passed: the next failure waits the base gap
            self.gap = self.base_gap

    def reset(self) -> None:
        """A new rollout step: its counters start at 0 and its trial starts afresh, but the backoff
        (gap, remaining suspension) carries over, so speculation that lost on the last rollout step
        costs one trial per doubling gap, not three trials on every step."""
        self.trips = self.suspended_steps = 0
        self._restart()

    def realized_speedup(self) -> float | None:
        return self.ar_seconds / self.spent if self.spent else None


class DraftLengthLadder:
    """Acceptance-aware draft length (EfficientRollout), one rung per drafter name.

    Rate: per-token acceptance alpha_hat = accepted / (accepted + rejections), a rejection being a
    verify step that stopped before the end of its draft: the maximum-likelihood alpha of the model
    behind `expected_accepted`. Unlike accepted/proposed it does not fall just because k grew (at
    alpha = 0.9 accepted/proposed is 0.74 at k=5 but 0.56 at k=11), so a step up does not by itself
    push the next window down and the ladder does not oscillate.
    Window: `window` proposed draft tokens: the same evidence per decision at any rung or batch size.
    Moves: one rung up after two consecutive windows with rate >= up, one down after two <= down; a
    window in between, or a move, resets the streak. Start: rung `start` (default 0, the shortest):
    a fresh drafter (new weights, empty suffix tree) is usually poor, long wrong drafts waste verify
    compute on every sequence, and two good windows suffice to climb.
    """

    def __init__(self, ladder: Sequence[int] = (3, 5, 7, 9, 11), up: float = 0.94, down: float = 0.85,
                 window: int = 128, start: int = 0):
        ladder = tuple(ladder)
        check(len(ladder) > 0 and all(is_int(k) and k >= 1 for k in ladder)
               and all(a < b for a, b in zip(ladder, ladder[1:])),
               "ladder", "a non-empty strictly increasing sequence of ints >= 1", ladder)
        check(0 < down < up <= 1, "up/down", "0 < down < up <= 1", (up, down))
        check(is_int(window) and window >= 1, "window", "an int >= 1 (proposed tokens)", window)
        check(is_int(start) and 0 <= start < len(ladder), "start", f"a rung index in [0, {len(ladder)})", start)
        self.ladder, self.up, self.down, self.window, self.start = ladder, up, down, window, start
        self._s: dict[str, dict] = {}

    def _state(self, name: str) -> dict:
        return self._s.setdefault(name, dict(rung=self.start, proposed=0, accepted=0, rejected=0,
                                             high=0, low=0, rate=None))

    def update(self, name: str, proposed: int, accepted: int, rejected: int | None = None) -> int:
        """One verify step of one sequence (`rejected` defaults to accepted < proposed), or counts
        summed over several steps with `rejected` = how many of them stopped early. Returns current k."""
        check(is_int(proposed) and proposed >= 0, "proposed", "an int >= 0", proposed)
        check(is_int(accepted) and 0 <= accepted <= proposed, "accepted", f"an int in [0, {proposed}]", accepted)
        need = int(accepted < proposed)
        rejected = need if rejected is None else rejected
        check(is_int(rejected) and rejected >= need, "rejected", f"an int >= {need}", rejected)
        s = self._state(name)
        s["proposed"] += proposed; s["accepted"] += accepted; s["rejected"] += rejected
        if s["proposed"] >= self.window:
            rate = s["accepted"] / (s["accepted"] + s["rejected"])   # > 0: proposed > 0
            s.update(proposed=0, accepted=0, rejected=0, rate=rate)
            s["high"] = s["high"] + 1 if rate >= self.up else 0
            s["low"] = s["low"] + 1 if rate <= self.down else 0
            if s["high"] >= 2 and s["rung"] < len(self.ladder) - 1:
                s.update(rung=s["rung"] + 1, high=0, low=0)
            elif s["low"] >= 2 and s["rung"] > 0:
                s.update(rung=s["rung"] - 1, high=0, low=0)
        return self.ladder[s["rung"]]

    def current(self, name: str) -> int:
        return self.ladder[self._s[name]["rung"] if name in self._s else self.start]

    @property
    def names(self) -> list[str]:
        """Drafters seen so far (one rung each)."""
        return list(self._s)

    def acceptance_rate(self, name: str) -> float | None:
        """Rate of the last complete window; the open window's before the first; None if no data."""
        s = self._s.get(name)
        if s is None:
            return None
        if s["rate"] is not None:
            return s["rate"]
        n = s["accepted"] + s["rejected"]
        return s["accepted"] / n if n else None


class LengthClasses:
    """Length -> class -> speculation budget (draft-length cap; the toggle still decides per step).

    Class i covers lengths in [thresholds[i-1], thresholds[i]) (class 0 from 0, the last unbounded).
    Why budgets grow with length: short answers finish while the batch is full, where a CPU verify of
    many positions costs several decodes (compute-bound) and a wrong draft slows every sequence's
    step, yet they never set the rollout's wall time; long answers run as the batch shrinks, and the
    last stragglers at batch ~1, where a verify costs little more than a decode and long drafts pay.
    `for_engine` derives the budgets from a fitted LatencyModel (the default:
    `speculation.length_class_budgets: null`); the embedded task's classes are [18, 72] (~median, ~p90).
    With the toggle on, drafters that rate their drafts (prior, suffix) are trimmed per token instead
    (DraftController.budgets): the budgets then cap only the others (ngram, self_nf4, draft model).
    """

    def __init__(self, thresholds: Sequence[float], budgets: Sequence[int]):
        thresholds, budgets = tuple(thresholds), tuple(budgets)
        check(all(t > 0 for t in thresholds) and all(a < b for a, b in zip(thresholds, thresholds[1:])),
               "thresholds", "strictly increasing lengths > 0", thresholds)
        check(len(budgets) == len(thresholds) + 1, "budgets",
               f"len(thresholds) + 1 = {len(thresholds) + 1} entries", budgets)
        check(all(is_int(b) and b >= 0 for b in budgets), "budgets", "ints >= 0", budgets)
        self.thresholds, self.budgets = thresholds, budgets

    def class_of(self, length: float) -> int:
        check(length >= 0, "length", ">= 0", length)
        return bisect.bisect_right(self.thresholds, length)

    def budget(self, length: float) -> int:
        return self.budgets[self.class_of(length)]

    @classmethod
    def from_cost_model(cls, latency: LatencyModel, thresholds: Sequence[float],
                        batch_sizes: Sequence[float], ctx_lens: Sequence[float], alpha: float,
                        max_k: int = 8, min_speedup: float = 1.05) -> "LengthClasses":
        """Per class, the k maximising predicted speedup at that class's typical batch size and
        context (one entry per class), or 0 where even the best k is below min_speedup."""
        n = len(tuple(thresholds)) + 1
        check(len(batch_sizes) == n and len(ctx_lens) == n, "batch_sizes/ctx_lens",
               f"{n} entries each (one per class)", (batch_sizes, ctx_lens))
        budgets = []
        for B, C in zip(batch_sizes, ctx_lens):
            k, s = best_k(latency, B, C, alpha, max_k)
            budgets.append(k if s >= min_speedup else 0)
        return cls(thresholds, budgets)

    @classmethod
    def for_engine(cls, latency: LatencyModel, thresholds: Sequence[float], max_num_seqs: int,
                   alpha: float = 0.8, max_k: int = 8, min_speedup: float = 1.05) -> "LengthClasses":
        """`from_cost_model` at each class's typical step: short answers finish while the batch is
        full, and each longer class runs in a batch several times smaller (the long tail runs nearly alone),
        at a context of about the class's length."""
        t = [float(x) for x in thresholds]
        ctx = [t[0] / 2] + [(a + b) / 2 for a, b in zip(t, t[1:])] + [1.25 * t[-1]]
        batch = [max(1, max_num_seqs // 4 ** c) for c in range(len(t) + 1)]
        return cls.from_cost_model(latency, t, batch, ctx, alpha, max_k=max_k, min_speedup=min_speedup)


class DraftController:
    """The engine's one hook into the controls above (`LLM(..., controller=DraftController(...))`).

    Per decode step: `budgets` gives each sequence its draft-length cap = min(ladder rung, length-class
    budget of max(predicted, current) response length; with a toggle, the class budget only where
    some drafter does not rate its drafts, see below). After the drafter proposes, `clip` cuts each
    row to the rung of the drafter that actually proposed it and, with a toggle, to 0 where *that
    drafter* would not pay this step: the toggle decides per source, so a weak suffix tree is switched
    off without also switching off good prior-rollout or bubble drafts (one pooled rate would do
    both or neither). When no drafter pays, nothing is drafted at all (no draft time either).
    Probes: an off drafter still drafts for `probe_rows` rows on a probe step, so its acceptance keeps
    being measured; the gap between probes doubles while it stays off (`probe_every` up to
    `probe_every_max` steps). With ragged steps packing their real tokens (models/decoder.py) a probe costs
    only ~probe_rows * k extra tokens. A drafter with its own KV is probed only on rows it is current
    on (`_probe_rows`).
    Drafts with confidence: a drafter that estimates each draft token's acceptance (the suffix tree's
    path frequencies, the prior rollout's stored probabilities: `Proposal.confidence`) is not toggled
    per source; with a toggle, `clip` keeps per row the drafts whose expected tokens pay for their
    verify cost this step (`trim_drafts`), so one batch verifies 8 likely tokens on one row and none
    on another. Such a source needs no probes: its rates are calibrated against measured acceptance,
    and a source trimmed away at full batch still drafts in the small tail batches, where drafts are
    cheap, so its calibration keeps learning.
    Draft cost: a history drafter's propose() is timed per row (an EMA); a drafter with its own model
    (self_nf4, draft model) runs one forward of it per draft token, priced by `draft_latency`, that
    model's own LatencyModel (profiled at start-up like the target's, then fed every propose() time).
    The engine reports back draft time, forward time and acceptance, which keep the latency models,
    the toggle and the ladder current. With `replay` (a fixed latency profile) the clock is never read:
    every step costs what the latency models say, and they stop learning, so the same tokens always
    lead to the same choices.
    """

    def __init__(self, *, ladder: DraftLengthLadder | None = None, classes: LengthClasses | None = None,
                 toggle: SpeculationToggle | None = None, default_alpha: float = 0.8, probe_every: int = 16,
                 probe_every_max: int = 256, probe_rows: int = 4, sources: Sequence[str] = (),
                 confident_sources: Sequence[str] = (), kv_sources: Sequence[str] = (),
                 draft_latency: LatencyModel | None = None, replay: bool = False, draft_time: float | None = None):
        check(is_int(probe_every) and 1 <= probe_every <= probe_every_max, "probe_every",
               f"an int in [1, probe_every_max={probe_every_max}]", probe_every)
        check(is_int(probe_rows) and probe_rows >= 1, "probe_rows", "an int >= 1", probe_rows)
        self.ladder, self.classes, self.toggle = ladder, classes, toggle
        self.default_alpha, self.probe_every, self.probe_every_max = default_alpha, probe_every, probe_every_max
        self.probe_rows = probe_rows
        self.sources = list(sources)   # the drafter's source names (Drafter.sources); more are learned
        self.confident = set(confident_sources)   # sources whose proposals carry per-token confidence
        self.kv_sources = set(kv_sources)          # sources that keep their own KV (catch up before drafting)
        self.calibration = ConfidenceCalibration()
        self.acceptance = PositionalAcceptance(default_alpha)   # per source and draft position
        self.draft_latency = draft_latency   # seconds of one forward of the drafter's own model, if any
        self.draft_time = draft_time    # EMA seconds of a history drafter's propose() per sequence
        self.replay = replay
        self._gap: dict[str, list[int]] = {}        # per source: [steps since last probe, probe gap]
        self._pays: dict[str, int | None] = {}      # this step, per source: draft length (0 = off), None = probe
        self._probing: dict[str, tuple[int, int]] = {}   # sources probed this step: (steps waited, gap)
        self._verdicts: dict[str, tuple] = {}       # per source: (what the verdict depends on, k, speedup)
        self._catch_up_seconds = 0.0                 # this step's predicted catch-up forwards of a probe
        self._steps = self._on_steps = 0
        # the guard's margin: measured speedups are noisy, so never below 1.05 (auto runs the toggle at 1.0)
        self.guard = SpeedupGuard(min_speedup=max(1.05, toggle.min_speedup)) if toggle is not None else None
        self._step_draft_seconds = 0.0               # this step's propose() time, for the guard

    def alpha(self, source: str) -> float:
        """Per-token acceptance of `source`, pooled over draft positions; the default before the first
        measurement. The toggle prices drafts with the per-position rates (`PositionalAcceptance`)."""
        rate = self.acceptance.pooled(source)
        return self.default_alpha if rate is None else rate

    def _rung(self, source: str, max_k: int) -> int:
        """The ladder's draft length for `source`, never above the engine's num_draft_tokens (max_k)."""
        return min(self.ladder.current(source), max_k) if self.ladder is not None else max_k

    def budgets(self, seqs, max_k: int) -> list[int]:
        seen = list(self.acceptance.counts)
        sources = list(dict.fromkeys(self.sources + seen)) or [""]
        k = max(self._rung(n, max_k) for n in sources)
        ks = [k] * len(seqs)
        # With a toggle, drafts that rate their own tokens are cut row by row and token by token in
        # clip() (trim_drafts: calibrated rates, this step's real batch and context). The start-up
        # class budgets (one assumed acceptance, an assumed batch per class) would only cap them
        # blindly, cutting drafts that trim_drafts would keep (bench.py --suite rollout shows it).
        # They stay the cap for drafters that do not rate their drafts.
        rated = self.toggle is not None and all(n in self.confident for n in sources)
        if self.classes is not None and not rated:
            ks = [min(k, self.classes.budget(max(s.predicted_len, s.num_completion_tokens)))
                  for k, s in zip(ks, seqs)]
        self._steps += 1
        self._pays, self._probing, self._step_draft_seconds = {}, {}, 0.0     # this step's drafting starts here
        self._catch_up_seconds = 0.0
        if self.guard is not None and not self.guard.allows():
            return [0] * len(seqs)
        if self.toggle is not None and any(ks):
            ctx = sum(len(s) for s in seqs) / len(seqs)
            for n in sources:
                if n in self.confident:       # decided per draft token in clip()
                    self._pays[n] = self._rung(n, max_k)
                    continue
                rung = min(self._rung(n, max_k), max(ks))
                kn = self._verdict(n, len(seqs), ctx, rung)
                gap = self._gap.setdefault(n, [0, self.probe_every])
                if kn:
                    gap[:] = [0, self.probe_every]
                else:   # off: probe (None: the rung's length) once the gap has passed, then double the gap;
                    gap[0] += 1   # never where even an always-right draft would not pay for its drafting
                    if gap[0] >= gap[1] and self._could_pay(len(seqs), ctx, rung):
                        self._probing[n] = tuple(gap)       # (steps waited, gap): a postponed probe restores it
                        gap[:] = [0, min(2 * gap[1], self.probe_every_max)]
                        kn = None
                self._pays[n] = kn
            # draft no further than the longest length any source will use (0: nothing pays or probes)
            cap = max(self._rung(n, max_k) if v is None else v for n, v in self._pays.items())
            ks = [min(k, cap) for k in ks]
            if cap and not any(self._pays.values()):
                ks = self._probe_rows(seqs, ks, cap, ctx)
        return ks

    def _verdict(self, source: str, batch_size: int, ctx_len: float, max_k: int) -> int:
        """The toggle's draft length for `source` this step. It is recomputed only when something it
        depends on moved (batch size, rung, context by 32 tokens, acceptance data, a refit of a latency
        model, the drafting cost, the threshold): most steps of an off drafter change none of them, and
        two best_k sweeps on every step were a measurable part of a batch-1 decode step on CPU."""
        any_k, per_token = self.draft_cost(batch_size, ctx_len)
        key = (batch_size, max_k, int(ctx_len) // 32, self.acceptance.version, self.toggle.latency.fits,
               self.draft_latency.fits if self.draft_latency is not None else None, any_k, self.toggle.min_speedup)
        cached = self._verdicts.get(source)
        if cached is not None and cached[0] == key:
            self.toggle._count(cached[1] > 0, cached[2])       # still one decision per step in its stats
            return cached[1]
        k, s = self.toggle.choose(batch_size, ctx_len, max_k, self.acceptance.rates(source), any_k, per_token,
                                  optimistic=lambda: self.acceptance.rates(source, optimism=1.0))
        self._verdicts[source] = (key, k, s)
        return k

    def _could_pay(self, batch_size: int, ctx_len: float, max_k: int) -> bool:
        """Would drafting pay at this batch if every draft were accepted? If not, a probe (which only
        measures acceptance) cannot change the verdict: the drafter is too slow here (the nf4
        self-drafter on a CPU without a fast 4-bit kernel), whatever it drafts."""
        _, s = best_k(self.toggle.latency, batch_size, ctx_len, 1.0, max_k, *self.draft_cost(batch_size, ctx_len))
        return s >= self.toggle.min_speedup

    def keeps_draft_kv(self, ctx_len: float, max_k: int) -> bool:
        """Should a drafter with its own KV prefill new prompts? Not when it could not pay even for a
        lone sequence whose every draft is accepted: it will not draft here, and its prefill would be
        pure cost (an nf4 forward on CPU dequantizes every layer)."""
        return self.toggle is None or not self.kv_sources or self._could_pay(1, ctx_len, max_k)

    def _probe_rows(self, seqs, ks, cap: int, ctx: float) -> list[int]:
        """A probe step and nothing else: only `probe_rows` rows draft. A drafter with its own KV (self_nf4,
        draft model) first catches up on every token since it last drafted for a row: one forward of its
        model over all of them. A probe may catch up one such row, when that costs at most 1/probe_every
        of the target time it waited (`waited` steps of this batch): a small draft model is then measured
        mid-response (at batch 1 no row is fresh, and acceptance at response starts alone misjudges it),
        while a full-size drafter (nf4 of the policy) waits for rows it is nearly current on -- fresh
        rows, whose prompt it saw at the prefill -- or for a budget grown large enough. Without such a
        row the probe is postponed. Such a probe drafts 2 tokens, each a forward of the drafter (a probe
        of the whole rung, 12 forwards at batch 1, cost an always-wrong drafter 12%): its cost, about 3
        draft forwards, recurs once per gap, which doubles while the drafter stays off."""
        probing = [n for n, v in self._pays.items() if v is None]
        lag = lambda i: len(seqs[i]) - seqs[i].num_draft_computed
        rows = sorted(range(len(seqs)), key=lag)
        if any(n in self.kv_sources for n in probing):
            waited = max(self._probing[n][0] for n in probing if n in self.kv_sources)
            budget = waited / self.probe_every * self.toggle.latency.predict(len(seqs), ctx, 1)
            current = [i for i in rows if lag(i) <= cap + 1]
            stale = [i for i in rows if lag(i) > cap + 1][:1]   # one row measures acceptance mid-response
            for i in stale:              # one forward over its lagging tokens before the first draft
                cost = self.draft_latency.predict(1, seqs[i].num_draft_computed, lag(i)) \
                    if self.draft_latency is not None else math.inf
                if cost <= budget:
                    current.append(i)
                    self._catch_up_seconds += cost
            rows = current
            if not rows:
                for n in probing:      # postponed, not skipped: probe at the next step, gap not doubled
                    self._gap[n][:] = self._probing[n]
            cap = min(cap, 2)          # its every draft token costs a forward: 2 measure acceptance
        keep = set(rows[:self.probe_rows])
        return [min(k, cap) if i in keep else 0 for i, k in enumerate(ks)]

    def clip(self, proposal, budgets, seqs):
        """-> a new Proposal with row i cut to min(budget, its source's rung, the toggle's cost-optimal
        length), or to 0 when its source is toggled off (probe steps keep the first `probe_rows` rows of
        that source); with a toggle, rows with confidence (sampled rows only) are then trimmed by
        `trim_drafts`."""
        probed = defaultdict(int)
        out = []
        for t, b, src in zip(proposal.tokens, budgets, proposal.sources):
            k = min(b, self.ladder.current(src)) if self.ladder is not None else b
            pays = self._pays.get(src, k)      # a source not seen yet drafts: its first measurement
            if pays is None:
                k = 0 if probed[src] >= self.probe_rows else k
                probed[src] += bool(t) and k > 0
            else:
                k = min(k, pays)
            out.append(t[:k])
        confidence = proposal.confidence
        if confidence is not None:      # greedy rows: acceptance is the argmax, not p; no rate
            confidence = [c if s.params.temperature > 0 else None for c, s in zip(confidence, seqs)]
        if self.toggle is not None and confidence is not None:
            out = self._trim(out, proposal.sources, confidence, seqs)
        self._on_steps += any(out)
        return replace(proposal, tokens=out, confidence=confidence)

    def _trim(self, tokens, sources, confidence, seqs):
        """Per-token cost/benefit for the rows whose drafter estimated each token's acceptance; the
        other rows' drafts stay and count at their source's measured rate alpha^j."""
        lat, B = self.toggle.latency, len(seqs)
        ctx = sum(len(s) for s in seqs) / B
        E, fixed, cand, rows = float(B), 0, [], []
        for i, (t, c) in enumerate(zip(tokens, confidence)):
            if t and c is not None:
                rows.append(i)
                src = sources[i]
                cond = [self.calibration(src, j, x) for j, x in enumerate(c[:len(t)])]
                cand.append(list(itertools.accumulate(cond, operator.mul)))
            elif t:
                E += expected_accepted(self.acceptance.rates(sources[i]), len(t))
                fixed += len(t)
        any_k, per_token = self.draft_cost(B, ctx)
        T = any_k + per_token * max(map(len, tokens)) + lat.predict(B, ctx, 1 + fixed / B)
        keep = trim_drafts(cand, E, T, lat.token_cost(ctx), 0.0 if fixed else lat.verify_overhead)
        for i, k in zip(rows, keep):
            tokens[i] = tokens[i][:k]
        return tokens

    def draft_cost(self, batch_size: int, ctx_len: float) -> tuple[float, float]:
        """-> (seconds of a propose() for any k, seconds per draft token) for a batch of this shape."""
        per_token = 0.0 if self.draft_latency is None else self.draft_latency.predict(batch_size, ctx_len, 1)
        return (self.draft_time or 0.0) * batch_size, per_token

    def observe_draft_time(self, seconds: float, num_seqs: int, ctx_len: float = 0.0, forwards: int = 0) -> None:
        """One propose() call over `num_seqs` sequences. A model drafter's time is `forwards` forwards of
        its model (fed to draft_latency); a history drafter's is kept per sequence, so the cost measured
        on a full batch is not charged in full to a tail step of one straggler."""
        if self.replay:          # the modeled cost, and nothing learned from the clock
            any_k, per_token = self.draft_cost(num_seqs, ctx_len)
            self._step_draft_seconds += any_k + per_token * forwards + self._catch_up_seconds
            return
        self._step_draft_seconds += seconds
        if self.draft_latency is not None and forwards:
            if not self._catch_up_seconds:    # a probe's catch-up forward is not a draft forward
                self.draft_latency.observe(num_seqs, ctx_len, 1, seconds / forwards)
            return
        per = seconds / max(num_seqs, 1)
        self.draft_time = per if self.draft_time is None else 0.8 * self.draft_time + 0.2 * per

    def observe_forward(self, seqs, tokens, seconds: float, emitted: int | None = None) -> None:
        """One decode step: its forward + verify `seconds` and the tokens it `emitted` (all rows)."""
        draft_seconds, self._step_draft_seconds = self._step_draft_seconds, 0.0
        if self.toggle is None:
            return
        B, ctx = len(seqs), sum(len(s) for s in seqs) / len(seqs)
        predicted_ar = self.toggle.latency.predict(B, ctx, 1)
        Q = sum(map(len, tokens)) / B        # packed ragged steps cost ~ the real tokens
        if self.replay:
            seconds = self.toggle.latency.predict(B, ctx, Q)
        else:
            self.toggle.latency.observe(B, ctx, Q, seconds)
        # a step that ran the drafter is an attempt, even if every draft was trimmed: its propose()
        # time is what speculation cost it; only steps that never drafted calibrate plain decoding
        attempted = any(len(t) > 1 for t in tokens) or draft_seconds > 0
        paying = any(self._pays.values())        # not a probe-only step
        if emitted is not None and (paying or not attempted):
            self.guard.observe(attempted, seconds + draft_seconds, predicted_ar, emitted / B)

    def observe_acceptance(self, source: str, proposed: int, accepted: int,
                           confidence: Sequence[float] | None = None) -> None:
        """One verify step of one row; `confidence` of its drafts (sampled rows) trains the calibration."""
        if confidence is not None:
            self.calibration.observe(source, confidence[:proposed], accepted)
        self.acceptance.observe(source, proposed, accepted)
        if self.ladder is not None:
            self.ladder.update(source, proposed, accepted)

    def stats(self) -> dict:
        out = {"spec_on_frac": self._on_steps / max(self._steps, 1)}
        if self.toggle is not None:
            out.update(self.toggle.stats())
            out.update(guard_trips=self.guard.trips, guard_suspended_steps=self.guard.suspended_steps)
        if self.ladder is not None:
            out.update({f"drafter/{n}/draft_len": self.ladder.current(n) for n in self.ladder.names})
            out["draft_len_mean"] = float(np.mean([self.ladder.current(n) for n in self.ladder.names])) \
                if self.ladder.names else float(self.ladder.current(""))
        return out

    def reset_stats(self) -> None:
        # the probe backoff carries over to the next rollout step, like the guard's: one step of weights
        # moves acceptance little, and restarting every off drafter's gap at probe_every cost a probe
        # every few dozen steps of each short rollout, for no verdict that changed
        self._steps = self._on_steps = 0
        if self.toggle is not None:
            self.toggle.reset_stats()
            self.guard.reset()


def build_controller(cfg, llm) -> DraftController | None:
    """From the `speculation` config section (config.py) to the engine's draft controller, calibrating
    the toggle's latency model with a short profile of this engine on this machine (EfficientRollout)."""
    if not (cfg.toggle or cfg.adaptive_draft_length or cfg.length_classes):
        return None
    from nanospec.drafters.chain import members
    ladder = DraftLengthLadder(cfg.draft_ladder, cfg.ladder_up, cfg.ladder_down) if cfg.adaptive_draft_length else None
    auto_budgets = bool(cfg.length_classes) and cfg.length_class_budgets is None
    latency, draft_latency, draft_time, max_seqs = None, None, None, llm.scheduler.max_num_seqs
    model_drafters = [d for d in members(llm.drafter) if d.needs_kv]
    if cfg.latency_profile:
        latency, draft_latency, draft_time = replayed_profile(cfg.latency_profile, cfg.toggle and bool(model_drafters))
    elif cfg.toggle or auto_budgets:
        latency = profiled_latency(llm)
        if cfg.toggle and model_drafters:
            draft_latency = profiled_latency(llm, model_drafters[0], query_lens=(1, 8))   # 8: prices catch-ups
    classes = None
    if auto_budgets:    # DAS budgets per length class, from this machine's cost model
        max_k = llm.num_draft_tokens or max(cfg.draft_ladder)
        classes = LengthClasses.for_engine(latency, cfg.length_classes, max_seqs, max_k=max_k,
                                           min_speedup=cfg.toggle_min_speedup)
    elif cfg.length_classes:
        classes = LengthClasses(cfg.length_classes, cfg.length_class_budgets)
    toggle = SpeculationToggle(latency, cfg.toggle_min_speedup) if cfg.toggle else None
    return DraftController(ladder=ladder, classes=classes, toggle=toggle,
                           sources=llm.drafter.sources if llm.drafter is not None else (),
                           confident_sources=[n for d in members(llm.drafter) if d.confident for n in d.sources],
                           kv_sources=[n for d in model_drafters for n in d.sources],
                           draft_latency=draft_latency, replay=bool(cfg.latency_profile), draft_time=draft_time)
