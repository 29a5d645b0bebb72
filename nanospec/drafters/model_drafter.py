"""Drafters that run a model: the 4-bit self-drafter (EfficientRollout) and a small draft model.

Both own a second `Runner` over the *target's* block tables (same slots, their own cache tensor), so
they need no block bookkeeping of their own. Invariant: drafter KV is valid for positions
< seq.num_draft_computed; the engine clamps it to the target's num_computed after each verify (the
rejected drafts' KV is simply overwritten later) and preemption resets it to 0.

propose() for a sequence of length L with budget k:
    forward token_ids[num_draft_computed:]   (1 token; 2 when every draft was accepted, since d_k and
                                              the bonus were never fed; the whole tail after a recompute
                                              or when another chain member drafted last time)
    -> q_1, sample d_1; then k-1 one-token forwards d_j -> q_{j+1}, sample d_{j+1}.
The cache then holds positions < L + k - 1 (d_k is never fed). q_j = sampler.probs(...) is the target's
own temperature/top-k/top-p processing, and d_j is drawn (inverse CDF, the drafter's own generator) from
exactly that tensor: verify's min(1, p/q) test is exact only if q is the distribution really sampled.

Self-drafter: a structural copy of the policy whose decoder-layer Linears are bitsandbytes NF4
`Linear4bit`; embeddings, norms, biases and lm_head are the policy's own Parameters (shared storage:
a weight sync updates them for free). refresh() re-quantizes into the existing 4-bit buffers.
bitsandbytes 0.50.2 on CPU needs three choices, each checked in tests/test_model_drafters.py:
 * blocksize 64 (or 32) must divide in_features: quantize_4bit blocks the flattened weight, but the
   CPU dequantize kernel assumes blocks never straddle rows and returns wrong weights otherwise (a
   layer where neither does stays in full precision, with a warning naming it);
 * compress_statistics=False: absmax stays a plain fp32 [blocks] tensor, copyable in place and
   exactly comparable (double quantization would nest an 8-bit absmax with its own state);
 * support_avx512bf16_for_cpu=False: otherwise the first forward repacks the weight into a bf16-scale
   layout (new storage, out_features % 32 required), which refresh could no longer write into.
On CPU NF4 is a correctness path (dequantize + matmul per layer), not a speed path (docs/results.md, spec bench).
"""
from __future__ import annotations

import copy
import warnings
from pathlib import Path

import torch
from torch import nn

from nanospec.engine import sampler
from nanospec.models.loader import load_model
from nanospec.engine.runner import Runner
from nanospec.engine.sampler import SamplingTensors
from nanospec.engine.sequence import Sequence
from nanospec.drafters.base import Drafter, DraftTarget, Proposal

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


class ModelDrafter(Drafter):
    stochastic = True
    needs_kv = True

    def __init__(self, name: str, model: nn.Module, target: DraftTarget, seed: int = 0,
                 quantized: dict | None = None, runner: Runner | None = None):
        self.name, self.model, self.vocab_size = name, model, target.vocab_size
        self.runner = runner or Runner(model, target.num_blocks, target.block_size)
        self.device = self.runner.device
        self.generator = torch.Generator().manual_seed(seed)   # draft sampling only, not verify's uniforms
        self.quantized = quantized or {}                       # policy module name -> its Linear4bit

    @torch.inference_mode()
    def prefill(self, seqs: list[Sequence], tokens: list[list[int]], starts: list[int], hidden=None) -> None:
        self.runner.forward(seqs, tokens, starts)
        for s, t, a in zip(seqs, tokens, starts):
            s.num_draft_computed = a + len(t)

    @torch.inference_mode()
    def propose(self, seqs: list[Sequence], num_tokens: list[int]) -> Proposal:
        B, K, V, dev = len(seqs), max(num_tokens, default=0), self.vocab_size, self.device
        drafts: list[list[int]] = [[] for _ in seqs]
        q = torch.zeros(B, K, V, dtype=torch.float32, device=dev)                # [B, K, V]
        rows = [i for i in range(B) if num_tokens[i] > 0]
        for i in rows:   # always feed >= 1 token: the last token's logits give d_1
            seqs[i].num_draft_computed = min(seqs[i].num_draft_computed, len(seqs[i]) - 1)
        feed = [seqs[i].token_ids[seqs[i].num_draft_computed:] for i in rows]
        for j in range(K):   # rows whose budget is spent drop out; rows stays non-empty while j < K
            sub = [seqs[i] for i in rows]
            hidden = self.runner.forward(sub, feed, [s.num_draft_computed for s in sub])   # [b, Q, D]
            last = torch.tensor([len(f) - 1 for f in feed], device=dev)
            p, tok = self.draw(sub, self.model.logits(hidden[torch.arange(len(sub), device=dev), last]))
            q[torch.tensor(rows, device=dev), j] = p   # greedy rows: verify ignores q
            for s, f, i, t in zip(sub, feed, rows, tok.tolist()):
                s.num_draft_computed += len(f)
                drafts[i].append(t)
            rows = [i for i in rows if num_tokens[i] > j + 1]
            feed = [[drafts[i][-1]] for i in rows]
        return Proposal(drafts, q, [self.name] * B)

    def draw(self, seqs: list[Sequence], logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """logits [b, V] -> (q [b, V], the rows' own temperature/top-k/top-p distribution; d ~ q [b], the
        argmax on greedy rows), from the drafter's generator (not verify's uniforms)."""
        st = SamplingTensors.from_params([s.params for s in seqs], self.vocab_size, self.device)
        q = sampler.probs(logits.unsqueeze(1), st).squeeze(1)
        u = (1.0 - torch.rand(len(seqs), generator=self.generator)).to(self.device)        # (0, 1]
        d = sampler.sample(q, u)
        return q, torch.where(st.greedy, logits.max(-1).indices, d) if st.any_greedy else d   # argmax (verify.py)

    @torch.no_grad()
    def refresh(self, model: nn.Module) -> None:
        """Re-quantize every Linear4bit from `model`'s current weights, into the same buffers."""
        for name, lin in self.quantized.items():
            w4, qs = _quantize(model.get_submodule(name).weight, lin.weight.blocksize)
            lin.weight.data.copy_(w4)
            lin.weight.quant_state.absmax.copy_(qs.absmax)

    @torch.no_grad()
    def checksum_matches(self, model: nn.Module, rows: int = 16) -> bool:
        """Is this drafter the NF4 quantization of `model`'s current weights? (drafter health)

        For `rows` evenly spaced rows of every quantized layer: each block's stored fp32 absmax equals
        the policy's block absmax exactly, and each dequantized weight is within half the widest NF4
        code gap (x absmax, + dtype rounding) of the policy's weight. Any optimizer step moves the
        absmax; a stale or corrupted drafter fails one of the two."""
        import bitsandbytes.functional as bF
        half_gap = float(bF.get_4bit_type("nf4", device="cpu").diff().max()) / 2 + 1e-2
        for name, lin in self.quantized.items():
            w = model.get_submodule(name).weight                                   # [N, K]
            (N, K), bs = w.shape, lin.weight.blocksize
            r = torch.linspace(0, N - 1, min(rows, N), device=w.device).long()
            packed = lin.weight.data.view(torch.uint8).view(N, K // 2)[r]          # blocks are row-aligned
            absmax = lin.weight.quant_state.absmax.view(N, K // bs)[r]             # [r, K/bs]
            dq = torch.ops.bitsandbytes.dequantize_4bit.default(packed.reshape(-1, 1), absmax.reshape(-1), bs,
                                                                "nf4", (len(r), K), torch.float32)
            ref = w[r].float().view(len(r), K // bs, bs)
            if not torch.equal(absmax, ref.abs().amax(-1)):
                return False
            if ((dq.view_as(ref) - ref).abs() > absmax[..., None] * half_gap).any():
                return False
        return True


def _quantize(w: torch.Tensor, blocksize: int):
    import bitsandbytes.functional as bF
    return bF.quantize_4bit(w.detach().contiguous(), blocksize=blocksize, compress_statistics=False,
                            quant_type="nf4")


def _linear4bit(lin: nn.Linear) -> nn.Module | None:
    """The NF4 copy of `lin`, or None where no block size divides its in_features (see the docstring)."""
    from bitsandbytes.nn import Linear4bit, Params4bit
    N, K = lin.weight.shape
    bs = next((b for b in (64, 32) if K % b == 0), None)
    if bs is None:
        return None
    q = Linear4bit(K, N, bias=lin.bias is not None, compute_dtype=lin.weight.dtype,
                   compress_statistics=False, quant_type="nf4", device="meta")
    w4, qs = _quantize(lin.weight, bs)
    q.weight = Params4bit(w4, requires_grad=False, quant_state=qs, blocksize=bs, compress_statistics=False,
                          quant_type="nf4", module=q, bnb_quantized=True)
    q.quant_state, q.bias = qs, lin.bias          # bias: the policy's own Parameter (shared)
    q.support_avx512bf16_for_cpu = False           # keep the canonical layout (see module docstring)
    return q


def quantize_policy(policy: nn.Module) -> tuple[nn.Module, dict[str, nn.Module]]:
    """-> (NF4 copy of `policy` sharing all non-quantized Parameters, {module name: Linear4bit}).

    deepcopy with every Parameter pre-seeded in the memo copies the module tree but no weights. A layer
    no block size fits stays the policy's own (shared) Linear, as the module docstring says."""
    model = copy.deepcopy(policy, memo={id(p): p for p in policy.parameters()})
    quantized, kept = {}, []
    for name, mod in list(model.named_modules()):
        if isinstance(mod, nn.Linear) and name.startswith("model.layers."):
            q = _linear4bit(mod)
            if q is None:
                kept.append(f"{name} (in_features {mod.in_features})")
                continue
            parent, attr = name.rsplit(".", 1)
            quantized[name] = q
            setattr(model.get_submodule(parent), attr, q)
    if kept:
        warnings.warn(f"speculative[self_nf4]: {len(kept)} of {len(kept) + len(quantized)} layers stay in full "
                      f"precision (bitsandbytes' CPU NF4 kernel needs in_features % 32 == 0): {', '.join(kept)}")
    return model.eval(), quantized


def self_nf4_drafter(target: DraftTarget, seed: int = 0) -> ModelDrafter:
    """{"method": "self_nf4"}: an NF4 copy of the policy, re-quantized after every weight sync."""
    model, quantized = quantize_policy(target.model)
    return ModelDrafter("self_nf4", model, target, seed, quantized)


def draft_model_drafter(target: DraftTarget, model: str, seed: int = 0) -> ModelDrafter:
    """{"method": "draft_model", "model": DIR}: a small model in the target's dtype and device; it must
    speak the target's vocabulary (same size and, where DIR has a tokenizer, the same tokens)."""
    draft = load_model(model, dtype=next(target.model.parameters()).dtype, device=target.device)
    if draft.args.vocab_size != target.vocab_size:
        raise ValueError(f"speculative[draft_model]: draft model {model} has vocab_size {draft.args.vocab_size} "
                         f"but target {target.name} has {target.vocab_size}; the two must share one vocabulary")
    if target.tokenizer is not None and any((Path(model) / f).is_file() for f in TOKENIZER_FILES):
        from transformers import AutoTokenizer
        dv, tv = AutoTokenizer.from_pretrained(str(model)).get_vocab(), target.tokenizer.get_vocab()
        if dv != tv:
            diff = sorted(set(dv.items()) ^ set(tv.items()), key=str)[:4]
            raise ValueError(f"speculative[draft_model]: tokenizer of draft model {model} differs from the "
                             f"target's ({target.name}): {len(dv)} vs {len(tv)} entries, e.g. (token, id) {diff} "
                             "are in only one of them")
    return ModelDrafter("draft_model", draft, target, seed)
