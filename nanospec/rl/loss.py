"""GRPO objective: group advantages, clipped surrogate (+k3 KL), TIS correction, logprob mismatch.

Pure tensor math, no model or engine. Shapes: N = number of completions, G = group size,
B = completions in this micro-batch, T = completion length (right-padded), V = vocab.

References
- GRPO: Shao et al. 2024, "DeepSeekMath", eq. (3): per-sequence token mean, then mean over the group;
  advantage (4): A_i = (r_i - mean(r)) / std(r); KL (4): k3 = pi_ref/pi - log(pi_ref/pi) - 1.
- DAPO: Yu et al. 2025: decoupled clip (eps_low, eps_high) and a token-level mean over the batch.
- TRL GRPOTrainer (knob names epsilon, epsilon_high, beta, loss_type, scale_rewards): torch's default
  *unbiased* group std and `+ 1e-4` in the denominator; we follow both so numbers match TRL.
- TIS: Yao et al. 2025 ("off-policy RL from rollout/trainer mismatch"), verl / TRL
  `vllm_importance_sampling_*`: reweight by truncated pi_train / pi_rollout.

Gradient accumulation / data parallel contract (both loss types): the loss of a micro-batch is already
scaled so that the SUM over micro-batches and ranks equals the full-batch objective. The caller passes
the global denominators (all-reduced SUM over ranks of the step's counts):
    grpo: num_seqs_global   = total completions in the optimizer step (all micro-batches, all ranks)
    dapo: num_tokens_global = total mask.sum() in the optimizer step (all micro-batches, all ranks)
then calls `loss.backward()` on every micro-batch (grads accumulate = sum). Across W ranks the grads
must be SUMMED: with DDP (which averages grads over ranks) backprop `loss * W`; with a manual
all_reduce(SUM) of grads backprop `loss` as is. Then the step's gradient is exactly the full-batch one.
"""
import math

import torch
from torch import Tensor

from nanospec.config import LOSS_TYPES, TIS_MODES


def _check(name: str, t: Tensor, shape: tuple) -> None:
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name}: expected shape {tuple(shape)}, got {tuple(t.shape)}")


def group_advantages(rewards: Tensor, group_size: int, scale_rewards: bool = True, eps: float = 1e-4):
    """rewards [N] group-major (G consecutive samples per prompt) -> adv [N].

    A_i = r_i - mean_g(r)  [ / (std_g(r) + eps) if scale_rewards ], std unbiased (Bessel, as TRL's
    `.std(dim=1)`). A group whose rewards are all equal gets A = 0 either way: it carries no signal,
    which the trainer reports as `frac_reward_zero_std` (TRL's name).
    """
    if rewards.dim() != 1:
        raise ValueError(f"rewards: expected a 1-D tensor [N], got shape {tuple(rewards.shape)}")
    if group_size < 2 or rewards.numel() % group_size:
        raise ValueError(f"group_size: expected an integer >= 2 dividing N={rewards.numel()}, got {group_size}")
    r = rewards.float().view(-1, group_size)                   # [N/G, G]
    mean, std = r.mean(dim=1, keepdim=True), r.std(dim=1, keepdim=True)  # [N/G, 1]
    adv = r - mean
    if scale_rewards:
        adv = adv / (std + eps)
    return adv.view(-1)


def overlong_penalty(lengths: Tensor, max_len: int, buffer: int, factor: float = 1.0) -> Tensor:
    """lengths [N] -> reward shaping [N], DAPO's soft overlong punishment (eq. 13; verl's overlong_buffer).

    0 up to max_len - buffer tokens, then falling linearly to -factor at max_len: a response that ran
    to the cap is punished in full, one that ended just short of it a little. Unlike masking truncated
    responses out of the loss, it tells the policy which way is shorter.
    """
    over = (lengths.float() - (max_len - buffer)).clamp(min=0)                     # [N] tokens into the buffer
    return -factor * (over / buffer).clamp(max=1.0)


def policy_loss(logp: Tensor, old_logp: Tensor, adv: Tensor, mask: Tensor, *, epsilon: float = 0.2,
                epsilon_high: float | None = None, beta: float = 0.0, ref_logp: Tensor | None = None,
                loss_type: str = "grpo", num_seqs_global: int | None = None,
                num_tokens_global: int | None = None, tis_weight: Tensor | None = None):
    """Clipped GRPO/DAPO surrogate for one micro-batch -> (scalar loss, stats of floats).

    logp [B,T] (with grad), old_logp/ref_logp [B,T] (no grad), adv [B], mask [B,T] (1 = real token),
    tis_weight [B,T] (detached, from `tis_weights`). Per token (PPO clip, DAPO's decoupled range):
        rho = exp(logp - old_logp)
        l_t = -min(rho*A, clip(rho, 1-epsilon, 1+epsilon_high)*A) * tis_w + beta * k3_t
        k3_t = exp(ref - logp) - (ref - logp) - 1        (>= 0, unbiased for KL(pi || pi_ref))
    Reduction (see module docstring for the micro-batch contract):
        grpo: sum_i [ (1/|o_i|) sum_t l_it ] / num_seqs_global   (default B; empty rows count, add 0)
        dapo: sum_{i,t} l_it / num_tokens_global                  (required)
    """
    B, T = logp.shape
    eps_lo, eps_hi = _check_inputs(old_logp, adv, mask, ref_logp, tis_weight, (B, T), loss_type, epsilon,
                                   epsilon_high, beta)
    m = mask.bool()
    mf = m.to(logp.dtype)
    # zero the log-ratio on padding *before* exp: padded logps may be garbage and 0*inf = nan in backward
    ratio = torch.exp(torch.where(m, logp - old_logp.detach(), 0.0))           # [B,T]
    a = adv.detach().to(logp.dtype)[:, None]                                     # [B,1]
    clipped = ratio.clamp(1 - eps_lo, 1 + eps_hi)
    per_tok = -torch.minimum(ratio * a, clipped * a)                             # [B,T]
    if tis_weight is not None:
        per_tok = per_tok * tis_weight.detach().to(logp.dtype)
    kl = None
    if ref_logp is not None:
        d = torch.where(m, ref_logp.detach() - logp, 0.0)
        kl = torch.exp(d) - d - 1                                                # [B,T]
        if beta > 0:
            per_tok = per_tok + beta * kl
    per_tok = per_tok * mf
    n_tok = mf.sum(dim=1)                                                        # [B]
    if loss_type == "grpo":
        denom = B if num_seqs_global is None else num_seqs_global
        if denom <= 0:
            raise ValueError(f"num_seqs_global: expected a positive count, got {denom}")
        loss = (per_tok.sum(dim=1) / n_tok.clamp(min=1)).sum() / denom
    else:
        if num_tokens_global is None or num_tokens_global <= 0:
            raise ValueError(f"num_tokens_global: required positive global token count for dapo, got {num_tokens_global}")
        loss = per_tok.sum() / num_tokens_global
    return loss, _clip_stats(ratio, a, m, mf, kl, eps_lo, eps_hi)


def _check_inputs(old_logp, adv, mask, ref_logp, tis_weight, shape, loss_type: str, epsilon: float,
                  epsilon_high: float | None, beta: float) -> tuple[float, float]:
    """Shapes and ranges, each a ValueError naming the argument; -> (epsilon, epsilon_high)."""
    for name, t in (("old_logp", old_logp), ("mask", mask), ("ref_logp", ref_logp), ("tis_weight", tis_weight)):
        if t is not None:
            _check(name, t, shape)
    _check("adv", adv, shape[:1])
    if loss_type not in LOSS_TYPES:
        raise ValueError(f"loss_type: expected one of {LOSS_TYPES}, got {loss_type!r}")
    eps_lo, eps_hi = epsilon, (epsilon if epsilon_high is None else epsilon_high)
    if not (0 <= eps_lo < 1 and eps_hi >= 0):
        raise ValueError(f"epsilon/epsilon_high: expected 0 <= epsilon < 1, epsilon_high >= 0, got {eps_lo}, {eps_hi}")
    if beta < 0 or (beta > 0 and ref_logp is None):
        raise ValueError(f"beta: expected >= 0 and ref_logp given when beta > 0, got beta={beta}")
    return eps_lo, eps_hi


@torch.no_grad()
def _clip_stats(ratio, a, m, mf, kl, eps_lo: float, eps_hi: float) -> dict:
    """Local token means. The clipped branch is active (and has zero grad) when rho left the trust
    region on the side the advantage pushes towards: rho < 1-eps with A < 0, rho > 1+eps_hi with A > 0."""
    nt = mf.sum().clamp(min=1)
    lo = (ratio < 1 - eps_lo) & (a < 0) & m
    hi = (ratio > 1 + eps_hi) & (a > 0) & m
    stats = {"clip_frac": ((lo | hi).float().sum() / nt).item(), "clip_frac_low": (lo.float().sum() / nt).item(),
             "clip_frac_high": (hi.float().sum() / nt).item(), "ratio_mean": ((ratio * mf).sum() / nt).item(),
             "num_tokens": int(mf.sum().item())}
    if kl is not None:
        stats["kl"] = ((kl * mf).sum() / nt).item()
    return stats


def tis_weights(train_logp: Tensor, rollout_logp: Tensor, mask: Tensor, cap: float, mode: str = "truncate"):
    """Per-token truncated importance weights for rollout/trainer mismatch -> (w [B,T], stats).

    Tokens were sampled from pi_rollout (engine: bf16, other kernels, speculative verify) but the
    surrogate is an expectation under pi_old as the trainer computes it. Importance sampling fixes
    the expectation: E_{y~pi_rollout}[ (pi_old/pi_rollout)(y) f(y) ] = E_{y~pi_old}[f(y)]. Raw ratios
    have unbounded variance, so:
        truncate: w = min(rho, cap)                    (TIS; biased, bounded variance)
        mask:     w = 1{1/cap <= rho <= cap}          (drop tokens whose mismatch is too large)
    with rho = exp(train_logp - rollout_logp), train_logp = trainer's old logprobs (no grad).
    Padding gets w = 0. Stats: mean weight and the fraction truncated / masked, over real tokens.
    """
    _check("rollout_logp", rollout_logp, train_logp.shape)
    _check("mask", mask, train_logp.shape)
    if not cap >= 1:
        raise ValueError(f"cap: expected a number >= 1, got {cap}")
    if mode not in TIS_MODES:
        raise ValueError(f"mode: expected one of {TIS_MODES}, got {mode!r}")
    with torch.no_grad():
        m = mask.bool()
        mf = m.float()
        rho = torch.exp(torch.where(m, train_logp.float() - rollout_logp.float(), 0.0))
        if mode == "truncate":
            hit, w = rho > cap, rho.clamp(max=cap)
        else:
            hit = (rho < 1 / cap) | (rho > cap)
            w = (~hit).float()
        w = w * mf
        nt = mf.sum().clamp(min=1)
        key = "tis/frac_truncated" if mode == "truncate" else "tis/frac_masked"
        stats = {"tis/mean_weight": (w.sum() / nt).item(), key: ((hit & m).float().sum() / nt).item()}
    return w, stats


def logprob_mismatch(train_logp: Tensor, rollout_logp: Tensor, mask: Tensor,
                     from_verify: Tensor | None = None) -> dict:
    """How far the engine's logprobs are from the trainer's recompute (should be ~0 in fp32).

    Over real tokens, delta = train - rollout: mean |delta|, max |delta|, and the population std over
    sequences of sum_t delta (the sequence log importance ratio; 0 for a single sequence). With
    from_verify [B,T] bool, mean |delta| is split into tokens emitted by speculative verify steps vs
    plain decode steps -- the check that verify logprobs match decode logprobs. A split with no tokens
    reports nan; without from_verify the split keys are omitted.
    """
    _check("rollout_logp", rollout_logp, train_logp.shape)
    _check("mask", mask, train_logp.shape)
    with torch.no_grad():
        m = mask.bool()
        d = torch.where(m, train_logp.float() - rollout_logp.float(), 0.0)     # [B,T]
        ad = d.abs()
        n = int(m.sum())
        seq = d.sum(dim=1)[m.any(dim=1)]                                          # [B'] non-empty rows
        out = {"mismatch/mean_abs": ad.sum().item() / n if n else math.nan,
               "mismatch/max_abs": ad.max().item() if n else math.nan,
               "mismatch/seq_logratio_std": seq.std(correction=0).item() if seq.numel() else math.nan}
        if from_verify is not None:
            _check("from_verify", from_verify, train_logp.shape)
            for key, sel in (("verify", m & from_verify.bool()), ("decode", m & ~from_verify.bool())):
                k = int(sel.sum())
                out[f"mismatch/{key}_mean_abs"] = ad[sel].sum().item() / k if k else math.nan
    return out


def token_entropy(logits: Tensor, temperature: float = 1.0) -> Tensor:
    """Entropy of softmax(logits / T) at each position, in nats, no grad -> [B,T] (TRL's and verl's
    `entropy`): H = logsumexp(z) - sum_v softmax(z)_v z_v, z = logits / T. Falling towards 0 means the
    policy is collapsing onto one continuation; rising means it is spreading mass, e.g. onto rambling.
    Temperature 0 (greedy) is treated as 1, as in `sampler.token_logprobs`."""
    with torch.no_grad():
        z = logits.float() / (temperature or 1.0)
        return z.logsumexp(-1) - (torch.softmax(z, -1) * z).sum(-1)
