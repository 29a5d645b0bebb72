"""Suffix tree + a distilled n-gram MLP, choosing token by token which one drafts.

Why: at T=1 a GRPO sample that once slipped (one wrong running sum on the embedded task) no longer
shares its siblings' continuations. The suffix tree still drafts its copied digits and labels right
(they come from the prompt), but every later sum it drafts is a sibling's, and such a draft is
rejected most of the time. A draft model knows the sums, but on CPU each of its forwards costs a
large share of the target's (fixed per-step overhead), so as a drafter of its own it does not pay.
An MLP over the last n tokens (Bengio et al. 2003's neural n-gram model), distilled from the policy
on its own samples, costs a fraction of a millisecond per batched call and gets exactly the *local*
tokens right (the running sums and separators of the embedded task) but not the copied digits (they
need the prompt). The two are complementary, so per draft position:

    m = MLP(last n tokens of context + drafts so far)        q_m = its sampling distribution
    t = the suffix tree's most frequent continuation there (or none)
    if t exists and not (max q_m >= override and argmax q_m != t):   draft t    (q = onehot(t))
    elif max q_m >= min_mlp_prob:                                     draft x ~ q_m (q = q_m)
    else: stop
and stop once the estimated probability that the whole draft is accepted drops below min_path_prob.
Which distribution a position uses depends only on the context and the drafts before it, so the
proposal is a valid sequential q and verify's min(1, p/q) rule keeps sampling exact (engine/verify.py:
point-mass rows and sampled rows mix per position).

`distill_mlp.py` trains the MLP beforehand: sample prompts at T=1 with the engine, run the target once over each
sequence for p at every completion position, minimise cross-entropy H(p, q_m) (soft labels).
Online (`learn_epochs > 0`, the default): every finished rollout the drafter observes becomes
(window, next token) pairs, and `next_step()` (once per rollout step, i.e. after each policy update)
trains on the new ones with hard labels (the sampled tokens: the same optimum as distillation, in
expectation), replaying a bounded buffer of recent ones. So the MLP follows the policy, and with no
`model` at all it starts untrained: an untrained MLP is never confident, so the drafter is then the
plain suffix tree, and the MLP takes over positions as it learns.
"""
from __future__ import annotations

import json
import math
import random
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn

from nanospec.engine import sampler
from nanospec.engine.sequence import Sequence
from nanospec.drafters.base import Drafter, Proposal
from nanospec.drafters.suffix import SuffixDrafter

CONFIG = "ngram_mlp.json"
WEIGHTS = "model.safetensors"


class NGramMLP(nn.Module):
    """logits of the next token from the previous n: [b, n] token ids -> [b, V] (pad id 0 on the left)."""

    def __init__(self, vocab_size: int, n: int = 4, dim: int = 64, hidden: int = 256):
        super().__init__()
        for name, value in (("vocab_size", vocab_size), ("n", n), ("dim", dim), ("hidden", hidden)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"NGramMLP: {name} must be an int >= 1, got {value!r}")
        self.vocab_size, self.n, self.dim, self.hidden = vocab_size, n, dim, hidden
        self.embed = nn.Embedding(vocab_size, dim)
        self.up = nn.Linear(n * dim, hidden)
        self.out = nn.Linear(hidden, vocab_size)

    def forward(self, windows: torch.Tensor) -> torch.Tensor:
        x = self.embed(windows).flatten(1)                                   # [b, n * dim]
        return self.out(F.silu(self.up(x)))                                  # [b, V]

    def window(self, tokens: list[int]) -> list[int]:
        return ([0] * self.n + tokens[-self.n:])[-self.n:]

    def examples(self, ids: list[int], start: int) -> list[tuple[list[int], int]]:
        """(window, next token) for every position of ids from start on (a completion: start = prompt length)."""
        return [(self.window(ids[max(0, i - self.n):i]), ids[i]) for i in range(start, len(ids))]

    def save(self, path: str | Path) -> None:
        """Atomically: written to a temp dir, renamed into place (replacing only an earlier n-gram MLP)."""
        path = Path(path)
        if path.exists() and not (path / CONFIG).is_file():
            raise ValueError(f"NGramMLP.save: {path} exists and holds no {CONFIG}; choose another directory")
        tmp = path.with_name(path.name + ".tmp")
        tmp.mkdir(parents=True, exist_ok=True)
        save_file({k: v.contiguous() for k, v in self.state_dict().items()}, str(tmp / WEIGHTS))
        (tmp / CONFIG).write_text(json.dumps(dict(vocab_size=self.vocab_size, n=self.n, dim=self.dim,
                                                  hidden=self.hidden)))
        if path.exists():
            for f in path.iterdir():
                f.unlink()
            path.rmdir()
        tmp.rename(path)

    @classmethod
    def load(cls, path: str | Path) -> "NGramMLP":
        path = Path(path)
        if not (path / CONFIG).is_file() or not (path / WEIGHTS).is_file():
            raise ValueError(f"speculative[suffix_mlp]: {path} holds no n-gram MLP (expected {CONFIG} and "
                             f"{WEIGHTS}; make one with `python distill_mlp.py` (make mlp))")
        model = cls(**json.loads((path / CONFIG).read_text()))
        model.load_state_dict(load_file(str(path / WEIGHTS)))
        return model.eval()


@dataclass
class _Row:
    """One sequence's drafting state inside SuffixMLPDrafter.propose."""
    i: int                          # its row in the batch
    seq: Sequence
    budget: int                     # drafts it may get this step
    tree: object                    # its prompt's suffix tree (drafters/suffix.py)
    node: object                    # where the sequence (and its drafts so far) matches in the tree
    window: list[int]               # the MLP's input: the last n tokens
    path_prob: float = 1.0          # estimated probability that every draft so far is accepted
    draft: list[int] = field(default_factory=list)
    confidence: list[float] = field(default_factory=list)

    def path(self) -> list[tuple]:
        """The tree's continuation from here, within the budget left: [(token, frequency, node after
        it, MLP window after it)]."""
        node, w, out = self.node, self.window, []
        while len(self.draft) + len(out) < self.budget:
            nxt = self.tree.continuation(node)
            if nxt is None:
                break
            t, freq, node = nxt
            w = w[1:] + [t]
            out.append((t, freq, node, w))
        return out

    def take(self, token: int, est: float, node, window: list[int]) -> None:
        self.path_prob *= est
        self.draft.append(token)
        self.confidence.append(est)
        self.node, self.window = node, window


class SuffixMLPDrafter(Drafter):
    name = "suffix_mlp"
    stochastic = True     # positions drafted by the MLP carry its q; tree positions a point mass
    # each draft token's estimated acceptance goes out as Proposal.confidence (the tree's frequency, or
    # the MLP's max q): never a function of the sampled token itself, so trimming on it stays exact
    confident = True

    def __init__(self, model: str | NGramMLP | None = None, vocab_size: int | None = None, override: float = 0.8,
                 min_mlp_prob: float = 0.3, min_path_prob: float = 0.6, learn_epochs: float = 2.0,
                 learn_lr: float = 1e-3, buffer: int = 65536, seed: int = 0):
        for name, value in (("override", override), ("min_mlp_prob", min_mlp_prob), ("min_path_prob", min_path_prob)):
            if not 0 <= value <= 1:
                raise ValueError(f"speculative[suffix_mlp]: {name} must be in [0, 1], got {value}")
        if not learn_epochs >= 0 or not learn_lr > 0 or not (isinstance(buffer, int) and buffer >= 1):
            raise ValueError(f"speculative[suffix_mlp]: expected learn_epochs >= 0, learn_lr > 0 and an int "
                             f"buffer >= 1, got {learn_epochs}, {learn_lr}, {buffer}")
        if model is None and vocab_size is None:
            raise ValueError("speculative[suffix_mlp]: without a 'model' the MLP starts untrained and needs vocab_size")
        self.mlp = model if isinstance(model, NGramMLP) else NGramMLP.load(model) if model else NGramMLP(vocab_size)
        self.suffix = SuffixDrafter(use_global=False)      # it walks the prompt trie only (propose)
        self.override, self.min_mlp_prob, self.min_path_prob = override, min_mlp_prob, min_path_prob
        self.learn_epochs, self.learn_lr = learn_epochs, learn_lr
        self.examples: deque[tuple[list[int], int]] = deque(maxlen=buffer)   # (window, next token), newest last
        self.finished: list[tuple[list[int], int]] = []   # (token ids, prompt length) observed this step
        self.new_examples, self.opt = 0, None
        self.generator = torch.Generator().manual_seed(seed)    # draft sampling only, not verify's uniforms
        self.rng = random.Random(seed)

    @torch.inference_mode()
    def propose(self, seqs: list[Sequence], num_tokens: list[int]) -> Proposal:
        B, V = len(seqs), self.mlp.vocab_size
        temperature = torch.tensor([s.params.temperature for s in seqs])                         # [B]
        everyone = []
        for i, (s, k) in enumerate(zip(seqs, num_tokens)):
            if k > 0:
                tree, node = self.suffix.context(s)
                everyone.append(_Row(i, s, k, tree, node, self.mlp.window(s.token_ids)))
        rows = list(everyone)
        onehot, sampled, probs, done = [], [], [], 0   # (row, position, token); (row, position, index into probs)
        while rows:   # one round per MLP-drafted token: a batched MLP call over every row's tree path
            paths = [r.path() for r in rows]
            # the MLP sees the window before every path token and one past the path's end
            batch = [w for r, path in zip(rows, paths) for w in [r.window] + [x[3] for x in path]]
            owner = [r.i for r, path in zip(rows, paths) for _ in range(len(path) + 1)]
            logits = self.mlp(torch.tensor(batch))                                             # [n, V]
            p = sampler.scaled(logits, temperature[owner]).softmax(-1)   # q at the target's T (no top-k/p: any q is exact)
            p_max, p_arg = (x.tolist() for x in p.max(-1))
            probs.append(p)
            want, b = [], 0     # (row, index in batch) where the MLP drafts next
            for r, path in zip(rows, paths):
                for j, (t, freq, node, w) in enumerate([*path, (None, 0.0, None, None)]):
                    mlp_p, mlp_t = p_max[b + j], p_arg[b + j]
                    if t is not None and not (mlp_p >= self.override and mlp_t != t):
                        # the MLP has no opinion (e.g. a copied digit) or agrees: keep the tree's token
                        est = freq if mlp_p < self.override else mlp_p
                        if r.draft and r.path_prob * est < self.min_path_prob:
                            break
                        onehot.append((r.i, len(r.draft), t))
                        r.take(t, est, node, w)
                        continue
                    # the tree has nothing here, or the MLP is sure of another token: the MLP drafts
                    if (len(r.draft) < r.budget and mlp_p >= self.min_mlp_prob
                            and not (r.draft and r.path_prob * mlp_p < self.min_path_prob)):
                        want.append((r, b + j))
                    break
                b += len(path) + 1
            if want:
                draws = torch.multinomial(p[[k for _, k in want]], 1, generator=self.generator).squeeze(1).tolist()
                for (r, k), x in zip(want, draws):
                    t = p_arg[k] if r.seq.params.temperature == 0 else x
                    sampled.append((r.i, len(r.draft), done + k))
                    r.take(t, p_max[k], r.tree.step(r.node, t), r.window[1:] + [t])
            done += len(batch)
            rows = [r for r, _ in want if len(r.draft) < r.budget]
        drafts, confidence = [[] for _ in seqs], [[] for _ in seqs]
        for r in everyone:
            drafts[r.i], confidence[r.i] = r.draft, r.confidence
        q = torch.zeros(B, max(map(len, drafts), default=0), V)                                 # [B, k, V]
        if onehot:
            at = torch.tensor(onehot)
            q[at[:, 0], at[:, 1], at[:, 2]] = 1.0
        if sampled:
            at = torch.tensor(sampled)
            q[at[:, 0], at[:, 1]] = torch.cat(probs)[at[:, 2]]
        return Proposal(drafts, q, [self.name if d else "" for d in drafts], confidence=confidence)

    def observe(self, seq: Sequence) -> None:
        self.suffix.observe(seq)
        if self.learn_epochs:   # cut into examples in next_step(), off the rollout's critical path
            self.finished.append((seq.token_ids, seq.num_prompt_tokens))

    def free(self, seq: Sequence) -> None:
        self.suffix.free(seq)

    def next_step(self) -> None:
        """Age the suffix tree; train the MLP on what was observed since the last step (see module doc)."""
        self.suffix.next_step()
        for ids, start in self.finished:   # plain lists: tensors made while observing (inference mode)
            self.examples.extend(self.mlp.examples(ids, start))   # could not be trained on
            self.new_examples += len(ids) - start
        self.finished = []
        new, self.new_examples = min(self.new_examples, len(self.examples)), 0
        if not (self.learn_epochs and new):
            return
        with torch.inference_mode(False), torch.enable_grad():
            self.mlp.train()
            self.opt = self.opt or torch.optim.AdamW(self.mlp.parameters(), lr=self.learn_lr)
            examples = list(self.examples)
            for _ in range(math.ceil(self.learn_epochs * new / 512)):
                # half the batch from the newest examples, half replayed from the whole buffer
                batch = self.rng.choices(examples[-new:], k=256) + self.rng.choices(examples, k=256)
                loss = F.cross_entropy(self.mlp(torch.tensor([w for w, _ in batch])), torch.tensor([t for _, t in batch]))
                self.opt.zero_grad(set_to_none=True)
                loss.backward()
                self.opt.step()
            self.mlp.eval()


def suffix_mlp_drafter(target, model: str | None = None, **options) -> SuffixMLPDrafter:
    """{"method": "suffix_mlp", "model": DIR or null}: null starts an untrained MLP that learns online;
    `options` are SuffixMLPDrafter's. The MLP must predict over the target's vocabulary."""
    drafter = SuffixMLPDrafter(model, vocab_size=target.vocab_size, **options)
    if drafter.mlp.vocab_size != target.vocab_size:
        raise ValueError(f"speculative[suffix_mlp]: the n-gram MLP in {model} has vocab_size "
                         f"{drafter.mlp.vocab_size} but the target has {target.vocab_size}")
    return drafter
