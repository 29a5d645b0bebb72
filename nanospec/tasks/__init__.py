"""Verifiable tasks behind one interface, so the trainer and eval treat them alike:

    task.train(n) / task.test(n) / task.sample(split, n, seed) -> list[Problem]
    task.sft_text(problem, rng, error_rate) -> target completion text
    task.reward(problem, completion_text) -> float in [0, 1];  task.is_correct(...) -> bool

Prompts become token ids with `format_prompt(tokenizer, problem.prompt)` (chat template + generation
prompt); completions are scored after `tokenizer.decode(ids, skip_special_tokens=True)`.
"""
from nanospec.tasks.arith import ArithTask
from nanospec.tasks.gsm8k import GSM8KTask
from nanospec.tasks.synthetic import Problem, SyntheticTask
from nanospec.tasks.tokenizer import build_tiny_vocab_tokenizer, build_tokenizer, format_prompt

TASKS = {"synthetic": SyntheticTask, "gsm8k": GSM8KTask, "arith": ArithTask}
_KNOBS = {"synthetic": ("seed", "min_steps", "max_steps", "zipf_alpha", "modulus", "test_fraction", "final_weight"),
          "gsm8k": ("seed", "data_path"),
          "arith": ("seed", "min_steps", "max_steps", "zipf_alpha", "test_fraction", "format_credit")}


def get_task(name: str, **kw):
    """A task by name: "synthetic", "gsm8k" or "arith" (the class's keyword arguments)."""
    if name not in TASKS:
        raise ValueError(f"task.name: unknown task {name!r}; expected one of {sorted(TASKS)}")
    return TASKS[name](**kw)


def task_from_config(tc):
    """The task of a `task` config section (config.TaskConfig): only the knobs its kind reads."""
    return get_task(tc.name, **{k: getattr(tc, k) for k in _KNOBS.get(tc.name, ())})


__all__ = ["Problem", "SyntheticTask", "GSM8KTask", "ArithTask", "get_task", "task_from_config", "build_tokenizer",
           "build_tiny_vocab_tokenizer", "format_prompt", "TASKS"]
