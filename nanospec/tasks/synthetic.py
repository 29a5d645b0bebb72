"""The embedded verifiable task: running sums mod m, with working shown, and a heavy-tailed length.

    prompt:      a 3 b 7 c 2 ?
    completion:  a 3 3 ; b 7 0 ; c 2 2 ; = 2

Each step `<label> <digit> <running sum>` is *local*: the label is the successor of the previous
label, the digit is a lookup of that label in the prompt (an induction-head copy), and the sum is a
10x10 table of (previous sum, digit). "Add numbers 0-19 with running sums" was too hard for a tiny
model in minutes of CPU; this keeps the shape but makes every step learnable.

Why the shape: the number of steps k follows a truncated Zipf law P(k) ~ k^-alpha on [min, max], so a
response (4k+2 tokens) is ~18 tokens at the median, ~74 at p90 and ~106 at k=26: a few long rollouts
dominate a batched rollout's time -- the tail speculative decoding attacks. The working is repetitive
(labels in order, digits copied from the prompt) so n-gram / suffix / prior-rollout drafters have
something to find. alpha = 1.0 rather than steeper: SFT must see enough long prompts to learn the copy
(an induction head). At alpha 1.5 the 2.9M model copied only ~15% of digits right for k > 12 and
p(true token) was ~0.4, so no draft could be accepted often; at 1.0 (configs/default.yaml's SFT)
it copies >90% of them, teacher-forced.

Reward = final_weight * [final answer right] + (1 - final_weight) * (fraction of steps right over
max(true, emitted) steps). Step i is right when its label and copied digit are the prompt's i-th and
its sum is (the previous *emitted* sum + digit) mod m: each local operation is judged on its own, so
one slip costs one step, not all later ones. Exactly 1.0 only for a fully correct completion; dense
partial credit otherwise (exact-answer-only reward gave GRPO no signal on long prompts).
"""
from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass, field

LABELS = "abcdefghijklmnopqrstuvwxyz"
VOCAB = list("0123456789") + list(LABELS) + [";", "=", "?"]


@dataclass
class Problem:
    """One prompt of any task. `steps`: task-specific working (here (label, digit, sum) triples).
    `messages`: a conversational prompt ({role, content} dicts; `prompt` is then only its key), None:
    `prompt` is one user turn."""
    prompt: str
    answer: str
    steps: list = field(default_factory=list)
    meta: dict = field(default_factory=dict)
    messages: list | None = None


class Splits:
    """A task's `train(n)` / `test(n)`: n problems of that split, as its `sample` draws them (seeded)."""

    def train(self, n: int | None = None) -> list[Problem]:
        return self.sample("train", n)

    def test(self, n: int | None = None) -> list[Problem]:
        return self.sample("test", n)


def _in_test(prompt: str, test_fraction: float) -> bool:
    """Stable split by content hash (Python's hash() is salted per process): train/test are disjoint."""
    h = int.from_bytes(hashlib.blake2b(prompt.encode(), digest_size=8).digest(), "big")
    return h / 2**64 < test_fraction


class SyntheticTask(Splits):
    name = "synthetic"

    def __init__(self, seed: int = 0, min_steps: int = 1, max_steps: int = 26, zipf_alpha: float = 1.0,
                 modulus: int = 10, test_fraction: float = 0.2, final_weight: float = 0.5):
        for key, ok, want in [("min_steps", 1 <= min_steps <= max_steps, "1 <= min_steps <= max_steps"),
                              ("max_steps", max_steps <= len(LABELS), f"<= {len(LABELS)} (one label each)"),
                              ("zipf_alpha", zipf_alpha >= 0, ">= 0"),
                              ("modulus", 2 <= modulus <= 10, "in [2, 10] (single-digit tokens)"),
                              ("test_fraction", 0 < test_fraction < 1, "in (0, 1)"),
                              ("final_weight", 0 <= final_weight <= 1, "in [0, 1]")]:
            if not ok:
                raise ValueError(f"SyntheticTask: {key} must be {want}, got {locals()[key]!r}")
        self.seed, self.min_steps, self.max_steps = seed, min_steps, max_steps
        self.modulus, self.test_fraction, self.final_weight = modulus, test_fraction, final_weight
        self._ks = list(range(min_steps, max_steps + 1))
        self._kw = [k ** -zipf_alpha for k in self._ks]

    @property
    def max_response_tokens(self) -> int:
        """Longest correct completion in tokens, eos excluded."""
        return 4 * self.max_steps + 2

    # ---- problems -----------------------------------------------------------------------------------
    def make_problem(self, digits: list[int], split: str = "") -> Problem:
        steps, s = [], 0
        for label, d in zip(LABELS, digits):
            s = (s + d) % self.modulus
            steps.append((label, d, s))
        prompt = " ".join(f"{l} {d}" for l, d, _ in steps) + " ?"
        return Problem(prompt, str(s), steps, {"k": len(steps), "split": split})

    def _digits(self, rng: random.Random, k: int, split: str) -> list[int] | None:
        """k digits whose prompt hashes into `split`, or None: a short length may have (almost) no
        prompt in a split (k=1 has 10 prompts), then the caller draws another k."""
        for _ in range(64):
            digits = [rng.randrange(self.modulus) for _ in range(k)]
            if _in_test(self.make_problem(digits).prompt, self.test_fraction) == (split == "test"):
                return digits
        return None

    def sample(self, split: str, n: int, seed: int | None = None) -> list[Problem]:
        """n problems of `split` ("train" | "test"); the same (task seed or `seed`, split) -> same list."""
        if split not in ("train", "test"):
            raise ValueError(f"split must be 'train' or 'test', got {split!r}")
        rng = random.Random(f"nanospec-synthetic/{self.seed if seed is None else seed}/{split}")
        out = []
        while len(out) < n:
            k = rng.choices(self._ks, weights=self._kw)[0]
            digits = self._digits(rng, k, split)
            if digits is not None:
                out.append(self.make_problem(digits, split))
        return out

    # ---- completions ----------------------------------------------------------------------------------
    @staticmethod
    def format_steps(steps) -> str:
        return "".join(f"{l} {d} {s} ; " for l, d, s in steps) + f"= {steps[-1][2] if steps else 0}"

    def sft_text(self, problem: Problem, rng: random.Random, error_rate: float = 0.0) -> str:
        """A target completion; with probability `error_rate` it holds one slip that propagates, so the
        SFT model starts imperfect and GRPO has reward to gain. Slips: a wrong sum, a wrong copied
        digit, or a skipped step (all make reward < 1)."""
        if not 0 <= error_rate <= 1:
            raise ValueError(f"error_rate must be in [0, 1], got {error_rate}")
        digits = [d for _, d, _ in problem.steps]
        if rng.random() >= error_rate:
            return self.format_steps(problem.steps)
        j, kind, m = rng.randrange(len(digits)), rng.choice(["sum", "copy", "skip"]), self.modulus
        labels = list(LABELS[:len(digits)])
        if kind == "copy":
            digits[j] = (digits[j] + rng.randrange(1, m)) % m
        elif kind == "skip":
            del digits[j], labels[j]
        steps, s = [], 0
        for i, (label, d) in enumerate(zip(labels, digits)):
            s = (s + d + (rng.randrange(1, m) if kind == "sum" and i == j else 0)) % m
            steps.append((label, d, s))
        return self.format_steps(steps)

    def _score(self, problem: Problem, completion: str) -> tuple[bool, float]:
        """(final answer right, fraction of steps right). Never raises on garbage."""
        if not isinstance(completion, str):
            return False, 0.0
        body, eq, tail = completion.rpartition("=")
        if not eq:
            body, tail = completion, ""
        emitted = [c.split() for c in body.split(";")]
        emitted = [c for c in emitted if c]
        right, prev, digits = 0, "0", {str(i): i for i in range(self.modulus)}
        for e, (label, d, _) in zip(emitted, problem.steps):  # judge each step's own operation
            right += (len(e) == 3 and e[0] == label and e[1] == str(d) and prev in digits
                      and e[2] == str((digits[prev] + d) % self.modulus))
            prev = e[-1]
        frac = right / max(len(problem.steps), len(emitted), 1)
        return tail.split() == [problem.answer], frac

    def reward(self, problem: Problem, completion: str) -> float:
        """In [0, 1]; 1.0 iff the completion is exactly right (decode with skip_special_tokens)."""
        final, frac = self._score(problem, completion)
        return 1.0 if final and frac == 1 else self.final_weight * final + (1 - self.final_weight) * frac

    def is_correct(self, problem: Problem, completion: str) -> bool:
        """The right final answer reached through the right working (reward == 1)."""
        final, frac = self._score(problem, completion)
        return final and frac == 1
