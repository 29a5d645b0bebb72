"""From logits to a token: temperature, top-k, top-p, and the logprob the trainer recomputes.

Two distributions exist per position, and they are deliberately different:
* the *sampling* distribution p = softmax(filter_top_k_top_p(logits / T)); this is what plain
  autoregressive decoding samples from, and what speculative verification must reproduce exactly;
* the *reported* logprob = log_softmax(logits / T)[token] over the full vocabulary, before top-k /
  top-p (T = 0, greedy, reports log_softmax(logits)). This is what the GRPO trainer recomputes from a
  plain forward, so rollout and trainer agree without knowing the filters (the logprob contract).

Randomness comes in as uniforms `u` drawn by the engine from each request's generator, so sampling is
a pure batched tensor function (inverse CDF), graph-capturable and reproducible per request seed.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from nanospec.engine.sequence import SamplingParams


SERIAL_SCAN_DEVICES = {"cpu"}   # cumsum is a serial loop there: monotone, bit for bit


@dataclass
class SamplingTensors:
    temperature: torch.Tensor   # [B] float, 0 = greedy
    top_k: torch.Tensor         # [B] long, vocab size when off
    top_p: torch.Tensor         # [B] float
    needs_filter: bool          # any row with top-k/top-p active (skips the sort otherwise)
    all_greedy: bool = False    # every row T = 0 (verify then needs argmax only)
    any_greedy: bool = False    # some row T = 0 (else verify needs no argmax)

    @classmethod
    def from_params(cls, params: list[SamplingParams], vocab_size: int, device) -> "SamplingTensors":
        return cls(
            temperature=torch.tensor([p.temperature for p in params], dtype=torch.float32, device=device),
            top_k=torch.tensor([p.top_k if p.top_k > 0 else vocab_size for p in params], device=device),
            top_p=torch.tensor([p.top_p for p in params], dtype=torch.float32, device=device),
            needs_filter=any(p.top_k > 0 or p.top_p < 1.0 for p in params),
            all_greedy=all(p.temperature == 0 for p in params), any_greedy=any(p.temperature == 0 for p in params))

    @property
    def greedy(self) -> torch.Tensor:
        return self.temperature == 0

    def rows(self, index: torch.Tensor) -> "SamplingTensors":
        """The settings of rows `index` ([N]): one entry per packed logits row (verify.verify)."""
        return SamplingTensors(self.temperature[index], self.top_k[index], self.top_p[index],
                               self.needs_filter, self.all_greedy, self.any_greedy)


def _per_row(t: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """[B] -> [B, 1, ..., 1], broadcastable against x [B, ..., V]."""
    return t.view(-1, *([1] * (x.dim() - 1)))


def scaled(logits: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    """logits [B, ..., V] / T with T broadcast from [B]; greedy rows (T=0) use T=1."""
    t = torch.where(temperature > 0, temperature, torch.ones_like(temperature))
    return logits / _per_row(t, logits)


def probs(logits: torch.Tensor, st: SamplingTensors) -> torch.Tensor:
    """The sampling distribution p. logits: [B, ..., V] -> the same shape (float32)."""
    x = scaled(logits.float(), st.temperature)
    if st.needs_filter:
        sorted_x, order = x.sort(dim=-1, descending=True, stable=True)
        rank = torch.arange(x.shape[-1], device=x.device)
        # top-k first, then top-p over the renormalised survivors (the HF / vLLM order)
        sorted_x = sorted_x.masked_fill(rank >= _per_row(st.top_k, x), float("-inf"))
        p_sorted = sorted_x.softmax(-1)
        head_mass = p_sorted.cumsum(-1) - p_sorted       # mass of the tokens ranked above this one
        drop = (head_mass >= _per_row(st.top_p, x)) & _per_row(st.top_p < 1, x)
        sorted_x = sorted_x.masked_fill(drop, float("-inf"))
        x = torch.empty_like(x).scatter_(-1, order, sorted_x)
    return x.softmax(-1)


def sample(p: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF sampling. p: [B, V] (need not be normalised), u: [B] in (0, 1] -> tokens [B]."""
    # A parallel scan (CUDA's cumsum) is not guaranteed monotone in floating point, so a token with
    # p = 0 (e.g. the rejected draft in a residual) could own a sliver of the CDF. Zeroing those
    # positions and taking the running max gives them an empty interval. CPU's scan is serial, so
    # there cdf[i] == cdf[i-1] already when p[i] = 0, and the (serial, slow) cummax is skipped.
    cdf = p.cumsum(-1)
    if cdf.device.type not in SERIAL_SCAN_DEVICES:
        cdf = cdf.masked_fill_(p <= 0, 0).cummax(-1).values
    idx = torch.searchsorted(cdf, (u * cdf[:, -1]).unsqueeze(-1)).squeeze(-1)
    return idx.clamp_(max=p.shape[-1] - 1)


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, temperature: torch.Tensor | float,
                   rows: torch.Tensor | None = None) -> torch.Tensor:
    """log_softmax(logits / T)[tokens] over the full vocabulary, before top-k/top-p: the logprobs the
    engine reports with each token (verify.py) and the trainer recomputes (rl/grpo.py), one function so
    the two cannot drift apart. logits [B, ..., V], tokens [B, ...]; temperature [B] or one float (0,
    greedy, is treated as 1); rows [B, Q]: logits [N, V] holds only the rows these index (the verify's
    kept positions) -> [B, Q]. Differentiable w.r.t. logits; float32 whatever their dtype."""
    if not torch.is_tensor(temperature):
        if temperature < 0:
            raise ValueError(f"temperature: expected >= 0, got {temperature}")
        temperature = torch.full((logits.shape[0],), float(temperature), device=logits.device)
    x = scaled(logits.float(), temperature)
    if rows is None:
        return x.gather(-1, tokens.unsqueeze(-1)).squeeze(-1) - x.logsumexp(-1)
    return x[rows, tokens] - x.logsumexp(-1)[rows]
