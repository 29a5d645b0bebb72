"""GRPO trainer: synchronous data-parallel rollouts with the speculative engine, then one policy update.

One step, on every rank (torch.distributed, gloo on CPU / nccl on GPU; world 1 without a group):
    problems(step)           the global prompt list, a pure function of (seed, step): resumable
    RolloutWorker.run        this rank's whole groups, G samples each, speculative and exact
    tasks.score (rewards)    -> group_advantages (groups never straddle ranks)
    forward (plain causal)   trainer logprobs; at mu=1 their detached copy *is* the recompute of
                             pi_old, so `mismatch/*` (engine vs trainer, ~1e-6 in fp32) costs nothing
    policy_loss per micro-batch, scaled by the GLOBAL seq/token counts (loss.py contract), backward
    all_reduce(SUM) of one flat gradient buffer -> clip -> AdamW -> LR schedule
                             (run.sharding fsdp: FSDP2 reduce-scatters in backward; rl/sharding.py)
    llm.load_weights         in-place copy into the engine's own model + drafter refresh ("weight sync")
    drafter health           self-drafter checksum; acceptance-collapse warning per drafter
    metrics.jsonl line (rank 0), checkpoint every run.save_every steps and at the end
The engine shares the policy's tensors when it runs them as they are (fp32, no CUDA graphs): one copy
of the weights in memory, and the weight sync is only the drafters' refresh. In another dtype (bf16
rollouts, fp32 training) or under captured graphs it holds its own copy, synced in place.
Old logprobs: without TIS, the engine's rollout logprobs; with TIS (tis_cap), the trainer's recompute,
and the truncated ratio pi_old/pi_rollout reweights each token (verl / TRL vllm_importance_sampling).

One-step off-policy (grpo.max_staleness: 1, the pipelines of verl, AReaL, NeMo-RL): each rank trains
on the rollout it made during the previous step, by the policy one update older, while a thread rolls
out the next step with the current weights; the two meet at the weight sync that ends the step. We
pipeline within each rank rather than split ranks into generators and trainers: the data-parallel
layout, the engine and the checkpoint stay those of the synchronous trainer, which is the same loop
with a pipeline depth of 0. The rollout thread's collectives go through a group of their own, so
they never pair up with the trainer's. TIS (required) corrects the one-update-old logprobs; drafters
are refreshed at the same weight sync, so they always draft for the weights the rollout samples from.
"""
from __future__ import annotations

import json
import math
import resource
import shutil
import statistics
import time
import warnings
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.utils.checkpoint
from tqdm.auto import tqdm

from nanospec.rl import dist
from nanospec.rl.checkpoint import (MANIFEST, engine_state, list_checkpoints, load_checkpoint, load_engine_state, load_sharded,
                                    resume_point, rng_state, save_checkpoint, set_rng_state)
from nanospec.config import GRPOConfig, config_to_dict, read_jsonl, save_config, validate_world
from nanospec.rl.dist import all_reduce_grads, hash_seed
from nanospec.drafters.chain import find_drafter, members
from nanospec.drafters.head import completion_mask, head_loss
from nanospec.engine.llm import LLM, frozen_heap
from nanospec.engine.sampler import token_logprobs
from nanospec.models.hub import resolve_model
from nanospec.models.loader import load_model
from nanospec.rl.loss import (group_advantages, logprob_mismatch, overlong_penalty, policy_loss, tis_weights,
                             token_entropy)
from nanospec.rl.rollout import RolloutWorker, Sample
from nanospec.rl.sharding import (clip_grad_norm_, full_weights, load_training_state, shard_policy, state_bytes,
                                  training_state)
from nanospec.engine.sequence import SamplingParams
from nanospec.rl.live import log_scalars, tensorboard_writer
from nanospec.tasks import RewardError, longest_prompt, score, task_from_config


MICROBATCH_TOKENS = 1024   # padded tokens per forward/backward on the trainer side (a real 135M model:
                           # ~0.6 GB of activations)
LOGIT_CHUNK = 512          # completion tokens whose [*, vocab] logits exist at once


@dataclass
class Rollout:
    """One step's samples and rollout metrics, with the policy version (optimizer updates applied to
    the engine's weights) that generated them and when (perf_counter seconds)."""
    samples: list
    metrics: dict
    version: int
    start: float
    end: float


@dataclass
class MicroBatch:
    ids: torch.Tensor          # [B, L] prompt + completion, right-padded
    pos: torch.Tensor          # [B, T] position whose logits predict completion token t
    tokens: torch.Tensor       # [B, T] completion tokens
    mask: torch.Tensor         # [B, T] 1 = real token
    behaviour_lp: torch.Tensor # [B, T] the engine's logprobs: mu, the behaviour policy that sampled them
    from_verify: torch.Tensor  # [B, T] bool
    adv: torch.Tensor          # [B]


def shape_rewards(rewards: list[float], lengths: list[int], g: GRPOConfig) -> torch.Tensor:
    """-> [N] what the advantages see: the task's rewards plus, with grpo.overlong_buffer, DAPO's soft
    overlong penalty (eq. 13, <= 0). The logged reward stays the task's."""
    shaped = torch.tensor(rewards, dtype=torch.float32)
    if g.overlong_buffer:
        shaped = shaped + overlong_penalty(torch.tensor(lengths), g.max_completion_length, g.overlong_buffer,
                                           g.overlong_penalty)
    return shaped


def make_microbatch(samples: list[Sample], adv: torch.Tensor, pad_id: int, device) -> MicroBatch:
    B, L = len(samples), max(len(s.prompt_ids) + len(s.completion_ids) for s in samples)
    T = max(len(s.completion_ids) for s in samples)
    ids = torch.full((B, L), pad_id, dtype=torch.long)
    pos, tokens = torch.zeros(B, T, dtype=torch.long), torch.zeros(B, T, dtype=torch.long)
    mask, lp, fv = torch.zeros(B, T), torch.zeros(B, T), torch.zeros(B, T, dtype=torch.bool)
    for b, s in enumerate(samples):
        p, n = len(s.prompt_ids), len(s.completion_ids)
        ids[b, :p + n] = torch.tensor(s.prompt_ids + s.completion_ids)
        pos[b, :n] = torch.arange(p - 1, p - 1 + n)
        tokens[b, :n], mask[b, :n] = torch.tensor(s.completion_ids), 1.0
        lp[b, :n], fv[b, :n] = torch.tensor(s.logprobs, dtype=torch.float32), torch.tensor(s.from_verify)
    return MicroBatch(*(t.to(device) for t in (ids, pos, tokens, mask, lp, fv, adv)))


def micro_batches(samples: list[Sample], accumulation_steps: int, max_tokens: int = MICROBATCH_TOKENS):
    """Index lists: `accumulation_steps` consecutive chunks, each cut into length-sorted pieces of at
    most `max_tokens` padded tokens. Any partition gives the same gradient (losses are scaled by global
    counts, loss.py), and response lengths are heavy-tailed: one padded batch would be mostly padding."""
    n = len(samples)
    size, out = -(-n // accumulation_steps), []
    length = lambda i: len(samples[i].prompt_ids) + len(samples[i].completion_ids)
    for start in range(0, n, size):
        cur = []
        for i in sorted(range(start, min(start + size, n)), key=length):
            if cur and (len(cur) + 1) * length(i) > max_tokens:
                out.append(cur)
                cur = []
            cur.append(i)
        out.append(cur)
    return out


def completion_logprobs(model, mb: MicroBatch, temperature: float):
    """Plain causal forward -> (log softmax(logits / T)[token], entropy of softmax(logits / T)) at each
    completion position, both [B, T], and the hidden states [B, L, D] (a draft head learns from them);
    the entropy carries no grad.

    The [tokens, vocab] logits are the largest tensor of a step (a real 49k vocabulary: 200 KB per
    token in fp32, more than the whole decoder's activations), so they exist one chunk of
    LOGIT_CHUNK tokens at a time: with grad on, each chunk is checkpointed (only its hidden states are
    kept; backward recomputes its logits), so peak memory does not grow with the batch."""
    hidden = model(mb.ids)                                                        # [B, L, D]
    h = hidden.gather(1, mb.pos.unsqueeze(-1).expand(-1, -1, hidden.shape[-1]))   # [B, T, D]
    B, T, D = h.shape
    h, tokens = h.reshape(1, B * T, D), mb.tokens.reshape(1, B * T)

    def chunk(h, t):                                                              # -> [1, n], [1, n]
        logits = model.logits(h)
        return token_logprobs(logits, t, temperature), token_entropy(logits, temperature)
    out = [torch.utils.checkpoint.checkpoint(chunk, h[:, i:i + LOGIT_CHUNK], tokens[:, i:i + LOGIT_CHUNK],
                                             use_reentrant=False) if torch.is_grad_enabled()
           else chunk(h[:, i:i + LOGIT_CHUNK], tokens[:, i:i + LOGIT_CHUNK])
           for i in range(0, B * T, LOGIT_CHUNK)]
    return (torch.cat([lp for lp, _ in out], 1).view(B, T), torch.cat([e for _, e in out], 1).view(B, T), hidden)


class DrafterMonitor:
    """Acceptance collapse: a drafter's acceptance rate below `ratio` x its recent mean for `patience`
    steps in a row (e.g. a self-drafter that missed a weight sync keeps proposing the old policy's
    tokens). History drafters are noisy at T=1 on fresh prompts, hence the guards: >= `min_proposed`
    drafts in the step, >= 3 steps of history, a baseline of >= `min_mean`; collapsed steps do not
    enter the baseline. One warning per episode."""

    def __init__(self, window=5, ratio=0.25, min_proposed=64, min_mean=0.2, patience=2):
        self.window, self.ratio, self.min_proposed, self.min_mean, self.patience = window, ratio, min_proposed, min_mean, patience
        self.history: dict[str, list] = {}
        self.low: dict[str, int] = {}

    def update(self, metrics: dict) -> list[str]:
        alerts = []
        for key, rate in list(metrics.items()):
            name = key.split("/")[1] if key.startswith("drafter/") and key.endswith("/acceptance_rate") else None
            if name is None or metrics.get(f"drafter/{name}/proposed", 0) < self.min_proposed:
                continue
            hist = self.history.setdefault(name, [])
            mean = sum(hist) / len(hist) if hist else 0.0
            if len(hist) >= 3 and mean >= self.min_mean and rate < self.ratio * mean:
                self.low[name] = self.low.get(name, 0) + 1
                if self.low[name] == self.patience:
                    alerts.append(f"drafter {name!r}: acceptance collapsed to {rate:.3f} for {self.patience} steps "
                                  f"(recent mean {mean:.3f}); is it synced with the policy?")
            else:
                self.low[name] = 0
                self.history[name] = (hist + [rate])[-self.window:]
        return alerts


class LearningGuard:
    """One warning line when a run drifts the way small-model GRPO runs do (longer and longer responses,
    a falling eval), naming the metric; the run goes on and the user decides. Each alarm warns once per
    episode and re-arms when its metric recovers.
      - completions/clipped_ratio above `max_truncated`: most responses hit max_completion_length;
      - eval/reward_mean below its value before training by more than `noise_sems` standard errors of
        the difference (the two evals' per-prompt spreads, eval/reward_sem)."""

    def __init__(self, max_truncated: float = 0.5, noise_sems: float = 2.0):
        self.max_truncated, self.noise_sems, self.raised = max_truncated, noise_sems, set()

    def update(self, m: dict, before: dict | None) -> list[str]:
        alarms = {}
        cut = m.get("completions/clipped_ratio")
        if cut is not None:
            alarms["completions/clipped_ratio"] = cut > self.max_truncated and (
                f"completions/clipped_ratio = {cut:.2f}: over {self.max_truncated:.0%} of responses hit "
                f"max_completion_length at step {m['step']} (see grpo.overlong_buffer)")
        if before and "eval/reward_mean" in m and "eval/reward_mean" in before:
            a, b = m["eval/reward_mean"], before["eval/reward_mean"]
            noise = self.noise_sems * math.hypot(m.get("eval/reward_sem", 0.0), before.get("eval/reward_sem", 0.0))
            alarms["eval/reward_mean"] = a < b - noise and (
                f"eval/reward_mean = {a:.3f} at step {m['step']}: below its start {b:.3f} by more than "
                f"its noise ({noise:.3f}); the policy is getting worse")
        out = [msg for k, msg in alarms.items() if msg and k not in self.raised]
        self.raised = {k for k, msg in alarms.items() if msg} | (self.raised - alarms.keys())
        return out


def data_permutation(seed: int, epoch: int, n: int) -> list[int]:
    """The order of the n training prompts in `epoch`: a pure function of (seed, epoch), so a resumed run,
    and a peer trainer fed the same order (benchmarks/trl.py), see the same prompts at each step."""
    return torch.randperm(n, generator=torch.Generator().manual_seed(hash_seed(seed, "data", epoch))).tolist()


def _finite(v):
    return None if isinstance(v, float) and not math.isfinite(v) else v


def _mean_over_steps(recs: list[dict], key: str) -> float | None:
    """The mean of a metric over the run's steps (metrics.jsonl writes a non-finite value as null)."""
    xs = [r[key] for r in recs if isinstance(r.get(key), (int, float)) and not isinstance(r[key], bool)]
    return sum(xs) / len(xs) if xs else None


class Trainer:
    def __init__(self, cfg, log=print, model_dir=None):
        """Builds the policy, its engine and drafters, and trains nothing: the model is `model_dir` (the
        SFT warm-up's output, train.py's step before this one) or `model.path`."""
        self.cfg, g = cfg, cfg.grpo
        self.rank, self.world = dist.rank(), dist.world_size()
        validate_world(cfg, self.world)
        self.log = log if self.rank == 0 else (lambda *a, **k: None)
        self.run_dir = Path(cfg.run.out_dir)
        self.task = task_from_config(cfg.task)
        self.init_path = Path(model_dir) if model_dir is not None else self._model_dir()
        from transformers import AutoTokenizer
        self.tokenizer = AutoTokenizer.from_pretrained(str(self.init_path))
        dev = cfg.rollout.device
        self.policy = load_model(self.init_path, "float32", dev).train()
        self.sharded = cfg.run.sharding == "fsdp"
        if self.sharded:     # from here on its parameters are DTensor shards (rl/sharding.py)
            shard_policy(self.policy, cfg.run.activation_checkpointing)
        self.device = self.policy.lm_head.weight.device
        self.ref = load_model(self.init_path, "float32", dev).requires_grad_(False) if g.beta > 0 else None
        self.pool = self.task.train(cfg.task.num_train)
        self.test_set = self.task.test(cfg.task.num_test) if cfg.task.num_test else []
        # the longest sequence a rollout can make bounds the engine's length, and so its KV pool
        longest = longest_prompt(self.tokenizer, self.pool + self.test_set, self.policy.args.max_position_embeddings)
        max_len = longest + g.max_completion_length + 1
        r = cfg.rollout
        # the engine shares the policy's tensors where it can (module docstring), else holds its own copy
        shared = r.dtype == "float32" and not r.use_cuda_graphs and not g.max_staleness and not self.sharded
        self.llm = LLM(self.policy if shared else load_model(self.init_path, r.dtype, dev), self.tokenizer,
                       dtype=r.dtype, device=dev,
                       max_num_seqs=r.max_num_seqs, block_size=r.block_size, num_kv_blocks=r.num_kv_blocks,
                       max_model_len=max_len, max_num_batched_tokens=r.max_num_batched_tokens, speculative=r.speculative,
                       prefix_caching=r.prefix_caching, seed=cfg.run.seed + self.rank, use_cuda_graphs=r.use_cuda_graphs,
                       gpu_memory_utilization=r.gpu_memory_utilization, kv_cache_gib=r.kv_cache_gib,
                       controller=cfg.speculation)
        if self.llm.controller is not None and self.llm.controller.classes is not None:
            c = self.llm.controller.classes
            self.log(f"[policy] answer-length classes split at {', '.join(f'{t:g}' for t in c.thresholds)} "
                     f"tokens -> draft budgets {list(c.budgets)}")
        # off-policy: rollouts run in a thread, their closing gathers in a process group of their own
        self.ahead = ThreadPoolExecutor(1, "rollout") if g.max_staleness else None
        self.worker = RolloutWorker(self.llm, self.tokenizer, cfg, self.rank, self.world,
                                    dist.new_group() if g.max_staleness else None)
        self.version, self.pending, self._ahead = 0, None, None   # engine weights' policy version; the
                                                  # rollout made ahead (off-policy), and its future
        self._build_head()
        self.opt = torch.optim.AdamW(self.policy.parameters(), lr=g.learning_rate, weight_decay=g.weight_decay)
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, lambda s: min(1.0, (s + 1) / (g.warmup_steps + 1)))
        self.monitor, self.step, self.eval_before, self._perms = DrafterMonitor(), 0, None, {}
        self.guard = LearningGuard()
        if cfg.run.resume:
            self._resume()

    def _build_head(self) -> None:
        """A draft head learns online (drafters/head.py): the trainer's fp32 copy, synced into the engine's."""
        cfg = self.cfg
        self.head_drafter = find_drafter(self.llm.drafter, "head")
        self.head = self.head_opt = None
        self._head_batches = []        # (ids, hidden, mask) of this step's trainer forwards
        self._head_sums = [0.0, 0.0]   # positions, loss: gradients accumulated since the head's last step
        if self.head_drafter is None or cfg.speculation.head_training == "off":
            return
        self.head = self.head_drafter.head.twin(torch.float32).train()
        self.head_opt = torch.optim.AdamW(self.head.parameters(), lr=cfg.speculation.head_lr)
        if cfg.speculation.head_training == "bubble":
            if cfg.grpo.max_staleness:
                raise ValueError("speculation.head_training: 'bubble' trains in the rollout's idle time, which the "
                                 "off-policy pipeline (grpo.max_staleness 1) fills with learning: use 'step'")
            self.head_drafter.recording = True
            self.worker.bubble_train = self.head_bubble

    def _model_dir(self) -> Path:
        """model.path as a directory; one writer per node (local rank 0) converts a .gguf first (hub.py's
        temp dir + rename: two nodes on one filesystem do not collide), every rank raises its error."""
        if not self.cfg.model.path:
            raise ValueError("model.path: empty, and no model_dir given; the embedded default's model is the SFT "
                             "warm-up's (rl/sft.prepare_sft_model, train.py's step before the Trainer)")
        err = None
        if dist.local_rank() == 0:
            try:
                resolve_model(self.cfg.model.path, self.log)
            except Exception as e:
                err = e
        err = next((e for e in dist.all_gather_object(err) if e is not None), None)
        if err is not None:
            raise err
        return resolve_model(self.cfg.model.path, log=lambda *a: None)

    # ---- data: a pure function of (seed, step) -------------------------------------------------
    def problems(self, step: int) -> list:
        P, n, out = self.cfg.grpo.prompts_per_step, len(self.pool), []
        for i in range(step * P, (step + 1) * P):
            epoch, j = divmod(i, n)
            if epoch not in self._perms:
                self._perms = {e: p for e, p in self._perms.items() if e >= epoch - 1}
                self._perms[epoch] = data_permutation(self.cfg.run.seed, epoch, n)
            out.append(self.pool[self._perms[epoch][j]])
        return out

    def _reseed(self, step: int) -> None:
        """Engine RNG a function of (seed, step, rank): rollouts do not depend on the run's history."""
        self.llm.generator.manual_seed(hash_seed(self.cfg.run.seed, "rollout", step, self.rank))
        for i, d in enumerate(members(self.llm.drafter)):
            if getattr(d, "generator", None) is not None:
                d.generator.manual_seed(hash_seed(self.cfg.run.seed, "drafter", step, self.rank, i))

    # ---- one step ----------------------------------------------------------------------------
    def text(self, s: Sample) -> str:
        return self.tokenizer.decode(s.completion_ids, skip_special_tokens=True)

    def train_step(self) -> dict:
        """One GRPO step: 1. rollout -> 2-5. learn (rewards, advantages, loss and backward, optimizer)
        -> 6. weight sync -> 7. log. Around it: the rollout made ahead off-policy and the engine's sleep
        (`_rollout_for`, `_join_ahead`), the draft head's own step, the cross-rank record (`_step_metrics`)."""
        step, t0 = self.step, time.perf_counter()
        ro = self._rollout_for(step)                        # 1. G samples per prompt, with mu's logprobs
        t_learn = time.perf_counter()
        rec = self.learn(ro.samples)                        # 2-5.
        rec["state_gib"] = state_bytes(self.policy, self.opt) / 2**30     # with this step's gradients
        self.opt.zero_grad(set_to_none=True)     # no gradient memory held through the next rollout
        t_learned = time.perf_counter()
        t_joined = self._join_ahead()
        t_sync = self.sync_weights()                        # 6. the engine samples from the new policy
        head = self.train_head() if self.head is not None else {}
        self.version = step + 1
        m = self._step_metrics(ro, rec, head, t_learn, t_learned, t_joined, t_sync)    # 7.
        self.step += 1
        m["time_step"] = time.perf_counter() - t0
        return m

    def learn(self, samples: list[Sample]) -> dict:
        """Steps 2-5 of GRPO (DeepSeekMath, Shao et al. 2024, Algorithm 1; TRL's GRPOTrainer order) on
        this rank's samples (collective) -> this rank's record for the step's metrics."""
        g, t0 = self.cfg.grpo, time.perf_counter()
        # 2. rewards: the task's reward functions; DAPO's overlong penalty shapes what the advantages see
        rewards, correct, parts = self.score([s.problem for s in samples], [self.text(s) for s in samples],
                                             [s.completion_ids for s in samples])
        lengths = [len(s.completion_ids) for s in samples]
        shaped = shape_rewards(rewards, lengths, g)                                          # [N]
        # 3. advantages: each reward against its group of G (loss.group_advantages)
        adv = group_advantages(shaped, g.num_generations, g.scale_rewards)                   # [N]
        # truncated = stopped by max_completion_length. Their rewards and advantages stay in their
        # groups; with mask_truncated_completions (TRL's name, DAPO's overlong filtering) their tokens
        # leave the loss, so a response cut mid-thought is neither rewarded nor punished token by token
        truncated = torch.tensor([s.finish_reason == "length" for s in samples])
        mbs, loss_masks, n_seqs, n_toks, extra = self._micro_batches(samples, adv, truncated)
        kept, losses, norms = {}, [], []    # kept: what the first pass keeps (pi_old, pi_ref, stats)
        spent = dict(prepare=time.perf_counter() - t0, backward=0.0, optimizer=0.0)   # (tools.simulate)
        for _ in range(g.num_iterations):   # mu passes over the same rollout
            self.opt.zero_grad(set_to_none=True)
            t = time.perf_counter()
            # 4. loss and backward, micro-batch by micro-batch
            losses.append(self._loss_and_backward(mbs, loss_masks, n_seqs, n_toks, extra, kept))
            t_backward = time.perf_counter()
            norms.append(self._optimizer_step())            # 5. one optimizer step
            spent["backward"] += t_backward - t
            spent["optimizer"] += time.perf_counter() - t_backward
        return dict(rewards=rewards, correct=correct, lengths=lengths, truncated=truncated.tolist(),
                    adv_tokens=[float(a) * n for a, n in zip(adv.tolist(), lengths)],
                    parts={k: [x for x in v if x is not None] for k, v in parts.items()},
                    logps=self._logprob_triples(mbs, kept["old_lp"]), agg=dict(kept["agg"]),
                    entropy_sum=kept["entropy"], loss=sum(losses) / len(losses), grad_norm=norms[-1],
                    time=time.perf_counter() - t0, spent=spent)

    def _loss_and_backward(self, mbs, loss_masks, n_seqs: int, n_toks: int, extra: int, kept: dict) -> float:
        """One pass of GRPO's clipped surrogate (loss.policy_loss) over every micro-batch, gradients
        accumulated. The first pass keeps each micro-batch's pi_old (the trainer's logprobs before this
        step's updates), pi_ref, the hidden states for the draft head and the token entropy."""
        g, first = self.cfg.grpo, not kept
        if first:
            kept.update(old_lp=[], ref_lp=[], agg=defaultdict(float), entropy=0.0)
        loss_sum = 0.0
        for i, mb in enumerate(mbs):
            logp, ent, hidden = completion_logprobs(self.policy, mb, g.temperature)    # [B, T] each
            if first:
                kept["old_lp"].append(logp.detach())
                self._keep_for_head(mb, hidden)
                kept["entropy"] += float((ent * mb.mask).sum())
                with torch.no_grad():
                    kept["ref_lp"].append(completion_logprobs(self.ref, mb, g.temperature)[0]
                                          if self.ref is not None else None)
            # the ratio's pi_old: mu, the engine's logprobs; with TIS the trainer's own, and the weight
            # w = pi_old / mu (capped) corrects for sampling from mu (loss.tis_weights)
            w, st = None, {}
            if g.tis_cap is not None:
                w, st = tis_weights(kept["old_lp"][i], mb.behaviour_lp, loss_masks[i], g.tis_cap, g.tis_mode)
            old_lp = kept["old_lp"][i] if w is not None else mb.behaviour_lp
            loss, lst = policy_loss(logp, old_lp, mb.adv, loss_masks[i], epsilon=g.epsilon,
                                    epsilon_high=g.epsilon_high, beta=g.beta, ref_logp=kept["ref_lp"][i],
                                    loss_type=g.loss_type, num_seqs_global=n_seqs, num_tokens_global=n_toks,
                                    tis_weight=w)
            loss.backward()
            loss_sum += loss.item()
            nt = lst.pop("num_tokens")
            for k, v in {**lst, **st}.items():   # token-weighted sums, made global at the end
                kept["agg"][k] += v * nt
            kept["agg"]["_tokens"] += nt
        for _ in range(extra):    # zero-weighted: adds exact zeros to the gradient
            (completion_logprobs(self.policy, mbs[0], g.temperature)[0].sum() * 0.0).backward()
        return loss_sum

    @staticmethod
    def _logprob_triples(mbs, old_lp) -> list:
        """Per sequence (trainer, engine, drafted-and-verified) logprobs -> the global mismatch metrics."""
        return [(o[b, :n].tolist(), mb.behaviour_lp[b, :n].tolist(), mb.from_verify[b, :n].tolist())
                for mb, o in zip(mbs, old_lp) for b, n in enumerate(mb.mask.sum(1).long().tolist())]

    def _micro_batches(self, samples: list[Sample], adv: torch.Tensor, truncated: torch.Tensor):
        """-> (micro-batches, their loss masks, global sequence and token counts, the zero-weighted
        passes this rank adds: sharded, each forward/backward is a collective, so every rank runs as
        many as the busiest one)."""
        g, pad = self.cfg.grpo, self.tokenizer.pad_token_id or 0
        mbs, loss_masks = [], []
        for idx in micro_batches(samples, g.gradient_accumulation_steps):
            mbs.append(make_microbatch([samples[i] for i in idx], adv[idx], pad, self.device))
            keep = ~truncated[idx] if g.mask_truncated_completions else torch.ones(len(idx), dtype=torch.bool)
            loss_masks.append(mbs[-1].mask * keep.to(self.device)[:, None])
        counts = torch.tensor([len(samples), sum(float(m.sum()) for m in loss_masks)], dtype=torch.float64)
        n_seqs, n_toks = (int(x) for x in self._all_reduce(counts).tolist())
        n_toks = max(n_toks, 1)             # every response truncated and masked: a step of zero loss
        extra = int(self._all_reduce(torch.tensor([len(mbs)]), torch.distributed.ReduceOp.MAX)) - len(mbs) \
            if self.sharded else 0
        return mbs, loss_masks, n_seqs, n_toks, extra

    def score(self, problems, texts, completion_ids=None):
        """tasks.score on this rank's samples; a reward error on any rank stops every rank with its
        message (a rank that raised alone would leave the others waiting in the next collective)."""
        try:
            out, err = score(self.task, problems, texts, completion_ids), None
        except RewardError as e:
            out, err = None, str(e)
        errs = [e for e in dist.all_gather_object(err) if e]
        if errs:
            raise RewardError(errs[0])
        return out

    def _all_reduce(self, t: torch.Tensor, op=None) -> torch.Tensor:
        if self.world > 1:
            dev = self.device if torch.distributed.get_backend() == "nccl" else "cpu"
            t = t.to(dev)
            torch.distributed.all_reduce(t, op or torch.distributed.ReduceOp.SUM)
        return t.cpu()

    def _optimizer_step(self) -> float:
        params = list(self.policy.parameters())
        if not self.sharded:       # (sharded: FSDP reduce-scattered them in backward, also a SUM)
            all_reduce_grads(params)   # SUM over ranks: each rank's loss is already scaled by the global counts
        norm = clip_grad_norm_(params, self.cfg.grpo.max_grad_norm or math.inf)
        self.opt.step()
        self.sched.step()
        return float(norm)

    def _keep_for_head(self, mb: MicroBatch, hidden: torch.Tensor) -> None:
        """The trainer forward's hidden states [B, L, D] of a micro-batch, for the head's step (`step` mode)."""
        if self.head is None or self.cfg.speculation.head_training != "step":
            return
        prompt = (mb.pos[:, 0] + 1).tolist()
        ends = [p + int(n) for p, n in zip(prompt, mb.mask.sum(1).tolist())]
        self._head_batches.append((mb.ids, hidden.detach(), completion_mask(prompt, ends, mb.ids.shape[1])))

    def head_backward(self, batches) -> None:
        """Head gradients (sums over positions; train_head divides by the global count) of batches of
        (ids [B, L], hidden [B, L, D], mask [B, L-1])."""
        for ids, hidden, mask in batches:
            loss, n = head_loss(self.head, hidden, ids, mask)
            loss.backward()
            self._head_sums[0] += n
            self._head_sums[1] += float(loss.detach())

    def _head_sample(self, batches):
        """At most `speculation.head_positions` of this rank's positions: whole sequences in an order drawn
        with a generator of (seed, step, rank), up to the first that would pass the cap. The head's cost
        stays a small share of the step, and alike on every rank (its step ends in a collective)."""
        cap = self.cfg.speculation.head_positions
        counts = [(b, r, float(n)) for b, (_, _, m) in enumerate(batches) for r, n in enumerate(m.sum(1))]
        if sum(n for _, _, n in counts) <= cap:
            return batches
        g = torch.Generator().manual_seed(hash_seed(self.cfg.run.seed, "head", self.step, self.rank))
        rows, used = [[] for _ in batches], 0.0
        for i in torch.randperm(len(counts), generator=g).tolist():
            b, r, n = counts[i]
            if used + n > cap:
                break
            rows[b].append(r)
            used += n
        out = []
        for (ids, hidden, mask), picked in zip(batches, rows):
            if picked:
                keep = torch.tensor(sorted(picked))
                out.append((ids[keep.to(ids.device)], hidden[keep.to(hidden.device)], mask[keep]))
        return out

    def head_bubble(self, done, rows: int = 8) -> None:
        """A rank idle in its rollout's bubble (TLT, ASPLOS'26): head gradients from the hidden states its
        finished sequences left in the engine, `rows` sequences at a time, until every rank is done."""
        recs = self.head_drafter.take_finished()
        for i in range(0, len(recs), rows):
            if done():
                break
            part = recs[i:i + rows]
            L = max(len(ids) for ids, _, _ in part)
            ids = torch.tensor([t + [0] * (L - len(t)) for t, _, _ in part], device=self.device)
            hidden = torch.zeros(len(part), L, part[0][2].shape[-1], device=self.device)
            for b, (_, _, h) in enumerate(part):
                hidden[b, :len(h)] = h           # (a normal tensor: the engine's are inference tensors)
            mask = completion_mask([p for _, p, _ in part], [len(t) for t, _, _ in part], L)
            self.head_backward([(ids, hidden, mask.to(self.device))])

    def train_head(self) -> dict:
        """One AdamW step of the draft head on the gradients accumulated this step (collective): the
        trainer's hidden states (`step`), or what the ranks computed in their bubbles (`bubble`); then
        into the engine's head. Its teacher reads the engine's LM head, synced just before."""
        dist.barrier()      # the ranks arrive after their own wake-up and weight sync: a wait that is not the head's
        t0, batches, self._head_batches = time.perf_counter(), self._head_batches, []
        self.head_backward(self._head_sample(batches))
        n, loss = (float(x) for x in self._all_reduce(torch.tensor(self._head_sums, dtype=torch.float64)))
        self._head_sums = [0.0, 0.0]
        params = list(self.head.parameters())
        all_reduce_grads(params)
        if n > 0:
            for p in params:
                if p.grad is not None:
                    p.grad.div_(n)
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            self.head_opt.step()
        self.head_opt.zero_grad(set_to_none=True)
        self.head_drafter.load_head_state(self.head.state_dict())
        return {"head/loss": loss / max(n, 1.0), "head/positions": int(n), "head/time": time.perf_counter() - t0}

    def sync_weights(self) -> float:
        t0 = time.perf_counter()
        with torch.no_grad():
            self.llm.load_weights(full_weights(self.policy) if self.sharded else self.policy.state_dict())
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - t0

    def drafter_health(self, m: dict) -> None:
        d = find_drafter(self.llm.drafter, "self_nf4")
        if d is not None:
            ok = bool(d.checksum_matches(self.llm.model))
            m["drafter/self_nf4/checksum_ok"] = float(ok)
            if not ok:
                self._warn("drafter 'self_nf4': NF4 weights do not match the policy after weight sync (stale drafter)")
        for msg in self.monitor.update(m):
            self._warn(msg)

    def _warn(self, msg: str) -> None:
        if self.rank == 0:
            warnings.warn(msg, stacklevel=2)

    def rollout(self, step: int) -> Rollout:
        """Step `step`'s samples from the engine's weights as they are now (policy `self.version`)."""
        t0 = time.perf_counter()
        self._reseed(step)
        samples, m = self.worker.run(step, self.problems(step), self.problems(step + 1))
        return Rollout(samples, m, self.version, t0, time.perf_counter())

    def _rollout_for(self, step: int) -> Rollout:
        """Step `step`'s rollout: the one made ahead during the last step (off-policy), or now. Off-policy
        the next one starts in a thread at once; on-policy on CPU the engine sleeps while the policy learns."""
        ro, self.pending, self._ahead = self.pending or self.rollout(step), None, None
        if self.ahead is not None and step + 1 < self.cfg.grpo.num_steps:
            self._ahead = self.ahead.submit(self.rollout, step + 1)
        elif self.device.type == "cpu" or self.cfg.rollout.sleep_level == 2:
            self.llm.sleep(self.cfg.rollout.sleep_level)   # one host RAM: the KV pool's memory serves the backward
        return ro

    def _join_ahead(self) -> float:
        """Waits for the rollout made ahead (re-raising its error), wakes the engine; -> when it joined."""
        self.pending = self._ahead.result() if self._ahead is not None else None
        t_joined = time.perf_counter()
        self.llm.wake_up()     # (after level 2: weights allocated, filled by the sync)
        return t_joined

    def _step_metrics(self, ro: Rollout, rec: dict, head: dict, t_learn: float, t_learned: float,
                      t_joined: float, t_sync: float) -> dict:
        """The step's metrics.jsonl record: the rollout's, every rank's learn record merged, timings."""
        m, nxt = ro.metrics, self.pending
        overlap = max(0.0, min(nxt.end, t_learned) - max(nxt.start, t_learn)) if nxt is not None else 0.0
        m.update(staleness=self.step - ro.version, time_overlap=overlap, time_wait_rollout=t_joined - t_learned)
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20     # KiB on Linux -> GiB
        recs = dist.all_gather_object(dict(rec, rollout_time=ro.end - ro.start, peak_rss=rss))
        m.update(self._merge(recs), **head, step=self.step, time_weight_sync=t_sync, lr=self.sched.get_last_lr()[0],
                 rank_peak_rss_gib=[r["peak_rss"] for r in recs], rank_train_state_gib=[r["state_gib"] for r in recs],
                 rank_train_time=[r["time"] for r in recs], time_train=max(r["time"] for r in recs),
                 rank_rollout_time=[r["rollout_time"] for r in recs],
                 **{f"rank_time_{k}": [r["spent"][k] for r in recs] for k in recs[0]["spent"]})
        self.drafter_health(m)
        spec = self.cfg.rollout.speculative
        m["speculative"] = "+".join(s["method"] for s in (spec if isinstance(spec, list) else [spec])) if spec else None
        return m

    def _merge(self, recs: list[dict]) -> dict:
        G = self.cfg.grpo.num_generations
        rew = [x for r in recs for x in r["rewards"]]
        groups = [rew[i:i + G] for i in range(0, len(rew), G)]
        agg = defaultdict(float)
        for r in recs:
            for k, v in r["agg"].items():
                agg[k] += v
        out = {k: v / max(agg["_tokens"], 1) for k, v in agg.items() if k != "_tokens"}
        logps = [x for r in recs for x in r["logps"]]
        T = max(len(o) for o, _, _ in logps)
        pad = lambda rows, v: torch.tensor([row + [v] * (T - len(row)) for row in rows])
        mask = pad([[1.0] * len(o) for o, _, _ in logps], 0.0)
        out.update(logprob_mismatch(pad([o for o, _, _ in logps], 0.0), pad([r for _, r, _ in logps], 0.0), mask,
                                    pad([f for _, _, f in logps], False)))
        # reward stats over all ranks (the rollout worker's metrics already hold the response lengths)
        out.update(reward_mean=statistics.fmean(rew), reward_std=statistics.stdev(rew) if len(rew) > 1 else 0.0,
                   accuracy=statistics.fmean(float(c) for r in recs for c in r["correct"]),
                   frac_reward_zero_std=statistics.fmean(float(max(g) - min(g) < 1e-9) for g in groups),
                   loss=sum(r["loss"] for r in recs), grad_norm=recs[0]["grad_norm"], kl=out.get("kl"))
        out.update(self._length_metrics(recs))
        for name in recs[0]["parts"]:     # each reward function's mean where it applies (TRL: rewards/<name>/mean)
            vals = [x for r in recs for x in r["parts"][name]]
            out[f"reward/{name}"] = statistics.fmean(vals) if vals else None
        return out

    @staticmethod
    def _length_metrics(recs: list[dict]) -> dict:
        """What drives response length (TRL's names where it has them): the share of responses cut at
        max_completion_length, the mean length of those that ended, the token entropy of the sampling
        distribution, and the advantage mass on each kind: sum_i A_i |o_i| / sum_i |o_i| over the
        truncated and the terminated responses. Under the token-mean (dapo) loss a response's total
        push is A_i |o_i|, so a positive truncated mass means the update makes long responses likelier."""
        lengths = [n for r in recs for n in r["lengths"]]
        cut = [t for r in recs for t in r["truncated"]]
        mass = [a for r in recs for a in r["adv_tokens"]]
        tokens = max(sum(lengths), 1)
        ended = [n for n, t in zip(lengths, cut) if not t]
        return {"completions/clipped_ratio": statistics.fmean(map(float, cut)),
                "completions/mean_length": statistics.fmean(lengths),
                "completions/mean_terminated_length": statistics.fmean(ended) if ended else None,
                "entropy": sum(r["entropy_sum"] for r in recs) / tokens,
                "adv_mass/truncated": sum(m for m, t in zip(mass, cut) if t) / tokens,
                "adv_mass/terminated": sum(m for m, t in zip(mass, cut) if not t) / tokens}

    # ---- evaluation: plain AR (drafters and policy detached, their state untouched) ----
    EVAL_SAMPLES = 4    # draws per test prompt for eval/sampled_reward_mean

    def evaluate(self, samples: int = EVAL_SAMPLES) -> dict:
        """Greedy reward/accuracy, and the mean reward of `samples` draws per prompt at the training
        temperature (fixed seed): the objective GRPO actually climbs, which greedy can hide."""
        if not self.test_set:
            return {}
        mine, g = self.test_set[self.rank::self.world], self.cfg.grpo
        prompts = [self.worker.prompt_ids(p) for p in mine]     # the worker caches rendered prompts
        eos = self.tokenizer.eos_token_id
        params = dict(max_tokens=g.max_completion_length, stop_token_ids=[] if eos is None else [eos])
        greedy = self.llm.generate(prompts, SamplingParams(temperature=0.0, **params), use_tqdm=False,
                                   speculate=False)
        sampled = self.llm.generate(prompts, SamplingParams(temperature=g.temperature, top_p=g.top_p, top_k=g.top_k,
                                                            n=samples, seed=self.cfg.run.seed + self.rank, **params),
                                    use_tqdm=False, speculate=False)
        rewards, correct, _ = self.score(mine, [o.text for o in greedy], [o.token_ids for o in greedy])
        res = [x for r in dist.all_gather_object(list(zip(rewards, map(float, correct)))) for x in r]
        drawn = self.score([mine[i // samples] for i in range(len(sampled))], [o.text for o in sampled],
                           [o.token_ids for o in sampled])[0]
        drawn = [x for r in dist.all_gather_object(drawn) for x in r]
        greedy_rewards = [r for r, _ in res]
        return {"eval/reward_mean": statistics.fmean(greedy_rewards),
                "eval/reward_sem": statistics.stdev(greedy_rewards) / math.sqrt(len(res)) if len(res) > 1 else 0.0,
                "eval/accuracy": statistics.fmean(c for _, c in res), "eval/n": len(res),
                "eval/sampled_reward_mean": statistics.fmean(drawn)}

    # ---- checkpoints ---------------------------------------------------------------------------
    def save(self) -> Path:
        ts = {"step": self.step, "optimizer": None if self.sharded else self.opt.state_dict(),
              "scheduler": self.sched.state_dict(),
              "eval_before": self.eval_before, "monitor": vars(self.monitor), "config": config_to_dict(self.cfg),
              "head": None if self.head is None else {"model": self.head.state_dict(), "optimizer": self.head_opt.state_dict()}}
        rs = {"rng": rng_state(), "worker": self.worker.state_dict(), "engine": engine_state(self.llm),
              "pending": self.pending}     # off-policy: the rollout made ahead, not yet trained on
        return save_checkpoint(self.run_dir, self.step, self.whole_policy() if self.sharded else self.policy,
                               self.tokenizer, ts, rs, rank=self.rank, world_size=self.world, barrier=dist.barrier,
                               sharded=training_state(self.policy, self.opt) if self.sharded else None,
                               extras={"draft_head": self.head.save} if self.head is not None else None)

    def whole_policy(self):
        """Sharded: a model with the policy's whole weights for the HF export (read on rank 0). The
        engine's own copy when it is float32 (synced at the end of every step: no extra memory; after a
        level-2 sleep its layers live packed once it has run, so they are synced again), else one
        gathered on rank 0 (collective)."""
        if self.cfg.rollout.dtype == "float32":
            if self.cfg.rollout.sleep_level == 2:
                self.sync_weights()
            return self.llm.model
        whole = load_model(self.init_path, "float32", "cpu") if self.rank == 0 else None
        with torch.no_grad():
            for name, t in full_weights(self.policy).items():
                if whole is not None:
                    whole.get_parameter(name).copy_(t)
        return whole

    def _resume(self) -> None:
        ck = resume_point(self.run_dir, self.log, quarantine=self.rank == 0)
        if ck is None:
            self.log(f"[resume] no complete checkpoint in {self.run_dir}/checkpoints: starting at step 0")
            return
        ts, rs = load_checkpoint(ck, self.rank, self.world, verified=True, reshard=self.sharded)
        if self.sharded:     # weights and AdamW moments from dcp/, resharded to this world size
            load_training_state(self.policy, self.opt, lambda state: load_sharded(ck, state))
        else:
            with torch.no_grad():
                for name, t in load_model(ck, "float32", "cpu").state_dict().items():
                    self.policy.state_dict()[name].copy_(t)
            self.opt.load_state_dict(ts["optimizer"])
        self.sched.load_state_dict(ts["scheduler"])
        self.step, self.eval_before = ts["step"], ts["eval_before"]
        if self.head is not None and ts.get("head") is not None:
            self.head.load_state_dict(ts["head"]["model"])
            self.head_opt.load_state_dict(ts["head"]["optimizer"])
            self.head_drafter.load_head_state(self.head.state_dict())
        vars(self.monitor).update(ts["monitor"])
        if rs is None:       # another world size: per-rank state has no owner here
            if self.cfg.grpo.max_staleness:
                raise ValueError(f"{ck}: an off-policy run (grpo.max_staleness 1) resumes only at the world "
                                 f"size that wrote it: each rank's rollout made ahead is in its own file")
            n = json.loads((ck / MANIFEST).read_text())["world_size"]
            self.log(f"[resume] {ck.name} was written by {n} rank(s), this run has {self.world}: weights and "
                     f"AdamW state resharded by DCP (exact); per-rank state rebuilt, not merged: drafter "
                     f"caches, draft controller and length predictor start empty (rollout RNG is per step)")
            rs = {"pending": None}
        else:
            set_rng_state(rs["rng"])
            self.worker.load_state_dict(rs["worker"])
            load_engine_state(self.llm, rs["engine"])
        self.version, self.pending = self.step, rs.get("pending")
        self.sync_weights()
        self.log(f"[resume] {ck}: continuing at step {self.step}")

    # ---- the loop ------------------------------------------------------------------------------
    def train(self) -> dict:
        cfg, t0 = self.cfg, time.perf_counter()
        metrics_path = self.run_dir / "metrics.jsonl"
        if self.rank == 0:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            save_config(cfg, self.run_dir / "config.yaml")
            keep = [l for l in (metrics_path.read_text().splitlines() if metrics_path.exists() else [])
                    if l.strip() and json.loads(l)["step"] < self.step]   # a resumed run rewrites later steps
            metrics_path.write_text("".join(l + "\n" for l in keep))
            stale = [p for p in list_checkpoints(self.run_dir) if int(p.name[5:]) > self.step]
            if stale:   # a fresh run in an old run dir: old later checkpoints must not pass for ours
                self.log(f"[run] removing {len(stale)} checkpoint(s) of an earlier run in {self.run_dir} "
                         f"past step {self.step} (resume with --resume instead)")
                for p in stale:
                    shutil.rmtree(p)
        if self.eval_before is None:
            self.eval_before = self.evaluate()
            self.log(f"[eval] before: {self.eval_before}")
        bar = tqdm(total=cfg.grpo.num_steps, initial=self.step, desc="grpo", disable=self.rank != 0)
        tb = tensorboard_writer(self.run_dir, cfg.run.log_to) if self.rank == 0 else None
        m = {}
        with frozen_heap():            # no collector pass over the whole heap inside a rollout step
            while self.step < cfg.grpo.num_steps:
                try:
                    m = self.train_step()
                    last = self.step == cfg.grpo.num_steps
                    if last or (cfg.run.eval_every and self.step % cfg.run.eval_every == 0):
                        m.update(self.evaluate())
                except RewardError:
                    bar.close()         # the error's line goes below the bar, not onto it
                    raise
                if self.step == 1 and self.eval_before:   # the run's starting point, in its own record
                    m.update({k.replace("eval/", "eval_before/", 1): v for k, v in self.eval_before.items()})
                for msg in self.guard.update(m, self.eval_before):
                    self._warn(msg)
                if self.rank == 0:
                    with open(metrics_path, "a") as f:
                        f.write(json.dumps({k: _finite(v) for k, v in m.items()}) + "\n")
                    log_scalars(tb, m)
                bar.update(1)
                bar.set_postfix(reward=f"{m['reward_mean']:.3f}", tok_s=f"{m['tokens_per_s']:.0f}",
                                fwd_tok=f"{m['target_forwards_per_token']:.2f}", t_roll=f"{m['time_rollout']:.1f}s")
                if last or (cfg.run.save_every and self.step % cfg.run.save_every == 0):
                    self.save()
        bar.close()
        if tb is not None:
            tb.close()
        after = {k: v for k, v in m.items() if k.startswith("eval/")} or self.evaluate()
        return self.summary(after, time.perf_counter() - t0)

    def summary(self, after: dict, seconds: float) -> dict:
        path = self.run_dir / "metrics.jsonl"
        recs = [r for _, r in read_jsonl(path)] if self.rank == 0 and path.is_file() else []
        h = {name: _mean_over_steps(recs, key) for name, key in (("rollout time per step (s)", "time_rollout"),
             ("target forwards per token", "target_forwards_per_token"), ("mean accepted length", "mean_accepted_len"))}
        out = {"eval_before": self.eval_before, "eval_after": after, "seconds": seconds, **h}
        b, a = self.eval_before or {}, after or {}
        f = lambda v: "n/a" if v is None else f"{v:.4g}"
        self.log("\n".join([
            f"== nanospec GRPO: {self.cfg.grpo.num_steps} steps, {self.world} rank(s), {seconds:.0f}s ==",
            f"eval reward (greedy, {a.get('eval/n', 0)} test prompts): before {f(b.get('eval/reward_mean'))} -> "
            f"after {f(a.get('eval/reward_mean'))}   accuracy {f(b.get('eval/accuracy'))} -> {f(a.get('eval/accuracy'))}",
            f"eval reward (T={self.cfg.grpo.temperature}, {self.EVAL_SAMPLES} samples per prompt; what GRPO "
            f"maximises): before {f(b.get('eval/sampled_reward_mean'))} -> after {f(a.get('eval/sampled_reward_mean'))}",
            f"rollout time per step: {f(h.get('rollout time per step (s)'))}s   target forwards per token: "
            f"{f(h.get('target forwards per token'))}   mean accepted length: {f(h.get('mean accepted length'))}",
            f"report: python -m tools.report {self.run_dir}"]))
        return out
