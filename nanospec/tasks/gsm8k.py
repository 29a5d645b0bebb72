"""GSM8K from a local copy of the official jsonl files, behind the same task interface as synthetic.

Each line is {"question": str, "answer": str}; the answer's last line is `#### <number>`. The reward
is a final-number match: the number after the completion's last `####` if it has one, else its last
number; commas, `$` and a trailing `.` are ignored and 72, 72.0 and 72.00 are the same answer.
"""
from __future__ import annotations

import os
import random
import re
from pathlib import Path

from nanospec.config import read_jsonl
from nanospec.tasks.synthetic import Problem

INSTRUCTION = "Solve step by step, then give the final number after '####'."
_NUM = re.compile(r"-?\$?\s*\d[\d,]*(?:\.\d+)?|-?\.\d+")


def default_data_dir() -> Path:
    """$NANOSPEC_DATA/gsm8k if set, else the `shared/data/gsm8k` folder beside the repo checkout."""
    if os.environ.get("NANOSPEC_DATA"):
        return Path(os.environ["NANOSPEC_DATA"]) / "gsm8k"
    return Path(__file__).resolve().parents[3] / "shared" / "data" / "gsm8k"


def _number(s: str) -> float | None:
    s = s.replace(",", "").replace("$", "").replace(" ", "").rstrip(".")
    try:
        return float(s)
    except ValueError:
        return None


def extract_answer(text) -> float | None:
    """The final number of a completion (see module docstring), or None."""
    if not isinstance(text, str):
        return None
    if "####" in text:
        nums = _NUM.findall(text.rsplit("####", 1)[1])
        if nums:
            return _number(nums[0])
    nums = _NUM.findall(text)
    return _number(nums[-1]) if nums else None


def load_split(path) -> list[dict]:
    """Rows of one jsonl file, checked: a missing file or a malformed line raises naming the file and
    the line number."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"GSM8K file {path} not found: pass task.data_path (a folder with "
                                f"train.jsonl/test.jsonl) or set NANOSPEC_DATA")
    rows = read_jsonl(path)
    for n, r in rows:
        if not (isinstance(r, dict) and isinstance(r.get("question"), str) and isinstance(r.get("answer"), str)
                and "####" in r["answer"] and extract_answer(r["answer"]) is not None):
            raise ValueError(f"{path}: line {n} is malformed: expected string fields 'question' and "
                             f"'answer' with the answer ending in '#### <number>', got {str(r)[:120]}")
    return [r for _, r in rows]


class GSM8KTask:
    name = "gsm8k"

    def __init__(self, data_path=None, seed: int = 0, instruction: str = INSTRUCTION):
        self.dir = Path(data_path) if data_path else default_data_dir()
        self.seed, self.instruction = seed, instruction
        self._rows: dict[str, list[dict]] = {}

    def rows(self, split: str) -> list[dict]:
        if split not in ("train", "test"):
            raise ValueError(f"split must be 'train' or 'test', got {split!r}")
        if split not in self._rows:
            self._rows[split] = load_split(self.dir / f"{split}.jsonl")
        return self._rows[split]

    def make_problem(self, row: dict, index: int, split: str) -> Problem:
        solution, answer = row["answer"].rsplit("####", 1)
        prompt = f"{row['question'].strip()}\n{self.instruction}" if self.instruction else row["question"].strip()
        return Problem(prompt, answer.strip().replace(",", ""), [l for l in solution.strip().split("\n") if l],
                       {"index": index, "split": split, "solution": row["answer"]})

    def sample(self, split: str, n: int | None = None, seed: int | None = None) -> list[Problem]:
        """n problems (None: all) in an order shuffled by (task seed or `seed`); prefix-stable in n."""
        rows = self.rows(split)
        order = list(range(len(rows)))
        random.Random(f"nanospec-gsm8k/{self.seed if seed is None else seed}/{split}").shuffle(order)
        return [self.make_problem(rows[i], i, split) for i in order[:n]]

    def train(self, n: int | None = None) -> list[Problem]:
        return self.sample("train", n)

    def test(self, n: int | None = None) -> list[Problem]:
        return self.sample("test", n)

    def sft_text(self, problem: Problem, rng: random.Random, error_rate: float = 0.0) -> str:
        """The reference solution; with probability `error_rate` its final number is off by one."""
        if not 0 <= error_rate <= 1:
            raise ValueError(f"error_rate must be in [0, 1], got {error_rate}")
        answer = problem.answer
        if rng.random() < error_rate:
            wrong = (_number(answer) or 0) + 1
            answer = str(int(wrong)) if wrong == int(wrong) else str(wrong)
        return "\n".join(problem.steps + [f"#### {answer}"])

    def is_correct(self, problem: Problem, completion: str) -> bool:
        got, want = extract_answer(completion), _number(problem.answer)
        return got is not None and want is not None and abs(got - want) < 1e-6

    def reward(self, problem: Problem, completion: str) -> float:
        return float(self.is_correct(problem, completion))
