"""Any dataset `datasets.load_dataset` reads, with TRL-shaped reward functions: a user's own task.

    task: {name: dataset, dataset: data/mine.jsonl, prompt: prompt, rewards: [my_rewards:correct]}

Why this shape: it is what TRL's GRPOTrainer takes (a dataset with a prompt column + `reward_funcs`),
so a TRL user's data and reward functions run here unchanged, with speculative rollouts.
  - `dataset`: a local json/jsonl/parquet/csv file, a folder of them (splits from the file names,
    e.g. train.jsonl/test.jsonl), or a hub id with `dataset_config`.
  - `prompt`: a column holding a string (one user turn) or a conversational list of {"role",
    "content"} messages (rendered by the tokenizer's chat template as they are), or a Python format
    template over the columns ("{question}\\nGive the final number after '####'.").
  - Every other column reaches the reward functions as a keyword argument (rewards.py).
  - Splits: `train_split` and `test_split` by name, or (test_split null) a seeded, disjoint cut of
    `test_fraction` of the train split.
A string prompt becomes one user turn of the chat template, as every nanospec task's prompt does
(TRL would feed it raw); the reward functions see the string itself either way.

Sampling order: rows shuffled by (the dataset's name -- its file or folder stem --, seed, split),
prefix-stable in n, so `test(32)` names the same 32 rows every time. For GSM8K (folder `gsm8k`) this
is the order of the hand-written reader this task replaced, so earlier GSM8K figures stay comparable.
"""
from __future__ import annotations

import json
import logging
import os
import random
import string
from pathlib import Path

from nanospec.tasks.rewards import Rewards
from nanospec.tasks.synthetic import Problem, Splits

BUILDERS = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".csv": "csv"}
GSM8K_PROMPT = "{question}\nSolve step by step, then give the final number after '####'."


def default_gsm8k_dir() -> Path:
    """$NANOSPEC_DATA/gsm8k if set, else the `shared/data/gsm8k` folder beside the repo checkout."""
    if os.environ.get("NANOSPEC_DATA"):
        return Path(os.environ["NANOSPEC_DATA"]) / "gsm8k"
    return Path(__file__).resolve().parents[3] / "shared" / "data" / "gsm8k"


def gsm8k_task(path=None, seed: int = 0) -> "DatasetTask":
    """GSM8K's official jsonl files (a folder with train.jsonl/test.jsonl) as a dataset task; the
    same task as configs/gsm8k_qwen3.yaml's `task` section."""
    return DatasetTask(str(path or default_gsm8k_dir()), prompt=GSM8K_PROMPT,
                       rewards=["nanospec.tasks.rewards:gsm8k_answer"], seed=seed)


def _load(source: str, config: str | None) -> dict[str, list[dict]]:
    """{split: rows} of a local file/folder or a hub dataset, or one ValueError line naming it."""
    import datasets
    p = Path(source).expanduser()
    local = p.exists() or p.suffix in BUILDERS or source.startswith((".", "/", "~"))
    if local and not p.exists():
        raise FileNotFoundError(f"task.dataset: {source} not found (a json/jsonl/parquet/csv file or folder, "
                                f"or a hub id)")
    if p.is_file() and p.suffix not in BUILDERS:
        raise ValueError(f"task.dataset: {source}: expected a file ending in one of {sorted(BUILDERS)}")
    quiet = [logging.getLogger(n) for n in ("datasets", "huggingface_hub")]   # our one line, not their logs
    levels = [q.level for q in quiet]
    for q in quiet:
        q.setLevel(logging.CRITICAL)
    datasets.disable_progress_bars()
    try:
        dd = (datasets.load_dataset(BUILDERS[p.suffix], data_files=str(p)) if p.is_file()
              else datasets.load_dataset(str(p) if local else source, config))
    except StopIteration:     # what datasets raises on an empty json file
        raise ValueError(f"task.dataset: {source} has no rows") from None
    except Exception as e:
        cause = e.__cause__ or e
        msg = (str(cause).strip().splitlines() or [type(cause).__name__])[0]
        raise ValueError(f"task.dataset: cannot load {source}: {msg}") from None
    finally:
        for q, level in zip(quiet, levels):
            q.setLevel(level)
    return {name: split.to_list() for name, split in dd.items()}


class DatasetTask(Splits):
    name = "dataset"

    def __init__(self, dataset: str, prompt: str = "prompt", rewards: list[str] = (),
                 reward_weights: list[float] | None = None, dataset_config: str | None = None,
                 train_split: str = "train", test_split: str | None = "test", test_fraction: float = 0.2,
                 seed: int = 0):
        if not dataset:
            raise ValueError("task.dataset: expected a json/jsonl/parquet/csv file or folder, or a hub id, got None")
        self.source, self.config, self.prompt, self.seed = str(dataset), dataset_config, prompt, seed
        self.splits, self.test_fraction = (train_split, test_split), test_fraction
        self.rewards = Rewards(list(rewards), reward_weights)     # imports them: a typo fails here
        self.template = "{" in prompt
        self.fields = {f.split(".")[0].split("[")[0] for _, f, _, _ in string.Formatter().parse(prompt) if f} \
            if self.template else {prompt}
        self._rows: dict[str, list[tuple[int, dict]]] | None = None

    # ---- rows -----------------------------------------------------------------------------------
    def rows(self, split: str) -> list[tuple[int, dict]]:
        """(row index in its source split, row) of `split` ("train" | "test")."""
        if split not in ("train", "test"):
            raise ValueError(f"split must be 'train' or 'test', got {split!r}")
        if self._rows is None:
            self._rows = self._split(_load(self.source, self.config))
        if not self._rows[split]:
            train, test = self.splits
            raise ValueError(f"task.dataset: {self.source} split {(test if split == 'test' else train)!r} has no rows"
                             if split == "train" or test is not None else
                             f"task.test_fraction: the seeded cut of {self.test_fraction} of {self.source}'s "
                             f"{len(self._rows['train'])} rows leaves no test rows")
        return self._rows[split]

    def _split(self, data: dict[str, list[dict]]) -> dict[str, list[tuple[int, dict]]]:
        train, test = self.splits
        for key, name in (("train_split", train), ("test_split", test)):
            if name is not None and name not in data:
                raise ValueError(f"task.{key}: expected a split of {self.source} ({', '.join(data)})"
                                 + (" or null (a seeded cut of the train split)" if key == "test_split" else "")
                                 + f", got {name!r}")
        out = {"train": list(enumerate(data[train]))}
        if test is not None:
            out["test"] = list(enumerate(data[test]))
        else:   # a seeded, disjoint cut; indices stay those of the train split
            order = list(range(len(out["train"])))
            random.Random(f"nanospec-{self.stem}/{self.seed}/cut").shuffle(order)
            cut = int(len(order) * self.test_fraction)
            out = {"test": [out["train"][i] for i in sorted(order[:cut])],
                   "train": [out["train"][i] for i in sorted(order[cut:])]}
        for split, rows in out.items():
            name = test if split == "test" and test is not None else train
            have = set(rows[0][1]) if rows else None
            missing = self.fields - have if rows else set()
            if missing:
                raise ValueError(f"task.prompt: column {sorted(missing)[0]!r} not in {self.source} split {name!r} "
                                 f"(columns: {', '.join(rows[0][1])})")
            for i, (fn, cols) in enumerate(zip(self.rewards.names, self.rewards.columns)):
                gone = [c for c in cols if rows and (c not in have or (c == self.prompt and not self.template))]
                if gone:
                    raise ValueError(f"task.rewards[{i}]: {fn} takes column {gone[0]!r}, not in {self.source} split "
                                     f"{name!r} (columns: {', '.join(k for k in have if k != self.prompt)})")
        return out

    @property
    def stem(self) -> str:
        return Path(self.source.rstrip("/")).stem

    # ---- problems -------------------------------------------------------------------------------
    def make_problem(self, index: int, row: dict, split: str) -> Problem:
        where = f"{self.source} {split} row {index}"
        if self.template:
            text, messages, columns = self.prompt.format(**row), None, dict(row)
        else:
            value, columns = row[self.prompt], {k: v for k, v in row.items() if k != self.prompt}
            if isinstance(value, str):
                text, messages = value, None
            elif (isinstance(value, list) and value
                  and all(isinstance(m, dict) and isinstance(m.get("content"), str) and m.get("role") for m in value)):
                messages = [{"role": m["role"], "content": m["content"]} for m in value]
                text = json.dumps(messages)   # a hashable key (rollout caches, drafters' prompt keys)
            else:
                raise ValueError(f"task.prompt: column {self.prompt!r} of {where} is {str(value)[:80]!r}; "
                                 f"expected a string or a list of {{role, content}} messages")
        return Problem(text, "", [], {"index": index, "split": split, "row": where, "columns": columns}, messages)

    def sample(self, split: str, n: int | None = None, seed: int | None = None) -> list[Problem]:
        """n problems (None: all) of `split`, shuffled by (dataset name, seed, split); prefix-stable in n."""
        rows = self.rows(split)
        order = list(range(len(rows)))
        random.Random(f"nanospec-{self.stem}/{self.seed if seed is None else seed}/{split}").shuffle(order)
        return [self.make_problem(*rows[i], split) for i in order[:n]]

    # ---- rewards --------------------------------------------------------------------------------
    def score(self, problems: list[Problem], texts: list[str], completion_ids: list | None = None):
        """(weighted rewards, correct, {function: values}) of completions `texts` of `problems`.
        Correct: the first reward function, the verifier, gives 1 (later ones shape)."""
        chat = [p.messages is not None for p in problems]
        prompts = [p.messages if c else p.prompt for p, c in zip(problems, chat)]
        completions = [[{"role": "assistant", "content": t}] if c else t for t, c in zip(texts, chat)]
        keys = dict.fromkeys(k for p in problems for k in p.meta["columns"])
        columns = {k: [p.meta["columns"].get(k) for p in problems] for k in keys}
        total, parts = self.rewards(prompts, completions, columns, [p.meta["row"] for p in problems],
                                    completion_ids)
        first = parts[self.rewards.names[0]]
        return total, [v is not None and v >= 1.0 for v in first], parts
