"""How much to draft: one decision rule, applied to every row of every engine step.

A step over B rows at mean context C decodes B tokens in t_ar = t(B, C, 1) (latency.py): w of it is
paid once per step, r = (t_ar - w) / B per row. Drafting k_i tokens on row i instead is worth, in
seconds of plain decoding saved, and costs

    V(k) = t_ar + sum_i worth_i * sum_{j < k_i} P_ij,        P_ij = a_i0 * a_i1 * ... * a_ij
    T(k) = t_ar + c * sum_i k_i + v * [any k_i > 0] + D(k)
    worth_i = r + w * last_i,        last_i = exp(-lead_i / sigma) / sum_j exp(-lead_j / sigma)

A token saves its row's r, and a share of w only if it brings the batch's end nearer: a draining
rollout batch ends with its last row, and last_i is the chance that row i is that row (lead_i: tokens
row i is ahead of the row furthest behind; sigma = max(1, sqrt(L * var)): how far rows may still
drift apart in the L tokens left, var the measured variance of a row's accepted drafts per step). Rows
level with each other share w alike; rows that drafted ahead (a sparse drafter, as at T=1) save only r.
With requests waiting, a finished row's slot is refilled at once: w counts 0, every token is worth
t_ar / B, and V / T is Leviathan et al.'s expected tokens per second.

c: seconds one more verified token adds (LatencyModel.token_cost); v: a verify's fixed extra; D: the
drafting (a history drafter's propose(), per row; a drafter with its own model: a forward per draft
position, max_i k_i of them, plus the catch-up over the tokens it has not seen). a_ij: P(row i's draft
j is accepted | the ones before it were): the drafter's confidence scaled by its source's record at
position j, or else the source's measured rate there, raised while evidence is thin (`Acceptance`), so
that a new or rarely seen source is tried, not trusted. The rule: draft the k that maximises V / T
(`plan_drafts`, Dinkelbach), iff its drafts save s times the seconds they cost:

    (V(k) - t_ar) / (T(k) - t_ar)  >=  s      (s = speculation.toggle_min_speedup, the one threshold)

It runs twice per step: before drafting (`budgets`), per source on its rates (a confident source: a
draft claiming 1, propose() time divided by the share of asked rows the drafter drafts for), with D: how
much to ask each source for (0: do not run it); after (`clip`), on each
row's own estimates, D spent: which drafts to verify. The paper policies are its inputs, not separate
mechanisms: EfficientRollout's system-aware toggle is the k = 0 outcome, its adaptive draft length the
per-position rates (an untried position is priced like the last measured one, its bound high, so
drafts grow while accepted); DAS's length classes, when `length_class_budgets` are given, cap k per row.

A source whose drafts `clip` has not kept on their price for a gap of steps (off, or cut every time) is
probed: `probe_rows` of the rows whose tokens are worth the most draft 2 tokens, verified unpriced (a
drafter with its own KV: 1 token, on the rows it is most current on, after a catch-up over the tokens
it missed, priced). The gap doubles per probe up to `probe_every_max`, restarts when `budgets` turns a
rate source back on (a confident source is measured whenever `clip` keeps its drafts), and carries over
rollout steps. A probe costs at most `probe_fraction` of what the source could save at acceptance 1 over
the tokens the batch has left, so a source that could not pay even then is never probed. Old evidence
decays with the steps a source went unobserved: one that got better is back on after a probe or two;
silence never turns it on.
No choice here touches what is sampled (verify.py): every one is exact. With `replay` (a fixed latency
profile) the clock is never read, so the same tokens always lead to the same choices.
Sources: EfficientRollout (toggle, adaptive length); DAS (length budgets); Leviathan et al. 2023 eq. 1.
"""
from __future__ import annotations

import bisect
import heapq
import itertools
import math
import operator
import statistics
from collections import deque
from dataclasses import replace
from typing import Sequence

from nanospec.config import check, is_int
from nanospec.engine.latency import LatencyModel, profiled_latency, replayed_profile
from nanospec.engine import sequence


def plan_drafts(probs: list[list[float]], worth: list[float], t_ar: float, token_cost: float,
                verify_overhead: float = 0.0, draft_seconds: float = 0.0, per_forward: float = 0.0,
                min_speedup: float = 1.0, spent: float = 0.0) -> tuple[list[int], float]:
    """Per row, how many of its drafts to verify: the module docstring's rule for one step.

    probs[i][j]: P(row i's drafts 0..j all accepted), non-increasing in j; worth[i]: seconds of plain
    decoding one more token on row i saves. Drafts add token_cost each and, once any is verified,
    verify_overhead + draft_seconds + per_forward x the longest, after `spent` already committed. A
    draft counts worth * p / min_speedup. V / T is maximised by taking drafts in decreasing worth * p
    while their gain beats token_cost x the ratio so far (a ratio's optimum keeps exactly the items
    that beat it: Dinkelbach), per longest draft K where a position costs a forward; kept iff it beats
    verifying only what is spent. -> (k per row, V / T of the plan)."""
    plain = t_ar / (t_ar + spent)             # verifying only what is already committed
    T0, K_max = t_ar + spent + (0.0 if spent else verify_overhead) + draft_seconds, max(map(len, probs), default=0)
    # Two bounds, no sort, answer most steps where the rule declines to draft, as the loop would: it
    # first tests each K's largest gain against its T (the largest of all failing at the largest T
    # keeps nothing), and no plan's V / T beats every gain kept over T0 (1e-9: float sums). A row's
    # largest gain is at its first or last draft (p non-increasing), and its gains sum to
    # worth * sum(p) / s: O(B) Python, the step's common case, before the O(B * K) list of gains.
    largest = max((max(w * row[0], w * row[-1]) / min_speedup for w, row in zip(worth, probs) if row), default=0.0)
    total = sum(w * sum(row) for w, row in zip(worth, probs) if w > 0) / min_speedup
    if declines(largest, total, t_ar, token_cost, T0 + per_forward * K_max, plain * T0):
        return [0] * len(probs), plain
    # gains: (worth * p / s, row i, position j), in the loop's order; the loop takes those with j < K
    gains = [(w * p / min_speedup, i, j) for i, (w, row) in enumerate(zip(worth, probs)) for j, p in enumerate(row)]
    plans = []
    for K in range(1, K_max + 1) if per_forward else [None]:
        V, T, keep = t_ar, T0 + per_forward * (K or 0), [0] * len(probs)
        for g, i in sorted(((g, i) for g, i, j in gains if K is None or j < K), key=lambda x: -x[0]):
            if g * T < token_cost * V:
                break
            V, T, keep[i] = V + g, T + token_cost, keep[i] + 1
        if any(keep):
            plans.append((V / T, keep))
    x, keep = max(plans, default=(0.0, None), key=lambda plan: plan[0])
    return (keep, x) if x >= plain else ([0] * len(probs), plain)


def declines(largest: float, total: float, t_ar: float, token_cost: float, T_max: float, plain_T0: float) -> bool:
    """plan_drafts' two bounds: the largest gain fails at the largest T, or all gains together cannot
    lift V / T over plain (1e-9: float sums in another order). -> True: the plan keeps nothing."""
    return largest * T_max < token_cost * t_ar or (t_ar + total) * (1 + 1e-9) < plain_T0


class Acceptance:
    """One acceptance tally per source and draft position: drafts tested (a verify row tests its drafts
    up to the first rejection), accepted and, for drafts with a confidence, the acceptance they claimed.
    A position halves at `max_count` tests; a source's counts decay by `decay` per step it went
    unobserved (applied when it is observed again: silence alone never switches a source back on).

    Confident drafts: c * (accepted + m) / (claimed + m), the confidence c scaled by how often the
    position's drafts were right for what they claimed, pooled over all confidences (a suffix tree's
    frequencies overstate at T=1, understate at T=0.6), so every kept draft updates it. (Per confidence
    bin, a few early rejections priced a bin below every later price, for good: docs/notebook.md.)
    Others: r_j = (accepted_j + m * r_(j-1)) / (tested_j + m), shrunk toward the position before
    (`prior` at 0), raised by sqrt(r (1 - r) m) / (tested_j + m) (a bound shrinking as 1 / tested: one
    shrinking as 1 / sqrt(tested) compounds over 8 positions into a long draft priced 1.5x too high).
    A rate rising along the draft is priced as measured; an untried position like the one before it,
    with a wide bound: drafts grow while accepted.
    """

    def __init__(self, prior: float = 0.5, positions: int = 16, prior_weight: float = 2.0,
                 max_count: float = 32.0, decay: float = 0.998):
        check(0.0 <= prior <= 1.0, "prior", "a probability in [0, 1]", prior)
        check(0.0 < decay <= 1.0, "decay", "in (0, 1]", decay)
        self.prior, self.positions, self.m = prior, positions, prior_weight
        self.max_count, self.decay = max_count, decay
        # source -> [tested, accepted, claimed] per cell: cells 0..P-1 drafts without confidence, P..2P-1 with
        self.counts: dict[str, list[list[float]]] = {}
        self.seen: dict[str, int] = {}                                  # source -> step it was last observed

    def _cell(self, j: int, confident: bool) -> int:
        return min(j, self.positions - 1) + (self.positions if confident else 0)

    def observe(self, source: str, proposed: int, accepted: int, confidence: Sequence[float] | None = None,
                step: int = 0) -> None:
        cells = self.counts.setdefault(source, [[0.0] * 2 * self.positions for _ in range(3)])
        f = self.decay ** (step - self.seen.setdefault(source, step))
        if f < 1.0:
            cells[:] = [[x * f for x in xs] for xs in cells]
        self.seen[source] = step
        tested, acc, claimed = cells
        for j in range(min(accepted + 1, proposed)):
            cell = self._cell(j, bool(confidence))
            tested[cell] += 1.0
            acc[cell] += j < accepted
            claimed[cell] += confidence[j] if confidence else 0.0
            if tested[cell] > self.max_count:
                tested[cell], acc[cell], claimed[cell] = tested[cell] / 2, acc[cell] / 2, claimed[cell] / 2

    def rates(self, source: str, k: int) -> list[float]:
        """Upper-bound conditional acceptance at positions 0..k-1 of a draft without confidence."""
        tested, acc, _ = self.counts.get(source, (None, None, None))
        out, r = [], self.prior
        for j in range(k):
            cell = self._cell(j, False)
            t, a = (0.0, 0.0) if tested is None else (tested[cell], acc[cell])
            if t == 0.0 and out:            # untried: priced like the last position measured
                out.append(out[-1])
                continue
            r = (a + self.m * r) / (t + self.m)
            out.append(min(1.0, r + math.sqrt(r * (1.0 - r) * self.m) / (t + self.m)))
        return out

    def calibrated(self, source: str, confidence: Sequence[float]) -> list[float]:
        """Conditional acceptance of each draft: its raw confidence c, scaled by its position's accepted /
        claimed, shrunk toward 1 (1 before any data; an untried position takes the last measured one's)."""
        tested, acc, claimed = self.counts.get(source, (None, None, None))
        out, s = [], 1.0
        for j, c in enumerate(confidence):
            cell = self._cell(j, True)
            if tested is not None and tested[cell]:
                s = (acc[cell] + self.m) / (claimed[cell] + self.m)
            out.append(min(1.0, c * s))
        return out


class LengthClasses:
    """DAS's per-length draft caps: a row whose response is (predicted to be) in class i drafts at most
    budgets[i]; class i covers lengths in [thresholds[i-1], thresholds[i])."""

    def __init__(self, thresholds: Sequence[float], budgets: Sequence[int]):
        thresholds, budgets = tuple(thresholds), tuple(budgets)
        check(all(t > 0 for t in thresholds) and all(a < b for a, b in zip(thresholds, thresholds[1:])),
              "thresholds", "strictly increasing lengths > 0", thresholds)
        check(len(budgets) == len(thresholds) + 1 and all(is_int(b) and b >= 0 for b in budgets), "budgets",
              f"len(thresholds) + 1 = {len(thresholds) + 1} ints >= 0", budgets)
        self.thresholds, self.budgets = thresholds, budgets

    def budget(self, length: float) -> int:
        return self.budgets[bisect.bisect_right(self.thresholds, length)]


class DraftController:
    """The engine's hook (`LLM(..., controller=DraftController(...))`): `budgets` before the drafter
    proposes, `clip` after; `observe_*` report back timings and acceptance. Without a `latency` model
    (speculation.toggle: false) every row drafts its cap."""

    def __init__(self, latency: LatencyModel | None = None, *, min_speedup: float = 1.05,
                 classes: LengthClasses | None = None, sources: Sequence[str] = (),
                 confident_sources: Sequence[str] = (), kv_sources: Sequence[str] = (),
                 source_caps: dict[str, int] | None = None, draft_latency: LatencyModel | None = None,
                 draft_time: float | None = None, replay: bool = False,
                 prior: float = 0.5, probe_every: int = 8, probe_every_max: int = 32, probe_rows: int = 4,
                 probe_fraction: float = 0.05):
        check(min_speedup > 0, "min_speedup", "> 0", min_speedup)
        check(is_int(probe_every) and 1 <= probe_every <= probe_every_max, "probe_every",
              f"an int in [1, probe_every_max={probe_every_max}]", probe_every)
        check(is_int(probe_rows) and probe_rows >= 1, "probe_rows", "an int >= 1", probe_rows)
        self.latency, self.min_speedup, self.classes = latency, min_speedup, classes
        self.sources = list(sources)                  # the drafter's source names; more are learned
        self.confident, self.kv_sources = set(confident_sources), set(kv_sources)
        self.source_caps = dict(source_caps or {})    # source -> its spec's num_draft_tokens (a chain's member)
        self.draft_latency = draft_latency            # one forward of a model drafter, if any
        self.draft_time = draft_time                  # seconds of a history drafter's propose() per row:
        self._draft_times: deque = deque(maxlen=9)    # the median of the last 9 (`observe_draft_time`)
        self.replay = replay
        self.acceptance = Acceptance(prior)
        self.probe_every, self.probe_every_max = probe_every, probe_every_max
        self.probe_rows, self.probe_fraction = probe_rows, probe_fraction
        self._gap: dict[str, list[int]] = {}          # per source: [steps since its last probe, gap]
        self._step: dict | None = None                # this step's plan (budgets -> clip -> observe_forward)
        self._clock = 0                               # engine steps observed (the evidence's decay)
        self._progress = [0.0, 0.0, 0.0]              # decayed: row-steps, sum and sum of squares of drafts
                                                      # accepted (how far apart rows drift: `_begin`)
        self._asked = [0.0, 0.0]                      # decayed: rows the drafter was asked for, drafted for

    # ---- the rule -----------------------------------------------------------------------------------
    def _begin(self, seqs, draining: bool = True) -> dict:
        """What every decision of this step needs, computed once: t_ar, c, v, and what a token on each
        row is worth (the module docstring's worth_i; draining: no request waits for a slot)."""
        B = len(seqs)
        ctx = sum(len(s) for s in seqs) / B
        st = dict(B=B, ctx=ctx, ks={}, probing={})
        if self.latency is not None:
            t_ar = self.latency.predict(B, ctx, 1)
            w = self.latency.predict(0, ctx, 1) if draining else 0.0        # t(0, C, 1): the per-step part
            left = [max(0, s.params.max_tokens - s.num_completion_tokens) for s in seqs]   # tokens to go
            most = max(left)
            rows, s1, s2 = self._progress
            var = max(0.0, s2 / rows - (s1 / rows) ** 2) if rows else 0.0
            sigma = max(1.0, math.sqrt(most * var))       # how far the rows may drift apart, tokens
            last = [math.exp((n - most) / sigma) for n in left]           # lead = most - n
            r, share = (t_ar - w) / B, w / sum(last)
            worth = [r + share * x for x in last]
            st.update(t_ar=t_ar, c=self.latency.token_cost(ctx), v=self.latency.verify_overhead, left=sum(left),
                      worth=worth, wmax=max(worth), wsum=sum(w for w in worth if w > 0))
        return st

    def _draft_cost(self, st: dict, source: str, rows: int, lag: float = 1.0) -> tuple[float, float]:
        """-> (seconds of drafting for any k, seconds per draft position) for `rows` rows of `source`:
        a history drafter's propose() per row; a model drafter's forward per position, its first one
        over the `lag` tokens per row it has not seen yet (the catch-up)."""
        if source not in self.kv_sources:
            return (self.draft_time or 0.0) * rows, 0.0
        if self.draft_latency is None:
            return 0.0, 0.0
        per = self.draft_latency.predict(rows, st["ctx"], 1)
        return max(0.0, self.draft_latency.predict(rows, st["ctx"], max(lag, 1.0)) - per), per

    def _solve(self, st: dict, probs: list[list[float]], fixed: float, per_forward: float) -> tuple[list[int], float]:
        """`plan_drafts` with the drafting cost: `fixed` + `per_forward` x the longest kept draft."""
        return plan_drafts(probs, st["worth"], st["t_ar"], st["c"], st["v"], fixed, per_forward, self.min_speedup)

    def budgets(self, seqs, max_k: int, draining: bool = True) -> list[int]:
        """Per row, the most drafts to ask for: the max over sources of what each would be given.
        draining: no request is waiting for a slot (`_begin`)."""
        st = self._step = self._begin(seqs, draining)
        caps = [max_k if self.classes is None else                           # DAS: a cap per length class
                min(max_k, self.classes.budget(max(s.predicted_len, s.num_completion_tokens))) for s in seqs]
        if self.latency is None or not any(caps):
            return caps
        lags = [len(s) - getattr(s, "num_draft_computed", len(s) - 1) for s in seqs]
        out = [0] * len(seqs)
        for n in dict.fromkeys(self.sources + list(self.acceptance.counts)) or [""]:
            mine = [min(k, self.source_caps.get(n, k)) for k in caps]        # its own num_draft_tokens
            cost = self._draft_cost(st, n, len(seqs), sum(lags) / len(lags))
            if n in self.confident:   # a draft claiming 1; its propose() paid on every row asked, per row drafted
                cond = self.acceptance.calibrated(n, [1.0] * max(mine))
                cost = (cost[0] / self._yield(), cost[1])
            else:
                cond = self.acceptance.rates(n, max(mine))
            probs = list(itertools.accumulate(cond, operator.mul))
            same = mine[0] if mine.count(mine[0]) == len(mine) else 0      # every row's cap, if one
            if same and self._uniform_declines(st, probs[:same], *cost):
                ks = [0] * len(seqs)
            else:
                ks = self._solve(st, [probs[:k] for k in mine], *cost)[0]
            if n in self.confident:   # it rates each draft itself (clip): asked for the cap wherever it pays
                ks = [k if kept else 0 for k, kept in zip(mine, ks)]
            gap = self._gap.setdefault(n, [0, self.probe_every])
            gap[0] += 1          # steps since clip() last kept its drafts on their price (it resets it)
            if any(ks) and n not in self.confident:       # a rate source back on: its backoff restarts
                gap[1] = self.probe_every
            if gap[0] >= gap[1]:                # off, or asked but cut every time: probed
                probe = self._probe(st, n, seqs, mine, lags, gap)
                ks = [max(a, b) for a, b in zip(ks, probe)]
            st["ks"][n] = ks
            if any(ks):
                out = [max(a, b) for a, b in zip(out, ks)]
        return out

    def _uniform_declines(self, st: dict, probs: list[float], fixed: float, per_forward: float) -> bool:
        """`plan_drafts`' bounds where every row asks the same drafts `probs`, from the step's largest and
        summed worth (`_begin`): O(K) per source, not O(B), so a step the rule declines costs what its
        worth list costs. The same answer: the largest gain is the largest worth's (w p rounds
        monotonically in w), and the gains' sum differs from plan_drafts' only in float order. Per longest
        draft K, as the loop plans: a model drafter's K forwards count against K's gains alone."""
        s, T0, sums = self.min_speedup, st["t_ar"] + st["v"] + fixed, itertools.accumulate(probs)
        return all(declines(max(st["wmax"] * probs[0], st["wmax"] * p) / s, st["wsum"] * total / s, st["t_ar"],
                            st["c"], T0 + per_forward * K, T0 + per_forward * K)
                   for K, (p, total) in enumerate(zip(probs, sums), 1))

    def _yield(self) -> float:
        """The share of the rows the drafter is asked for that it drafts for, shrunk toward 1 (a new
        drafter is tried). The drafter's, not a source's: propose() is timed for the whole drafter (a
        chain), so that is the time a drafted row costs. A suffix trie asked on text it has never seen
        drafts on few rows, and each ask grows the row's text in the trie: priced at its claims alone,
        it was asked every step; a chain whose members together draft most rows stays asked."""
        asked, drafted = self._asked
        return (drafted + self.acceptance.m) / (asked + self.acceptance.m)

    def _probe(self, st: dict, source: str, seqs, caps: list[int], lags: list[int], gap: list[int]) -> list[int]:
        """An off source's probe rows (k per row), or all 0: see the module docstring."""
        # the rows worth the most (the batch waits for them); with its own KV, the most current ones, after a
        # priced catch-up (probed only where current, a draft model was rated by responses' openings alone)
        kv, worth = source in self.kv_sources, st["worth"]
        rows = heapq.nsmallest(self.probe_rows, (i for i in range(len(seqs)) if caps[i]),
                               key=lambda i: (lags[i] if kv else 0, -worth[i]))
        if not rows:
            return [0] * len(seqs)
        k = min(1 if kv else 2, *(caps[i] for i in rows))          # 1: a model drafter's forward each
        any_k, per = self._draft_cost(st, source, len(rows), sum(lags[i] for i in rows) / len(rows))
        cost = any_k + per * k + st["v"] + st["c"] * k * len(rows)
        budget = self.probe_fraction * st["left"] / st["B"] * st["t_ar"]    # x (1 - 1 / s1) below, s1 > 1
        if cost > budget:        # unaffordable whatever s1, so skip the solve
            return [0] * len(seqs)
        fixed, per_forward = self._draft_cost(st, source, len(seqs))
        if self._probe_declines(st, caps, fixed, cost, budget):      # whatever the solve below finds
            return [0] * len(seqs)
        keep, s1 = self._solve(st, [[1.0] * k for k in caps], fixed, per_forward)      # acceptance 1
        if not any(keep) or cost > (1 - 1 / s1) * budget:
            return [0] * len(seqs)
        gap[:] = [0, min(2 * gap[1], self.probe_every_max)]
        st["probing"][source] = k                            # tokens a probe row keeps (`clip`)
        return [k if i in rows else 0 for i in range(len(seqs))]

    def _probe_declines(self, st: dict, caps: list[int], fixed: float, cost: float, budget: float) -> bool:
        """True where `_probe`'s test fails for every plan, so the solve at acceptance 1 (a sort of every
        row's gains, on every step a probe is due and declined) is not needed. At acceptance 1 a plan's n
        largest gains give V / T <= (t_ar + min(n g, G)) / (T0 + n c), g the largest gain, G their sum,
        largest at n = 0 (<= 1: drafting costs >= 0) or n = G / g; plain's V / T is 1. 1e-9: float sums
        in another order."""
        s, T0 = self.min_speedup, st["t_ar"] + st["v"] + fixed
        g = max((w for w, k in zip(st["worth"], caps) if k), default=0.0) / s
        G = sum(w * k for w, k in zip(st["worth"], caps) if w > 0) / s
        s1 = max(1.0, (st["t_ar"] + G) / (T0 + G / g * st["c"]) if g > 0 else 0.0)
        return cost > (1 - 1 / (s1 * (1 + 1e-9))) * budget

    def keeps_draft_kv(self, ctx_len: float, max_k: int) -> bool:
        """Should a drafter with its own KV prefill new prompts? Not where it could not pay for a lone
        row even at acceptance 1: it would never draft, and its prefill would be pure cost."""
        if self.latency is None or not self.kv_sources:
            return True
        source = next(iter(self.kv_sources))
        max_k = min(max_k, self.source_caps.get(source, max_k))
        row = sequence.Sequence([0] * int(ctx_len), sequence.SamplingParams(max_tokens=max_k + 1))
        st = self._begin([row])
        return any(self._solve(st, [[1.0] * max_k], *self._draft_cost(st, source, 1))[0])

    def clip(self, proposal, budgets, seqs):
        """-> `proposal` with each row cut to what pays: its source's length from `budgets` (its probe
        rows kept as drafted), then every row priced by its own estimates, drafting already spent."""
        st = self._step or self._begin(seqs)
        if self.latency is None:
            return proposal
        confidence = proposal.confidence or [None] * len(seqs)
        confidence = [c if s.params.temperature > 0 else None for c, s in zip(confidence, seqs)]  # greedy: argmax
        tokens, probs, probed = list(proposal.tokens), [[] for _ in seqs], set()
        for n in st["probing"]:          # probe rows: those of the probed source's rows worth the most
            rows = [i for i, t in enumerate(tokens) if t and proposal.sources[i] == n]
            probed.update(sorted(rows, key=lambda i: -st["worth"][i])[:self.probe_rows])
        for i, (t, n, c) in enumerate(zip(tokens, proposal.sources, confidence)):
            if i in probed:                        # drafted to be measured, not priced
                tokens[i] = t[:st["probing"][n]]
            if not t or i in probed:
                continue
            k = min(len(t), st["ks"].get(n, budgets)[i])
            cond = self.acceptance.calibrated(n, c[:k]) if c is not None else self.acceptance.rates(n, k)
            probs[i] = list(itertools.accumulate(cond, operator.mul))
        fixed = sum(len(tokens[i]) for i in probed)
        keep, _ = plan_drafts(probs, st["worth"], st["t_ar"], st["c"], st["v"], min_speedup=self.min_speedup,
                              spent=st["c"] * fixed + st["v"] if fixed else 0.0)
        tokens = [t if i in probed else t[:k] for i, (t, k) in enumerate(zip(tokens, keep))]
        for i, k in enumerate(keep):
            if k and proposal.sources[i] in self._gap:    # verified on its price: no probe needed yet
                self._gap[proposal.sources[i]][0] = 0
        asked = [i for i, k in enumerate(budgets) if k]   # the drafter's yield (`_yield`); silence leaves
        if asked:                                          # it: it never turns a source back on
            drafted = sum(bool(proposal.tokens[i]) for i in asked)
            self._asked = [0.9 * self._asked[0] + len(asked), 0.9 * self._asked[1] + drafted]
        return replace(proposal, tokens=tokens, confidence=proposal.confidence and confidence)

    # ---- what the engine reports back ---------------------------------------------------------------
    def observe_draft_time(self, seconds: float, num_seqs: int, ctx_len: float = 0.0, forwards: int = 0,
                           lag: float = 1.0) -> None:
        """One propose() over `num_seqs` rows; a model drafter's is `forwards` forwards of its model, the
        first over the `lag` tokens a row it had not seen. That catch-up is priced apart (`_draft_cost`),
        so its predicted share is taken out before the rest is learned as one-token forwards (counted in
        both, it priced a draft head's drafts above their cost: docs/results.md).
        In replay nothing is learned from the clock. A median, not a mean: a drafter priced off is not
        timed again, so one stalled propose() (a full GC pass, a page fault) must not outweigh the rest."""
        if self.replay:
            return
        if forwards:
            if self.draft_latency is not None:
                lag, per = max(lag, 1.0), self.draft_latency.predict(num_seqs, ctx_len, 1)
                catch_up = max(0.0, self.draft_latency.predict(num_seqs, ctx_len, lag) - per)
                # a forward over Q tokens costs at most Q one-token forwards: beyond that, the model errs
                rest = max(seconds - catch_up, seconds * forwards / (lag + forwards - 1))
                self.draft_latency.observe(num_seqs, ctx_len, 1, rest / forwards)
            return
        self._draft_times.append(seconds / max(num_seqs, 1))
        self.draft_time = statistics.median(self._draft_times)

    def observe_acceptance(self, source: str, proposed: int, accepted: int,
                           confidence: Sequence[float] | None = None) -> None:
        """One verify row: `proposed` drafts of `source`, the first `accepted` of them accepted."""
        self.acceptance.observe(source, proposed, accepted, confidence, self._clock)
        self._progress[1:] = [self._progress[1] + accepted, self._progress[2] + accepted ** 2]

    def observe_forward(self, seqs, tokens, seconds: float, prefill: bool = False) -> None:
        """The end of a step (prefill or decode): its target forward + verify took `seconds`."""
        st, self._step = self._step or self._begin(seqs), None
        self._clock += 1
        self._progress = [x * 0.99 for x in self._progress]
        self._progress[0] += len(seqs)
        if self.latency is not None and not self.replay and not prefill:   # a prefill's Q is a prompt
            self.latency.observe(st["B"], st["ctx"], sum(map(len, tokens)) / st["B"], seconds)


def build_controller(cfg, llm) -> DraftController | None:
    """From the `speculation` config section (config.py) to the engine's draft controller, its latency
    models profiled on this machine at start-up (EfficientRollout) or replayed from a file."""
    classes = LengthClasses(cfg.length_classes, cfg.length_class_budgets) \
        if cfg.length_classes and cfg.length_class_budgets is not None else None
    if not (cfg.toggle or classes):
        return None
    from nanospec.drafters.chain import members
    model_drafters = [d for d in members(llm.drafter) if d.needs_kv]
    latency, draft_latency, draft_time = None, None, None
    if cfg.toggle and cfg.latency_profile:
        latency, draft_latency, draft_time = replayed_profile(cfg.latency_profile, bool(model_drafters))
    elif cfg.toggle:
        latency = profiled_latency(llm)
        if model_drafters:
            draft_latency = profiled_latency(llm, model_drafters[0], query_lens=(1, 8))   # 8: prices catch-ups
    return DraftController(latency, min_speedup=cfg.toggle_min_speedup, classes=classes,
                           sources=llm.drafter.sources if llm.drafter is not None else (),
                           source_caps={n: d.max_draft_tokens for d in members(llm.drafter) if d.max_draft_tokens
                                        for n in d.sources},
                           confident_sources=[n for d in members(llm.drafter) if d.confident for n in d.sources],
                           kv_sources=[n for d in model_drafters for n in d.sources],
                           draft_latency=draft_latency, draft_time=draft_time,
                           replay=bool(cfg.toggle and cfg.latency_profile))
