"""Exact speculative sampling for a whole batch in one call (no host sync inside).

Given the target's logits at the k+1 positions of each sequence's verify window and the k draft
tokens, decide how many drafts to keep and which token comes next, such that the emitted tokens are
distributed exactly as plain sampling from p (Leviathan et al. 2023, Thm. 1; Chen et al. 2023):

    for j = 1..k:   accept d_j with probability min(1, p_j(d_j) / q_j(d_j))
    first reject j: emit x ~ norm(max(0, p_j - q_j))          (the residual)
    all accepted:   emit a bonus x ~ p_{k+1}

A deterministic drafter (suffix tree, prior rollout, n-gram) is the special case q_j = onehot(d_j):
accept with prob p_j(d_j), and the residual is p_j with d_j removed, renormalised. Greedy rows
(T = 0) accept while d_j == argmax p_j and emit the argmax, so they are token-identical to greedy AR.
Rows with k_i = 0 drafts are plain sampling: the same call is the decode step of every sequence.

LOSSY (opt-in only): `lenient_q` replaces q_j(d_j) in the acceptance test (SPEC-RL's
min(1, l * p_new / p_old)) and a rejection resamples from p, which is no longer exact.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from . import sampler
from .sampler import SamplingTensors


def verify(logits: torch.Tensor, draft: torch.Tensor, num_draft: torch.Tensor, st: SamplingTensors,
           u_accept: torch.Tensor, u_final: torch.Tensor, q: torch.Tensor | None = None,
           lenient_q: torch.Tensor | None = None):
    """
    logits   [B, K+1, V]  target logits at positions len-1 .. len-1+K of each sequence
    draft    [B, K]       draft tokens (padding beyond num_draft[b] is ignored)
    num_draft[B]          k_b <= K
    u_accept [B, K], u_final [B]: uniforms in (0, 1] from each request's generator
    q        [B, K, V]    draft distributions (None: all drafts are point masses)
    returns  num_accepted [B], tokens [B, K+1] (emitted = tokens[b, :n_b + 1]), logprobs [B, K+1]
    """
    B, K1, V = logits.shape
    K = K1 - 1
    if st.all_greedy:
        return verify_greedy(logits, draft, num_draft, st)
    p = sampler.probs(logits, st)                                          # [B, K+1, V]
    rows = torch.arange(B, device=logits.device)
    if K > 0:
        p_d = p[:, :K].gather(-1, draft.unsqueeze(-1)).squeeze(-1)         # [B, K]  p_j(d_j)
        q_d = torch.ones_like(p_d) if q is None else q.gather(-1, draft.unsqueeze(-1)).squeeze(-1)
        # LOSSY positions carry p_old/l < 1; the drafter fills 1.0 where it has no p_old (exact there)
        lenient = lenient_q < 1 if lenient_q is not None else torch.zeros_like(p_d, dtype=torch.bool)
        if lenient_q is not None:
            q_d = torch.where(lenient, lenient_q, q_d)
        accept = u_accept * q_d <= p_d          # u <= p/q, no division; u in (0, 1]: p = 0 never passes
        greedy_ok = draft == logits[:, :K].argmax(-1)
        accept = torch.where(st.greedy.unsqueeze(-1), greedy_ok, accept)
        accept &= torch.arange(K, device=logits.device) < num_draft.unsqueeze(-1)
        n = accept.long().cumprod(-1).sum(-1)                              # [B] leading accepts
    else:
        n = torch.zeros(B, dtype=torch.long, device=logits.device)
    p_n = p[rows, n]                                                       # [B, V]
    rejected = n < num_draft
    if K > 0:
        j = n.clamp(max=K - 1)
        q_n = F.one_hot(draft[rows, j], V).to(p.dtype) if q is None else q[rows, j]
        residual = (p_n - q_n).clamp_(min=0)
        ok = rejected & (residual.sum(-1) > 0)     # sum 0 only if p == q, where rejection has prob 0
        ok &= ~lenient[rows, j]                    # LOSSY rule resamples from p after a rejection
        p_n = torch.where(ok.unsqueeze(-1), residual, p_n)
    final = sampler.sample(p_n, u_final)
    final = torch.where(st.greedy, logits[rows, n].argmax(-1), final)
    tokens = F.pad(draft, (0, 1))
    tokens[rows, n] = final
    logprobs = sampler.token_logprobs(logits, st.temperature, tokens)
    return n, tokens, logprobs


def verify_greedy(logits, draft, num_draft, st: SamplingTensors):
    """verify() when every row is greedy: accept while d_j == argmax, emit the argmax. The same
    tokens as the general path's greedy rows, without softmax / sort / inverse-CDF sampling."""
    B, K1, _ = logits.shape
    K = K1 - 1
    if K == 0:   # plain greedy decode: token = argmax, logprob = its logit - logsumexp (T = 0 -> T = 1)
        top_logit, top = logits.float().max(-1)                            # [B, 1]; first max, as argmax
        return torch.zeros(B, dtype=torch.long, device=logits.device), top, top_logit - logits.float().logsumexp(-1)
    top = logits.argmax(-1)                                                # [B, K+1]
    accept = (draft == top[:, :K]) & (torch.arange(K, device=logits.device) < num_draft.unsqueeze(-1))
    n = accept.long().cumprod(-1).sum(-1)                                  # [B] leading accepts
    rows = torch.arange(B, device=logits.device)
    tokens = F.pad(draft, (0, 1))
    tokens[rows, n] = top[rows, n]
    return n, tokens, sampler.token_logprobs(logits, st.temperature, tokens)
