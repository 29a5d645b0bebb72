"""Reward functions for examples/word_problems.jsonl, in TRL's shape: `f(prompts, completions, **columns)`.

The same data file and functions run in nanospec (configs/smollm2_dataset.yaml) and in TRL's
GRPOTrainer, unchanged (this file imports neither):

    from datasets import load_dataset
    from trl import GRPOConfig, GRPOTrainer
    from examples.rewards import correct_number, states_number
    data = load_dataset("json", data_files="examples/word_problems.jsonl")["train"]
    GRPOTrainer("HuggingFaceTB/SmolLM2-135M-Instruct", reward_funcs=[correct_number, states_number],
                args=GRPOConfig(reward_weights=[1.0, 0.1]), train_dataset=data).train()

The rows are conversational (`prompt` is a list of messages), so each completion is the one assistant
message [{"role": "assistant", "content": text}]; `answer` is the dataset's other column.
"""
import re

_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def _text(completion) -> str:
    return completion[-1]["content"] if isinstance(completion, list) else completion


def final_number(text: str) -> float | None:
    """The first number after the last '####', else the last number of the text, else None."""
    tail = text.rsplit("####", 1)[1] if "####" in text else text
    nums = _NUMBER.findall(tail)
    if not nums:
        return None
    return float((nums[0] if "####" in text else nums[-1]).replace(",", ""))


def correct_number(prompts, completions, answer, **kwargs) -> list[float]:
    """1.0 when the completion's final number is the answer, else 0.0 (the verifier)."""
    out = []
    for completion, want in zip(completions, answer):
        got = final_number(_text(completion))
        out.append(float(got is not None and abs(got - float(want)) < 1e-6))
    return out


def states_number(prompts, completions, **kwargs) -> list[float]:
    """1.0 when the completion states a number after '####' (the answer format), else 0.0: a little
    signal for a weak policy, weighted 0.1 beside correct_number."""
    return [float(bool(re.search(r"####\s*-?\d", _text(c)))) for c in completions]
