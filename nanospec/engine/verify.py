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

from nanospec.engine import sampler
from nanospec.engine.sampler import SamplingTensors


def verify(logits: torch.Tensor, index: torch.Tensor, draft: torch.Tensor, num_draft: torch.Tensor,
           st: SamplingTensors, u_accept: torch.Tensor, u_final: torch.Tensor, q: torch.Tensor | None = None,
           lenient_q: torch.Tensor | None = None):
    """
    logits   [N, V]       target logits at the real positions len-1 .. len-1+k_b of each sequence, packed
    index    [B, K+1]     the logits row of (b, j): a ragged batch computes and normalises only its N
                          real positions, not B * (K+1) (index repeats a row's last one)
    draft    [B, K]       draft tokens (padding beyond num_draft[b] is ignored)
    num_draft[B]          k_b <= K
    u_accept [B, K], u_final [B]: uniforms in (0, 1] from each request's generator
    q        [B, K, V]    draft distributions (None: all drafts are point masses)
    returns  num_accepted [B], tokens [B, K+1] (emitted = tokens[b, :n_b + 1]), logprobs [B, K+1]
    """
    B, K = draft.shape
    dev = logits.device
    owner = torch.zeros(logits.shape[0], dtype=torch.long, device=dev).scatter_(
        0, index.flatten(), torch.arange(B, device=dev).repeat_interleave(K + 1))   # [N] its sequence
    st_n = st.rows(owner)
    # [N] greedy rows' tokens: max's indices are argmax's (first of ties), in a third of its time on CPU
    top = logits.max(-1).indices if st.any_greedy else None
    rows = torch.arange(B, device=dev)
    if st.all_greedy:
        # accept while d_j == argmax, emit the argmax: no softmax / sort / inverse-CDF sampling
        n = _leading(draft == top[index[:, :K]], num_draft)
        final = top[index[rows, n]]
    else:
        p = sampler.probs(logits, st_n)                                    # [N, V]
        p_d = p[index[:, :K], draft]                                       # [B, K]  p_j(d_j)
        q_d = torch.ones_like(p_d) if q is None else q.gather(-1, draft.unsqueeze(-1)).squeeze(-1)
        # LOSSY positions carry p_old/l < 1; the drafter fills 1.0 where it has no p_old (exact there)
        lenient = lenient_q < 1 if lenient_q is not None else torch.zeros_like(p_d, dtype=torch.bool)
        if lenient_q is not None:
            q_d = torch.where(lenient, lenient_q, q_d)
        accept = u_accept * q_d <= p_d          # u <= p/q, no division; u in (0, 1]: p = 0 never passes
        if st.any_greedy:
            accept = torch.where(st.greedy.unsqueeze(-1), draft == top[index[:, :K]], accept)
        n = _leading(accept, num_draft)                                    # [B] leading accepts
        p_n = p[index[rows, n]]                                            # [B, V]
        if K > 0:
            rejected = n < num_draft
            j = n.clamp(max=K - 1)
            if q is None:       # point mass: max(0, p - onehot(d_j)) is p with d_j zeroed
                residual = p_n.scatter(-1, draft[rows, j].unsqueeze(-1), 0.0)
            else:
                residual = (p_n - q[rows, j]).clamp_(min=0)
            ok = rejected & (residual.sum(-1) > 0)     # sum 0 only if p == q, where rejection has prob 0
            ok &= ~lenient[rows, j]                    # LOSSY rule resamples from p after a rejection
            p_n = torch.where(ok.unsqueeze(-1), residual, p_n)
        final = sampler.sample(p_n, u_final)
        if st.any_greedy:
            final = torch.where(st.greedy, top[index[rows, n]], final)
    tokens = F.pad(draft, (0, 1))
    tokens[rows, n] = final
    # reported logprobs: log_softmax(logits / T)[token], one logsumexp per real position (sampler.py)
    return n, tokens, sampler.token_logprobs(logits, tokens, st_n.temperature, rows=index)


def _leading(accept: torch.Tensor, num_draft: torch.Tensor) -> torch.Tensor:
    """[B, K] per-draft accept -> [B] number of leading accepts within each row's num_draft."""
    accept = accept & (torch.arange(accept.shape[1], device=accept.device) < num_draft.unsqueeze(-1))
    return accept.long().cumprod(-1).sum(-1)
