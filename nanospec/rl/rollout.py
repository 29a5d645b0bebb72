"""Synchronous data-parallel GRPO rollouts, with the rollout-system policies.

Per step, every rank (same code, same global prompt list from the seeded data order):
  1. assigns prompts to ranks with no communication (every rank computes the same answer):
     length-aware LPT with equal counts (DAS, `scheduling.assign_to_ranks`) or a contiguous split;
  2. generates its share, G samples per prompt, with `llm.add_request` + `llm.step` (not
     `generate`: it must poll between engine steps); each sequence carries `predicted_len`, which
     the engine's DraftController maps to a length-class draft budget;
  3. arrives at a non-blocking `DoneSignal` and, while slower ranks still generate, spends its bubble
     pre-generating the *next* step's prompts with its current weights (BubbleSpec). The signal is
     polled between engine steps, so this stops within one (deliberately small-batch) step of the
     last rank finishing, and the last rank knows it is last and starts nothing; the unfinished
     bubble sequences are aborted (KV freed) and kept: a partial response is still a draft for its
     prefix;
  4. one `all_gather_object` closes the step: per-rank times and engine stats (-> metrics), every
     prompt's response lengths (every rank feeds the same observations to its LengthPredictor, so
     the next assignment agrees everywhere) and the bubble drafts, which go into every rank's
     prior-rollout drafter as source "bubble" -- whichever rank gets the prompt next step uses them.
Exactness: assignment and drafts change only how many target forwards a sample takes, never what
is sampled (engine/verify.py is exact for any draft); tests/test_rollout.py checks both.
"""
from __future__ import annotations

import gc
import time
import warnings
from collections import defaultdict
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Callable, Hashable

from nanospec.rl import dist
from nanospec.drafters.chain import find_drafter
from nanospec.engine.llm import LLM, summarize
from nanospec.rl.scheduling import LengthPredictor, assign_to_ranks, imbalance, rank_work
from nanospec.engine.sequence import SamplingParams
from nanospec.tasks import Problem, format_prompt


@dataclass
class Sample:
    """One completion; a GRPO group is G consecutive Samples of one prompt."""
    problem: Problem
    prompt_key: Hashable
    prompt_ids: list[int]
    completion_ids: list[int]
    logprobs: list[float]          # engine rollout logprobs (sampler.py definition)
    from_verify: list[bool]
    finish_reason: str


def assign_prompts(predicted: list[float], world_size: int, length_aware: bool) -> list[list[int]]:
    """Prompt indices per rank, equal counts (synchronous DP): LPT on predicted work, or contiguous."""
    n = len(predicted)
    if world_size < 1 or n % world_size:
        raise ValueError(f"problems: expected a multiple of world_size={world_size} prompts, got {n}")
    if length_aware:
        return assign_to_ranks(predicted, world_size)
    m = n // world_size
    return [list(range(r * m, (r + 1) * m)) for r in range(world_size)]


def generate_until(llm: LLM, done: Callable[[], bool], refill=lambda: None) -> int:
    """Engine steps until `done()` (e.g. every rank has arrived: `DoneSignal.done`) or the engine runs
    dry (`refill()` may add requests before each step); returns the steps run."""
    steps = 0
    while not done():
        refill()
        if not llm.scheduler.has_work():
            break
        llm.step()
        steps += 1
    return steps


@contextmanager
def no_gc_pauses():
    """Python's cyclic collector stops the world for a long time in its generation-2 passes here (the
    suffix tries and caches hold very many tracked objects; gc.callbacks shows it). In a rollout such a
    pause on an early rank lands in its bubble step, which then ends late and holds up every rank.
    So the collector is off while rollouts run; reference counting still frees acyclic garbage, and
    the collector resumes after the rollout."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _plain_stats(st) -> dict:
    """llm.stats as picklable plain dicts (it holds defaultdicts with lambdas)."""
    out = {k: v for k, v in st.items() if k != "per_drafter"}
    out["per_drafter"] = {n: dict(d) for n, d in st["per_drafter"].items()}
    return out


class RolloutWorker:
    def __init__(self, llm: LLM, tokenizer, cfg, rank: int = 0, world_size: int = 1, group=None):
        if not 0 <= rank < world_size:
            raise ValueError(f"rank: expected an int in [0, world_size={world_size}), got {rank}")
        if world_size != dist.world_size():
            raise ValueError(f"world_size: expected {dist.world_size()} (the initialised process group; "
                             f"call dist.init_distributed() first), got {world_size}")
        self.llm, self.tokenizer, self.cfg = llm, tokenizer, cfg
        self.group = group          # process group of the step's closing gather (None: the default)
        self.rank, self.world = rank, world_size
        g, eos = cfg.grpo, tokenizer.eos_token_id
        self.params = SamplingParams(temperature=g.temperature, top_p=g.top_p, top_k=g.top_k,
                                     max_tokens=g.max_completion_length, n=g.num_generations,
                                     stop_token_ids=[] if eos is None else [eos])
        self.predictor = LengthPredictor()
        self.prior = find_drafter(llm.drafter, "prior")     # where bubble drafts land
        self.bubble = bool(cfg.speculation.bubble_drafting and self.prior is not None)
        self.bubble_budget = cfg.speculation.bubble_token_budget
        if cfg.speculation.bubble_drafting and llm.drafter is not None and self.prior is None:
            warnings.warn("speculation.bubble_drafting needs a 'prior' drafter in rollout.speculative; "
                          "bubble drafting is off", stacklevel=2)
        seeds = dist.all_gather_object(llm.generator.initial_seed())
        if len(set(seeds)) < len(seeds):     # identical engine RNGs would correlate samples across ranks
            warnings.warn(f"RolloutWorker: ranks share engine seeds {seeds}; reseeding each rank r with "
                          f"seed * world_size + r (build the LLM with seed=base_seed + rank)", stacklevel=2)
            llm.generator.manual_seed(seeds[rank] * world_size + rank)
        self.last_bubble: dict | None = None   # previous step's bubble totals (bubble_recovered_frac)
        self.bubble_train = None               # fn(done): other work for the bubble, first (the draft head's, TLT)
        self._ids: dict[str, list[int]] = {}

    def prompt_ids(self, problem: Problem) -> list[int]:
        if problem.prompt not in self._ids:
            self._ids[problem.prompt] = format_prompt(self.tokenizer, problem.messages or problem.prompt)
        return self._ids[problem.prompt]

    def predict(self, problem: Problem) -> float:
        """Predicted response length (max over the group) of `problem`."""
        return self.predictor.predict(problem.prompt, len(self.prompt_ids(problem)))

    def _add(self, problem: Problem, predicted: float, request_id: int, params: SamplingParams | None = None,
             bubble: bool = False) -> list:
        seqs = self.llm.add_request(self.prompt_ids(problem), params or self.params, request_id, problem.prompt)
        for s in seqs:
            s.predicted_len, s.bubble = predicted, bubble
        return seqs

    # ---- one step ---------------------------------------------------------------------------------
    def run(self, step: int, problems: list[Problem], upcoming: list[Problem] = ()) -> tuple[list[Sample], dict]:
        """This rank's samples (group-major, whole groups) + step metrics (report.py keys; lists
        `rank_*` are over ranks; counters are summed over ranks). `upcoming`: the next step(s)' prompts."""
        llm = self.llm
        if llm.scheduler.has_work():
            raise RuntimeError("RolloutWorker.run: the engine still holds requests from elsewhere")
        if llm.drafter is not None:
            llm.drafter.next_step()
        pred = [self.predict(p) for p in problems]
        assignment = assign_prompts(pred, self.world, self.cfg.speculation.length_aware_assignment)
        llm.reset_stats()
        with no_gc_pauses():
            t0 = time.perf_counter()
            groups = [(i, self._add(problems[i], pred[i], i)) for i in assignment[self.rank]]  # longest first
            while llm.scheduler.has_work():
                llm.step()
            t_busy = time.perf_counter()
            stats, seconds = _plain_stats(llm.stats), dict(llm.seconds)
            signal = dist.DoneSignal()
            signal.arrive()
            drafts, t_draft, t_train = [], 0.0, 0.0
            if self.bubble_train is not None and (self.bubble_budget or not signal.done()):
                self.bubble_train((lambda: False) if self.bubble_budget else signal.done)   # repeatable: all of it
                t_train = time.perf_counter() - t_busy
            if self.bubble and upcoming and (self.bubble_budget or not signal.done()):
                t = time.perf_counter()
                drafts = self._bubble(signal, upcoming)
                t_draft = time.perf_counter() - t
            signal.wait()
            t_done = time.perf_counter()
            mine = dict(busy=t_busy - t0, bubble=t_done - t_busy, draft_time=t_draft, train_time=t_train, wall=t_done - t0,
                        stats=stats, seconds=seconds, drafts=drafts,
                        lengths={i: [s.num_completion_tokens for s in seqs] for i, seqs in groups},
                        forwards={i: [(s.num_forwards, s.num_drafted) for s in seqs] for i, seqs in groups})
            ranks = dist.all_gather_object(mine, self.group)
            t_gathered = time.perf_counter()
        metrics = self._finish(problems, pred, assignment, ranks, t_gathered - t0)
        samples = [Sample(problems[i], problems[i].prompt, s.prompt_token_ids, s.completion_token_ids,
                          s.logprobs, s.from_verify, s.finish_reason) for i, seqs in groups for s in seqs]
        metrics["step"] = step
        return samples, metrics

    def _bubble(self, signal: dist.DoneSignal, upcoming: list[Problem]) -> list[tuple]:
        """Pre-generate upcoming prompts until every rank is done -> [(prompt_key, ids, logprobs)].
        One *greedy* response per prompt: a deterministic draft token x is accepted with probability
        p(x) (engine/verify.py), which the mode maximises, and all G samples of the group verify against
        the same draft, so one greedy draft serves the group better than G sampled ones (more accepted
        bubble tokens per generated one).
        Order: this rank's round-robin share of the upcoming prompts by decreasing predicted length
        (long prompts set the next step's tail; ranks start on different prompts), then the rest.
        At most `cap` bubble sequences run at once, admitted a few per engine step: a bubble step must
        stay short, since the last rank waits for the one in flight when it finishes. Finished bubble
        responses must not enter the local prior cache as "prior" (they are shared as "bubble"
        instead): they are marked `Sequence.bubble`, which the prior drafter skips.
        With `speculation.bubble_token_budget` every rank drafts exactly that many tokens (or until
        the upcoming prompts run out) whenever the others finish: drafts that do not depend on
        timing, for repeatable runs; a rank may then hold the others up."""
        pred = [self.predict(p) for p in upcoming]
        order = sorted(range(len(upcoming)), key=lambda j: (-pred[j], j))
        share = set(order[self.rank::self.world])
        order = [j for j in order if j in share] + [j for j in order if j not in share]
        pending, seqs = order[::-1], []
        cap = max(1, self.llm.scheduler.max_num_seqs // 4)
        greedy = replace(self.params, temperature=0.0, top_p=1.0, top_k=-1, n=1, seed=None)

        def refill():   # admit prompts while fewer than `cap` bubble sequences run, a few per step
            for _ in range(max(1, cap // 4)):   # (a prefill of many prompts is one long step)
                if not pending or sum(not s.is_finished for s in seqs) >= cap:
                    break
                j = pending.pop()
                seqs.extend(self._add(upcoming[j], pred[j], -1 - j, greedy, bubble=True))
        budget = self.bubble_budget
        drafted = lambda: sum(s.num_completion_tokens for s in seqs) >= budget
        generate_until(self.llm, drafted if budget else signal.done, refill)
        for s in seqs:
            self.llm.abort(s)          # frees KV; its partial response stays a valid draft
        return [(s.prompt_key, s.completion_token_ids, s.logprobs) for s in seqs if s.num_completion_tokens]

    def _finish(self, problems, pred, assignment, ranks: list[dict], elapsed: float) -> dict:
        """Merge the gathered per-rank records: drafts -> prior cache, lengths -> predictor, metrics.
        time_rollout = this rank's time from its first request to the end of the closing gather: all
        ranks leave the gather together, so it is the step's rollout wall time (slowest rank + the
        bubble step in flight when it finished + the gather)."""
        for r in ranks if self.prior is not None else ():
            for key, ids, lps in r["drafts"]:
                self.prior.add(key, ids, lps, source="bubble")
        lengths = {i: ls for r in ranks for i, ls in r["lengths"].items()}
        for i, p in enumerate(problems):        # same order on every rank -> identical predictors
            self.predictor.observe(p.prompt, lengths[i], len(self.prompt_ids(p)))
        m, merged, per = self._merged_stats(ranks)
        busy, wall = [r["busy"] for r in ranks], max(elapsed, *(r["wall"] for r in ranks))
        work = rank_work(pred, assignment)
        all_len = sorted(x for ls in lengths.values() for x in ls)
        bub_tokens = [sum(len(ids) for _, ids, _ in r["drafts"]) for r in ranks]
        accepted = per["bubble"]["accepted"] if "bubble" in per else 0
        m.update(rank_busy_time=busy, rank_bubble_time=[r["bubble"] for r in ranks],
                 rank_bubble_draft_time=[r["draft_time"] for r in ranks], rank_bubble_draft_tokens=bub_tokens,
                 rank_bubble_train_time=[r["train_time"] for r in ranks],
                 rank_predicted_work=work, time_rollout=wall, tokens_per_s=merged["generated_tokens"] / max(wall, 1e-9),
                 rollout_imbalance=imbalance(busy), predicted_imbalance=imbalance(work),
                 bubble_draft_tokens=sum(bub_tokens), bubble_draft_accepted=accepted,
                 bubble_draft_proposed=per["bubble"]["proposed"] if "bubble" in per else 0,
                 response_len_mean=sum(all_len) / max(len(all_len), 1),
                 response_len_p50=all_len[len(all_len) // 2] if all_len else 0, response_len_max=max(all_len, default=0),
                 **self._trace(problems, assignment, ranks))
        m.update(self._bubble_recovery(accepted))
        self.last_bubble = dict(tokens=sum(bub_tokens), draft_time=sum(r["draft_time"] for r in ranks),
                                bubble_time=sum(r["bubble"] for r in ranks))
        return m

    def _trace(self, problems, assignment, ranks: list[dict]) -> dict:
        """The step as tools.simulate replays it: group-major in prompt order, every response's
        length, target forwards and drafts verified; each prompt's length and rank; per-rank counters."""
        fwd = {i: f for r in ranks for i, f in r["forwards"].items()}
        rank_of = {i: r for r, idx in enumerate(assignment) for i in idx}
        lens = {i: ls for r in ranks for i, ls in r["lengths"].items()}
        out = dict(response_lens=[x for i in range(len(problems)) for x in lens[i]],
                   response_forwards=[f for i in range(len(problems)) for f, _ in fwd[i]],
                   response_drafted=[d for i in range(len(problems)) for _, d in fwd[i]],
                   prompt_lens=[len(self.prompt_ids(p)) for p in problems],
                   prompt_rank=[rank_of[i] for i in range(len(problems))])
        for k in ("seq_forwards", "generated_tokens", "verify_steps", "proposed_tokens", "accepted_tokens"):
            out[f"rank_{k}"] = [r["stats"][k] for r in ranks]
        for k in ("prefill", "decode", "propose"):    # target forwards (verify included) and drafting
            out[f"rank_time_{k}"] = [r["seconds"][k] for r in ranks]
        out["rank_spec_on_frac"] = [r["stats"]["drafting_steps"] / max(r["stats"]["target_forwards"], 1)
                                    for r in ranks]                   # a rank may have had no prompt
        return out

    def _merged_stats(self, ranks: list[dict]) -> tuple[dict, dict, dict]:
        """Engine counters summed over ranks (per drafter too) -> (metrics, sums, per-drafter sums)."""
        merged, per = defaultdict(int), defaultdict(lambda: defaultdict(int))
        for r in ranks:                         # (every counter is in every rank's stats: LLM.reset_stats)
            for k, v in r["stats"].items():
                if k != "per_drafter":
                    merged[k] += v
            for name, d in r["stats"]["per_drafter"].items():
                for k, v in d.items():
                    per[name][k] += v
        merged["per_drafter"] = per
        m = summarize(merged, lossy=bool(self.llm.drafter is not None and self.llm.drafter.lossy))
        return m, merged, per

    def _bubble_recovery(self, accepted: int) -> dict:
        """Share of the previous step's bubble turned into accepted draft tokens: the share spent
        drafting, times the fraction of those drafted tokens accepted now (capped at 1: one bubble
        token can be accepted by several samples of its group)."""
        prev = self.last_bubble
        if not (prev and prev["bubble_time"] > 0 and self.world > 1):
            return {}
        ratio = accepted / max(prev["tokens"], 1)
        return dict(bubble_accept_ratio=ratio,
                    bubble_recovered_frac=prev["draft_time"] / prev["bubble_time"] * min(1.0, ratio))

    # ---- checkpoints ------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        return {"predictor": self.predictor.state_dict(), "last_bubble": self.last_bubble}

    def load_state_dict(self, sd: dict) -> None:
        if not isinstance(sd, dict) or "predictor" not in sd:
            raise ValueError(f"RolloutWorker.load_state_dict: expected a dict with 'predictor', got {type(sd).__name__}")
        self.predictor.load_state_dict(sd["predictor"])
        self.last_bubble = sd.get("last_bubble")
