"""A learned draft head on the policy's own hidden states: EAGLE's drafter, trained online.

Li et al. 2024, EAGLE (arXiv:2401.15077): drafting is easier one level down, on features. The target's
last hidden state h_i (after its final norm: what its LM head reads) already knows much of x_{i+2};
one decoder layer over [h_i ; emb(x_{i+1})] predicts it. Medusa (Cai et al. 2024) and DeepSeek-V3's
MTP modules are the same idea with other inputs; EAGLE-3 (arXiv:2503.01840) adds a reduced draft
vocabulary and training on the head's own outputs ("training-time test"), both used here, small.

    head position i:  z_i = fc([h_i ; emb(x_{i+1})])            [D]  h_i: the target's (or the head's own g_{i-1})
                      g_i = norm(layer(z_0 .. z_i))             [D]  one decoder layer, causal over head positions,
                                                                     with its own KV cache over the target's blocks
                      q(x_{i+2}) = softmax(lm_head(g_i) / T)         the target's own LM head (its draft-vocab rows)

Drafting after a sequence of length L (the target's h is known for positions < L-1):
    catch-up  head positions num_draft_computed .. L-2, from the hidden states the engine handed over
              (`observe_hidden`: the positions each verify accepted; `prefill`: the prompt) -> g_{L-2}: q_1
    then      head position L-2+j over (g_{L-3+j}, d_j) -> q_{j+1}, for j = 1 .. k-1
Only catch-up positions stay (num_draft_computed = L-1): drafted ones used the head's own features and
are overwritten once the target's are known. Exact like every model drafter: d_j ~ q_j, and that q_j
goes to verify (engine/verify.py); the draft vocabulary only puts q = 0 outside it.

Training (`head_loss`) on the target's hidden states of whole sequences (the GRPO trainer's own
forward over the rollout, rl/grpo.py): the teacher is the target's next-token distribution at the
same position (forward KL over the draft vocabulary) plus EAGLE's feature regression g_i ~ h_{i+1}
(smooth L1). A second, unrolled pass feeds the head its own g_{i-1} in place of h_i, as drafting
does from its second token on.
"""
from __future__ import annotations

import json
import warnings
from dataclasses import replace
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn

from nanospec.drafters.base import DraftTarget, Proposal
from nanospec.drafters.model_drafter import ModelDrafter
from nanospec.engine.sequence import Sequence
from nanospec.models.decoder import CausalLM, DecoderLayer, RMSNorm

SHAPE_KEYS = ("arch", "vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim")
REG_WEIGHT = 0.1     # feature regression beside the KL (EAGLE weighs its two losses 1 : 0.1 the other way)
UNROLL = 3           # passes: the first on the target's features, the rest on the head's own (EAGLE-3's training-time test)


class DraftHead(CausalLM):
    """fc + one decoder layer + norm, reading the target's embedding and LM head (not its parameters:
    they stay the policy's, and the head's optimizer never sees them)."""

    def __init__(self, target: CausalLM, draft_vocab: torch.Tensor | None = None):
        nn.Module.__init__(self)
        a = self.args = replace(target.args, num_layers=1)
        self.fc = nn.Linear(2 * a.hidden_size, a.hidden_size, bias=True)
        self.model = nn.Module()
        self.model.layers = nn.ModuleList([DecoderLayer(a, 0)])
        self.model.norm = RMSNorm(a.hidden_size, a.rms_norm_eps)
        self.register_buffer("vocab", draft_vocab)             # [Vd] token ids, or None: the whole vocabulary
        self.__dict__["target"] = target                       # not a submodule (see the class docstring)
        self.to(target.lm_head.weight.device)

    def embed(self, ids, features=None):
        """z = fc([h ; emb(x)]); features None (profiling the head's cost) stands for zeros."""
        with torch.no_grad():   # the target's embedding is the policy's: no gradient (the trainer may share it)
            e = self.target.model.embed_tokens(ids).to(self.fc.weight.dtype)             # [N, D]
        h = torch.zeros_like(e) if features is None else features.to(e.dtype)
        return self.fc(torch.cat([h, e], -1))

    def draft_weight(self) -> torch.Tensor:
        """The target LM head's rows of the draft vocabulary [Vd, D], gathered once per weight version."""
        w = self.target.lm_head.weight.detach()     # the policy's: the head's loss never moves it
        if self.vocab is None:
            return w
        key = (w.data_ptr(), w._version if not w.is_inference() else 0)
        cached = self.__dict__.get("_draft_w")
        if cached is None or cached[0] != key:
            with torch.no_grad():
                cached = self.__dict__["_draft_w"] = (key, w.index_select(0, self.vocab).to(self.fc.weight.dtype))
        return cached[1]

    def draft_logits(self, hidden) -> torch.Tensor:
        """[..., D] -> [..., Vd] logits over the draft vocabulary (float32)."""
        return F.linear(hidden, self.draft_weight().to(hidden.dtype)).float()

    def logits(self, hidden) -> torch.Tensor:
        """[..., D] -> [..., V]: -inf outside the draft vocabulary, so q there is exactly 0."""
        out = self.draft_logits(hidden)
        if self.vocab is None:
            return out
        full = out.new_full((*out.shape[:-1], self.args.vocab_size), float("-inf"))
        return full.index_copy_(-1, self.vocab, out)

    def twin(self, dtype=None) -> "DraftHead":
        """A copy of the head's own weights over the same target (deepcopy would copy the target too)."""
        other = DraftHead(self.target, self.vocab).to(dtype or self.fc.weight.dtype)
        other.load_state_dict(self.state_dict())
        return other

    # ---- files: an HF-style directory (config.json + model.safetensors) beside the policy's ----
    def save(self, path) -> None:
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        state = {k: v.detach().to("cpu", torch.float32 if v.is_floating_point() else v.dtype).contiguous()
                 for k, v in self.state_dict().items()}
        save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
        cfg = {"architectures": ["NanospecDraftHead"], "model_type": "draft_head", "num_hidden_layers": 1,
               "draft_vocab_size": None if self.vocab is None else len(self.vocab),
               "target": {k: getattr(self.target.args, k) for k in SHAPE_KEYS}, "reference": "EAGLE, arXiv:2401.15077"}
        (path / "config.json").write_text(json.dumps(cfg, indent=2))


def load_head(path, target: CausalLM, where: str = "speculative[head].model") -> DraftHead:
    """A saved head for `target`, or one clear ValueError naming what does not match."""
    path = Path(path)
    if not (path / "config.json").is_file() or not (path / "model.safetensors").is_file():
        raise FileNotFoundError(f"{where}: {path} is not a draft head directory (config.json + model.safetensors)")
    cfg = json.loads((path / "config.json").read_text())
    if cfg.get("model_type") != "draft_head":
        raise ValueError(f"{where}: {path}/config.json has model_type {cfg.get('model_type')!r}, expected 'draft_head'")
    theirs = cfg.get("target", {})
    for k in ("hidden_size",) + tuple(k for k in SHAPE_KEYS if k != "hidden_size"):
        if theirs.get(k) != getattr(target.args, k):
            raise ValueError(f"{where}: {path} is a head for another model: its {k} is {theirs.get(k)!r}, "
                             f"the model's is {getattr(target.args, k)!r}")
    state = load_file(str(path / "model.safetensors"))
    head = DraftHead(target, state.get("vocab"))
    head.load_state_dict(state)
    return head


def check_draft_vocab(draft_vocab, vocab_size: int) -> None:
    if draft_vocab is not None and not (isinstance(draft_vocab, int) and 1 <= draft_vocab <= vocab_size):
        raise ValueError(f"speculative[head].draft_vocab: expected null or an int in [1, {vocab_size}] "
                         f"(the model's vocabulary), got {draft_vocab!r}")


def frequent_tokens(sequences: list[list[int]], n: int, always=()) -> torch.Tensor:
    """The draft vocabulary: the n most frequent ids of `sequences` (and `always`, e.g. eos), sorted."""
    counts = torch.bincount(torch.tensor([t for s in sequences for t in s]))
    ids = counts.argsort(descending=True, stable=True)[:n].tolist()
    ids = list(dict.fromkeys([*always, *ids]))[:max(n, len(always))]
    return torch.tensor(sorted(ids))


# ---- training ---------------------------------------------------------------------------------------
def head_loss(head: DraftHead, hidden: torch.Tensor, ids: torch.Tensor, mask: torch.Tensor,
              unroll: int | None = None) -> tuple[torch.Tensor, int]:
    """hidden [B, L, D] (the target's, detached), ids [B, L], mask [B, L-1]: 1 where head position i
    (input h_i, x_{i+1}; predicting x_{i+2} and h_{i+1}) counts. -> (sum of the loss, positions)."""
    h_in, h_next = hidden[:, :-1].float(), hidden[:, 1:].float()                  # [B, L-1, D]
    sel = mask.bool().to(hidden.device)     # the LM head runs on the counted positions only (the rest: context)
    with torch.no_grad():
        teacher = head.draft_logits(h_next[sel]).log_softmax(-1)                # [n, Vd]  log p
        p = teacher.exp()
    total, unroll = 0.0, unroll or UNROLL
    features = h_in
    for _ in range(unroll):
        g = head(ids[:, 1:], features=features.reshape(-1, features.shape[-1]))   # [B, L-1, D]
        logq = head.draft_logits(g[sel]).log_softmax(-1)                          # [n, Vd]
        kl = (p * (teacher - logq)).sum(-1)                                       # [n]
        reg = F.smooth_l1_loss(g[sel], h_next[sel], reduction="none").mean(-1)
        total = total + (kl + REG_WEIGHT * reg).sum()
        features = torch.cat([h_in[:, :1], g[:, :-1]], 1)     # the next pass reads its own g_{i-1} for h_i
    return total / unroll, int(sel.sum())


def completion_mask(prompt_lens: list[int], lengths: list[int], L: int) -> torch.Tensor:
    """[B, L-1] head positions that draft completion tokens: i from P-1 (after the prompt's last hidden)
    up to the one predicting the last token's successor whose teacher exists (i + 1 <= len - 2)."""
    i = torch.arange(L - 1)
    return torch.stack([(i >= p - 1) & (i <= n - 3) for p, n in zip(prompt_lens, lengths)]).float()


# ---- the drafter ------------------------------------------------------------------------------------
class HeadDrafter(ModelDrafter):
    """The engine-side head: its KV over the target's block tables (ModelDrafter's Runner), the hidden
    states the engine hands over per sequence until the head catches up on them."""
    wants_hidden = True

    def __init__(self, head: DraftHead, target: DraftTarget, seed: int = 0):
        # where the target replays CUDA graphs, so does the head: an eager one-layer forward on a GPU is
        # launch overhead, paid once per draft position (docs/results.md, the third GPU run)
        runner = target.graph_runner(head, features=True) if target.graph_runner else None
        super().__init__("head", head, target, seed, runner=runner)
        self.head = head
        self.pending: dict[int, tuple[int, list[torch.Tensor]]] = {}   # seq_id -> (first position, [n_i, D] chunks)
        # recording (a rank that trains the head in its bubble, rl/rollout.py): every hidden state a
        # sequence gets, its prompt's from the sibling that prefilled it, and the finished sequences
        self.recording = False
        self.trace: dict[int, tuple[int, list[torch.Tensor]]] = {}
        self.prompts: dict = {}                                          # prompt_key -> [P, D]
        self.finished: list[tuple[list[int], int, torch.Tensor]] = []    # (token ids, prompt length, [L-1, D])

    def observe_hidden(self, seqs: list[Sequence], starts: list[int], counts: list[int], hidden: torch.Tensor):
        """The target's hidden states of positions starts[b] .. + counts[b] (hidden[b, :counts[b]])."""
        hidden = hidden.clone()     # one copy: under CUDA graphs it is the buffer the next replay overwrites
        for b, (s, a, n) in enumerate(zip(seqs, starts, counts)):
            if n <= 0 or s.is_finished:
                continue
            h = hidden[b, :n]
            # recomputed (preemption) or skipped (a cached prompt prefix): restart at `a`; the head's KV
            # before it is what the target's blocks hold
            if _extend(self.pending, s.seq_id, a, h):
                s.num_draft_computed = a
            if self.recording:
                _extend(self.trace, s.seq_id, a, h)
                first, chunks = self.trace[s.seq_id]
                if first == 0 and a + n >= s.num_prompt_tokens:          # the whole prompt: share it
                    self.prompts.setdefault(s.prompt_key, torch.cat(chunks)[:s.num_prompt_tokens])

    @torch.inference_mode()
    def prefill(self, seqs, tokens, starts, hidden=None) -> None:
        """Take the prompt's hidden states and run the head over them now (not at the first draft): a
        prompt block the group shares then holds the head's KV for every sequence that shares it."""
        if hidden is not None:
            self.observe_hidden(seqs, starts, [len(t) for t in tokens], hidden)
            self._catch_up(seqs)

    def _catch_up(self, seqs: list[Sequence]) -> dict[int, torch.Tensor]:
        """Feed every pending head position whose next token is known -> {row: g at its last position}."""
        rows, feed, feats, starts = [], [], [], []
        for i, s in enumerate(seqs):
            first, chunks = self.pending.get(s.seq_id, (0, []))
            end = min(first + sum(len(c) for c in chunks), len(s) - 1)   # x_{j+1} must exist
            if end <= first:
                continue
            h = torch.cat(chunks)
            rows.append(i)
            feed.append(s.token_ids[first + 1:end + 1])
            feats.append(h[:end - first])
            starts.append(first)
            self.pending[s.seq_id] = (end, [h[end - first:]] if end - first < len(h) else [])
        if not rows:
            return {}
        sub = [seqs[i] for i in rows]
        g = self.runner.forward(sub, feed, starts, torch.cat(feats))                        # [b, Q, D]
        out = {}
        for r, (i, s, f, a) in enumerate(zip(rows, sub, feed, starts)):
            s.num_draft_computed = a + len(f)
            out[i] = g[r, len(f) - 1]
        return out

    @torch.inference_mode()
    def propose(self, seqs: list[Sequence], num_tokens: list[int]) -> Proposal:
        B, K, V, dev = len(seqs), max(num_tokens, default=0), self.vocab_size, self.device
        drafts: list[list[int]] = [[] for _ in seqs]
        q = torch.zeros(B, K, V, dtype=torch.float32, device=dev)                        # [B, K, V]
        wanted = [i for i in range(B) if num_tokens[i] > 0]
        last = self._catch_up([seqs[i] for i in wanted])
        rows = [wanted[r] for r in sorted(last)]              # rows the head is current on: len - 2 fed
        g = torch.stack([last[r] for r in sorted(last)]) if rows else None                  # [b, D]
        for j in range(K):
            if not rows:
                break
            # q over the draft vocabulary only (filters and softmax over Vd, not V), 0 in q's other columns
            p, tok = self.draw([seqs[i] for i in rows], self.head.draft_logits(g))             # [b, Vd], [b]
            idx, vocab = torch.tensor(rows, device=dev), self.head.vocab
            if vocab is not None:
                q[idx[:, None], j, vocab], tok = p, vocab[tok]   # greedy rows: verify ignores q
            else:
                q[idx, j] = p
            for i, t in zip(rows, tok.tolist()):
                drafts[i].append(t)
            keep = [r for r, i in enumerate(rows) if num_tokens[i] > j + 1]
            if not keep:
                break
            rows, g = [rows[r] for r in keep], g[keep]
            sub = [seqs[i] for i in rows]
            # head position len - 2 + j + 1 over (g, d_{j+1}): scratch KV, overwritten after the verify
            feed, starts = [[drafts[i][-1]] for i in rows], [len(s) - 1 + j for s in sub]
            g = self.runner.forward(sub, feed, starts, g)[:, 0]                              # [b, D]
        return Proposal(drafts, q, [self.name if d else "" for d in drafts])

    def observe(self, seq: Sequence) -> None:
        """A finished sequence: with recording on, keep its hidden states for the head's training."""
        first, chunks = self.trace.pop(seq.seq_id, (0, []))
        if not self.recording or not chunks or seq.bubble:
            return
        h = torch.cat(chunks)
        if first > 0:                   # its prompt came from the cache: the sibling's hidden states
            prompt = self.prompts.get(seq.prompt_key)
            if prompt is None or len(prompt) < first:
                return
            h = torch.cat([prompt[:first], h])
        n = min(len(h), len(seq) - 1)   # the last token was never fed
        if n >= seq.num_prompt_tokens + 2:
            self.finished.append((list(seq.token_ids[:n + 1]), seq.num_prompt_tokens, h[:n]))

    def next_step(self) -> None:
        """A new rollout: what the last one recorded is dropped if no bubble took it (on-policy only)."""
        self.finished, self.prompts = [], {}

    def take_finished(self) -> list[tuple[list[int], int, torch.Tensor]]:
        out, self.finished, self.prompts = self.finished, [], {}
        return out

    def free(self, seq: Sequence) -> None:
        self.pending.pop(seq.seq_id, None)
        self.trace.pop(seq.seq_id, None)

    def refresh(self, model: nn.Module) -> None:
        """The policy's LM head moved: the draft-vocabulary rows are gathered again on the next use."""
        self.head.__dict__.pop("_draft_w", None)

    @torch.no_grad()
    def load_head_state(self, state: dict) -> None:
        """The trainer's head weights into the engine's head, in place (like LLM.load_weights)."""
        own = self.head.state_dict()
        for k, v in state.items():
            own[k].copy_(v)


def _extend(store: dict, key, start: int, h: torch.Tensor) -> bool:
    """Append the hidden states of positions start.. to store[key] = (first position, chunks); where they
    do not follow on from what it holds, restart there. -> whether it restarted."""
    first, chunks = store.get(key, (start, []))
    restart = start != first + sum(len(c) for c in chunks)
    store[key] = (start, [h]) if restart else (first, chunks + [h])
    return restart


def head_drafter(target: DraftTarget, model: str | None = None, draft_vocab: int | None = None,
                 seed: int = 0) -> HeadDrafter:
    """{"method": "head", "model": DIR | null, "draft_vocab": N | null}: a saved head (`distill_head.py`,
    or a run's checkpoint), or a freshly initialised one (with a warning: it drafts noise until trained)."""
    check_draft_vocab(draft_vocab, target.vocab_size)
    if model is not None:
        head = load_head(model, target.model)
        if draft_vocab is not None and (head.vocab is None or len(head.vocab) != draft_vocab):
            raise ValueError(f"speculative[head].draft_vocab: {draft_vocab}, but the head in {model} was trained "
                             f"with {None if head.vocab is None else len(head.vocab)}")
    else:
        warnings.warn("speculative[head]: no trained head given (`model`); starting from a freshly initialised "
                      "one, which drafts poorly until trained (distill_head.py warm-starts one)", stacklevel=3)
        with torch.random.fork_rng(devices=[]):      # the caller's RNG stream stays as it was
            torch.manual_seed(seed)
            head = DraftHead(target.model, None if draft_vocab is None else torch.arange(draft_vocab))
    dtype = next(target.model.parameters()).dtype
    return HeadDrafter(head.to(dtype).eval(), target, seed)
