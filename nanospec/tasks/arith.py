"""Word problems with running totals: the synthetic task's shape in natural language, for real models.

    Mia has 12 coins. She gets 5 more coins. She gives away 3 coins. How many coins does Mia have
    now? Give the final number after '####'.
    -> ... #### 14

Why: GSM8K is out of reach for a 135M model on CPU (greedy accuracy ~0, the sampled reward ~0.02,
answers of 150+ tokens), so GRPO has no signal and each step costs minutes. These problems keep GSM8K's
answer format and the synthetic task's heavy tail (k operations, truncated Zipf law on
[min_steps, max_steps]), and SmolLM2-135M-Instruct starts in the 0.1-0.6 reward range.

Reward = 1 for the right final number (rewards.extract_answer: after the last '####', else the last
number); otherwise `format_credit` if the completion at least states a number after '####' (GSM8K's
answer format, partial credit so that a weak policy sees some signal), else 0.
"""
from __future__ import annotations

import random

from nanospec.tasks.rewards import _NUM, extract_answer
from nanospec.tasks.synthetic import Problem, Splits, _in_test

NAMES = ["Mia", "Tom", "Anna", "Ben", "Lily", "Sam", "Noah", "Emma", "Leo", "Ava"]
ITEMS = ["apples", "coins", "books", "pens", "cards", "stickers", "marbles", "stamps"]
INSTRUCTION = "Give the final number after '####'."


class ArithTask(Splits):
    name = "arith"

    def __init__(self, seed: int = 0, min_steps: int = 1, max_steps: int = 6, zipf_alpha: float = 1.5,
                 test_fraction: float = 0.2, format_credit: float = 0.1):
        for key, value, ok, want in [
                ("min_steps", min_steps, 1 <= min_steps <= max_steps, "1 <= min_steps <= max_steps"),
                ("zipf_alpha", zipf_alpha, zipf_alpha >= 0, ">= 0"),
                ("test_fraction", test_fraction, 0 < test_fraction < 1, "in (0, 1)"),
                ("format_credit", format_credit, 0 <= format_credit < 1, "in [0, 1)")]:
            if not ok:
                raise ValueError(f"task.{key}: expected {want}, got {value!r}")
        self.seed, self.min_steps, self.max_steps, self.zipf_alpha = seed, min_steps, max_steps, zipf_alpha
        self.test_fraction, self.format_credit = test_fraction, format_credit

    def make_problem(self, rng: random.Random) -> Problem:
        k = rng.choices(range(self.min_steps, self.max_steps + 1),
                        [j ** -self.zipf_alpha for j in range(self.min_steps, self.max_steps + 1)])[0]
        who, item = rng.choice(NAMES), rng.choice(ITEMS)
        total = rng.randint(2, 20)
        text, steps = [f"{who} has {total} {item}."], [total]
        for _ in range(k):
            if total > 2 and rng.random() < 0.4:
                n = rng.randint(1, total - 1)
                text.append(f"{who} gives away {n} {item}.")
                total -= n
            else:
                n = rng.randint(1, 15)
                text.append(f"{who} gets {n} more {item}.")
                total += n
            steps.append(total)
        text.append(f"How many {item} does {who} have now? {INSTRUCTION}")
        return Problem(" ".join(text), str(total), steps, {"k": k})

    def sample(self, split: str, n: int, seed: int | None = None) -> list[Problem]:
        """n distinct problems of `split` (train/test are disjoint by a content hash); prefix-stable in n."""
        if split not in ("train", "test"):
            raise ValueError(f"split must be 'train' or 'test', got {split!r}")
        rng = random.Random(f"nanospec-arith/{self.seed if seed is None else seed}/{split}")
        out, seen = [], set()
        while len(out) < n:
            p = self.make_problem(rng)
            if p.prompt not in seen and _in_test(p.prompt, self.test_fraction) == (split == "test"):
                seen.add(p.prompt)
                out.append(p)
        return out

    def sft_text(self, problem: Problem, rng: random.Random, error_rate: float = 0.0) -> str:
        """Worked running totals, then '#### N'; with probability `error_rate` the final number is off by one."""
        s = problem.steps
        lines = [f"Start: {s[0]}."] + [f"{a} {'+' if b > a else '-'} {abs(b - a)} = {b}." for a, b in zip(s, s[1:])]
        answer = s[-1] + (1 if rng.random() < error_rate else 0)
        return "\n".join(lines + [f"#### {answer}"])

    def is_correct(self, problem: Problem, completion: str) -> bool:
        got = extract_answer(completion)
        return got is not None and abs(got - float(problem.answer)) < 1e-6

    def reward(self, problem: Problem, completion: str) -> float:
        if self.is_correct(problem, completion):
            return 1.0
        stated = "####" in completion and _NUM.search(completion.rsplit("####", 1)[1]) is not None
        return self.format_credit if stated else 0.0
