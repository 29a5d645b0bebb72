"""Reward functions in TRL's shape, the built-in ones, and the one place that calls them.

    f(prompts, completions, **columns) -> list[float | None]      (as TRL's GRPOTrainer calls `reward_funcs`)

`prompts` and `completions` share one form: strings, or conversational (a prompt is a list of
{"role", "content"} messages, a completion the one assistant message [{"role": "assistant",
"content": text}]). `completion_ids` holds the sampled token ids, and every other dataset column comes
as a keyword argument holding that column's values for the batch. None means "does not apply to this
sample": left out of that function's mean and counted 0 in the weighted sum (TRL's nansum). TRL's
`trainer_state` keyword has no counterpart here; a function that reads it is TRL-only.

Why strict: a reward that raises, returns the wrong number of values or a non-finite one is a bug in
the user's verifier, and a silent 0 would train on it. `Rewards.__call__` raises RewardError, one line
naming the function and the row, and train.py turns it into exit status 2.
"""
from __future__ import annotations

import importlib
import inspect
import math
import numbers
import re

_NUM = re.compile(r"-?\$?\s*\d[\d,]*(?:\.\d+)?|-?\.\d+")


class RewardError(ValueError):
    """A reward function misbehaved on the user's data (raised, wrong length, non-finite)."""


# ---- the built-in: GSM8K's final number ------------------------------------------------------------
def _number(s: str) -> float | None:
    s = s.replace(",", "").replace("$", "").replace(" ", "").rstrip(".")
    try:
        return float(s)
    except ValueError:
        return None


def extract_answer(text) -> float | None:
    """The final number of a text: the first number after its last `####` if it has one, else its last
    number; commas, `$` and a trailing `.` are ignored, so 72, 72.0 and $72. are the same answer."""
    if not isinstance(text, str):
        return None
    if "####" in text:
        nums = _NUM.findall(text.rsplit("####", 1)[1])
        if nums:
            return _number(nums[0])
    nums = _NUM.findall(text)
    return _number(nums[-1]) if nums else None


def content(completion) -> str:
    """The text of a plain or conversational completion."""
    return completion[-1]["content"] if isinstance(completion, list) else completion


def gsm8k_answer(prompts, completions, answer, **kwargs) -> list[float | None]:
    """1.0 when the completion's final number equals the one after '####' in the `answer` column
    (GSM8K's layout), else 0.0; None where the answer states no number."""
    out = []
    for c, a in zip(completions, answer):
        want, got = extract_answer(a), extract_answer(content(c))
        out.append(None if want is None else float(got is not None and abs(got - want) < 1e-6))
    return out


# ---- loading and calling -----------------------------------------------------------------------------
def load_reward(spec: str, field: str):
    """The function named by 'module.path:function', or ValueError naming `field`."""
    module, _, name = spec.partition(":")
    if not (module and name):
        raise ValueError(f"{field}: expected 'module.path:function', got {spec!r}")
    try:
        mod = importlib.import_module(module)
    except ImportError as e:
        raise ValueError(f"{field}: cannot import module {module!r} ({e})") from None
    fn = getattr(mod, name, None)
    if not callable(fn):
        raise ValueError(f"{field}: module {module!r} has no function {name!r}")
    return fn


def _required(fn) -> list[str]:
    """Keyword parameters of `fn` without a default, beyond what every call passes: dataset columns."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):     # no signature to read (a builtin): the first call will tell
        return []
    return [p.name for p in params if p.default is p.empty and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
            and p.name not in ("prompts", "completions", "completion_ids")]


def _line(e: Exception) -> str:
    msg = str(e).strip().splitlines()
    return f"{type(e).__name__}: {msg[0]}" if msg else type(e).__name__


class Rewards:
    """The reward functions of a task and their weights; calling it scores one batch."""

    def __init__(self, specs: list[str], weights: list[float] | None = None):
        if not specs:
            raise ValueError("task.rewards: expected at least one 'module.path:function', got []")
        if weights is not None and len(weights) != len(specs):
            raise ValueError(f"task.reward_weights: expected {len(specs)} weights (one per reward), got {weights}")
        self.fns = [load_reward(s, f"task.rewards[{i}]") for i, s in enumerate(specs)]
        self.names = [s.rpartition(":")[2] for s in specs]
        for i, n in enumerate(self.names):   # two functions of one name: tell their metrics apart
            if self.names.count(n) > 1:
                self.names[i] = specs[i].replace(":", ".")
        self.weights = list(weights) if weights is not None else [1.0] * len(specs)
        self.columns = [_required(fn) for fn in self.fns]    # the columns each function cannot do without

    def __call__(self, prompts: list, completions: list, columns: dict[str, list], rows: list[str],
                 completion_ids: list | None = None) -> tuple[list[float], dict[str, list]]:
        """(weighted reward per sample, {function name: its values, None where it does not apply}).
        `rows` names each sample's source row for error messages."""
        n, total, parts = len(completions), [0.0] * len(completions), {}
        kw = dict(columns, **({"completion_ids": completion_ids} if completion_ids is not None else {}))
        for fn, name, w in zip(self.fns, self.names, self.weights):
            values = self._call(fn, name, prompts, completions, kw, rows)
            seq = hasattr(values, "__len__") and not isinstance(values, (str, bytes, dict))   # list, tuple, array
            values = list(values) if seq else values
            if not seq or len(values) != n:
                got = f"{len(values)} values" if seq else type(values).__name__
                raise RewardError(f"reward {name}: returned {got} for {n} completions ({rows[0]}, ...); "
                                  f"expected a list of {n} floats or None")
            for i, v in enumerate(values):
                if v is not None and not (isinstance(v, numbers.Real) and math.isfinite(v)):
                    raise RewardError(f"reward {name}: returned {v!r} for {rows[i]}; expected a finite float or None")
                total[i] += 0.0 if v is None else w * float(v)
            parts[name] = [None if v is None else float(v) for v in values]
        return total, parts

    @staticmethod
    def _call(fn, name, prompts, completions, kw, rows):
        try:
            return fn(prompts=prompts, completions=completions, **kw)
        except Exception as e:
            first = e   # which row? the first that raises on its own, if one does
        for i in range(len(completions)):
            try:
                fn(prompts=prompts[i:i + 1], completions=completions[i:i + 1], **{k: v[i:i + 1] for k, v in kw.items()})
            except Exception as e:
                raise RewardError(f"reward {name}: raised {_line(e)} on {rows[i]}") from None
        raise RewardError(f"reward {name}: raised {_line(first)} on the batch "
                          f"{rows[0]} .. {rows[-1]} (no single row raises alone)") from None
