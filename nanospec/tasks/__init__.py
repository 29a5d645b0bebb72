"""Verifiable tasks behind one interface, so the trainer and eval treat them alike:

    task.train(n) / task.test(n) / task.sample(split, n, seed) -> list[Problem]
    score(task, problems, completion_texts) -> (rewards, correct, {reward function: values})
    task.sft_text(problem, rng, error_rate) -> target completion text   (tasks that make their problems)

Two kinds: `dataset` (dataset.py) reads the user's rows and scores them with TRL-shaped reward
functions (rewards.py); `synthetic` and `arith` generate their own problems and score one completion
at a time (`task.reward(problem, text)`, `task.is_correct(...)`). A new task is its class plus one line
in config.TASKS (name -> import path); the config knobs it reads are its constructor's parameters.

Prompts become token ids with `format_prompt(tokenizer, problem.messages or problem.prompt)` (chat
template + generation prompt); completions are scored after `tokenizer.decode(ids, skip_special_tokens=True)`.
"""
import importlib
import inspect

from nanospec.config import TASKS
from nanospec.tasks.arith import ArithTask
from nanospec.tasks.dataset import DatasetTask, gsm8k_task
from nanospec.tasks.rewards import RewardError
from nanospec.tasks.synthetic import Problem, SyntheticTask
from nanospec.tasks.tokenizer import build_tiny_vocab_tokenizer, build_tokenizer, format_prompt, longest_prompt

def task_class(name: str) -> type:
    """The class config.TASKS names for `name`."""
    if name not in TASKS:
        raise ValueError(f"task.name: unknown task {name!r}; expected one of {sorted(TASKS)}")
    module, cls = TASKS[name].split(":")
    return getattr(importlib.import_module(module), cls)


def get_task(name: str, **kw):
    """A task by name (config.TASKS), built with the class's keyword arguments."""
    return task_class(name)(**kw)


def task_from_config(tc):
    """The task of a `task` config section (config.TaskConfig): the knobs its constructor takes."""
    params = inspect.signature(task_class(tc.name)).parameters
    return get_task(tc.name, **{k: getattr(tc, k) for k in params if hasattr(tc, k)})


def score(task, problems: list[Problem], texts: list[str], completion_ids: list | None = None):
    """(reward per completion, correct per completion, {reward function: values}) of `texts`, the
    completions of `problems`. Raises RewardError (one line) for a misbehaving reward function."""
    if hasattr(task, "score"):
        return task.score(problems, texts, completion_ids)
    return ([task.reward(p, t) for p, t in zip(problems, texts)],
            [task.is_correct(p, t) for p, t in zip(problems, texts)], {})


__all__ = ["Problem", "SyntheticTask", "ArithTask", "DatasetTask", "RewardError", "get_task", "gsm8k_task",
           "task_from_config", "score", "build_tokenizer", "build_tiny_vocab_tokenizer", "format_prompt",
           "longest_prompt", "task_class"]
