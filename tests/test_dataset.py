"""The dataset task: a TRL-layout jsonl + TRL-shaped reward functions defined here train with
speculative rollouts by config alone; TensorBoard curves; eval.py on the same task; every bad input
is one line and exit 2 with nothing half-written; the task's loading, splits and reward plumbing."""
import importlib.util
import json
import math
import os
import subprocess
import sys

import pytest
import yaml

from conftest import ROOT, make_hf_model
from nanospec.config import config_from_dict
from tools.report import load_metrics
from nanospec.tasks import DatasetTask, RewardError, build_tiny_vocab_tokenizer, score

OFF = {"bubble_drafting": False, "length_aware_assignment": False, "length_classes": [], "toggle": False,
       "adaptive_draft_length": False}
CALLS = []      # what the reward functions below were called with
BREVITY = []    # what brevity returned, call by call


# ---- reward functions, as a TRL user writes them --------------------------------------------------
def exact_sum(prompts, completions, answer, **kwargs):
    """1.0 when the completion's last word is the answer (plain or conversational completions)."""
    CALLS.append({"prompts": prompts, "completions": completions, "answer": answer, **kwargs})
    texts = [c[0]["content"] if isinstance(c, list) else c for c in completions]
    return [float(t.split()[-1:] == [str(a)]) for t, a in zip(texts, answer)]


def brevity(prompts, completions, completion_ids, kind, **kwargs):
    """-0.01 per token, where it applies (None on rows of kind 'free')."""
    BREVITY.append([None if k == "free" else -0.01 * len(ids) for ids, k in zip(completion_ids, kind)])
    return BREVITY[-1]


def wrong_length(prompts, completions, **kwargs):
    return [0.0] * (len(completions) + 1)


def raises_on_seven(prompts, completions, answer, **kwargs):
    return [1.0 / (a - 7) for a in answer]


def not_finite(prompts, completions, answer, **kwargs):
    return [math.nan if a == 9 else 0.0 for a in answer]


# ---- a TRL-layout dataset and a tiny model that can read it ------------------------------------------
def rows(n=24):
    """`prompt` as chat messages (system + user), `answer` an int column, `kind` a string column."""
    out = []
    for i in range(n):
        a, b = i % 10, (3 * i + 1) % 10
        out.append({"prompt": [{"role": "system", "content": "add"}, {"role": "user", "content": f"{a} {b} ?"}],
                    "answer": a + b, "kind": "free" if i % 3 == 0 else "short"})
    return out


def write_jsonl(path, data):
    path.write_text("".join(json.dumps(r) + "\n" for r in data))
    return path


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """(data.jsonl, model dir) with a word-level chat tokenizer over the rows' words."""
    d = tmp_path_factory.mktemp("dataset")
    data = write_jsonl(d / "data.jsonl", rows())
    tok = build_tiny_vocab_tokenizer(["add", "?"] + [str(i) for i in range(19)])
    make_hf_model(d / "model", "llama", vocab_size=len(tok), hidden_size=64, layers=2, max_pos=128)
    tok.save_pretrained(d / "model")
    return data, d / "model"


def raw_cfg(data, model, out, **task):
    return {"model": {"path": str(model)},
            "task": {"name": "dataset", "dataset": str(data), "rewards": ["test_dataset:exact_sum"],
                     "test_split": None, "num_train": 16, "num_test": 0, **task},
            "grpo": {"num_steps": 2, "prompts_per_step": 2, "num_generations": 4, "max_completion_length": 12},
            "rollout": {"speculative": [{"method": "suffix", "num_draft_tokens": 4}], "max_num_seqs": 16},
            "speculation": dict(OFF), "run": {"out_dir": str(out)}}


@pytest.fixture(scope="module")
def trained(setup, tmp_path_factory):
    """A 2-step run on the TRL-layout jsonl with two reward functions, logging to TensorBoard."""
    from nanospec.rl.grpo import Trainer
    data, model = setup
    out = tmp_path_factory.mktemp("run") / "run"
    raw = raw_cfg(data, model, out, rewards=["test_dataset:exact_sum", "test_dataset:brevity"],
                  reward_weights=[1.0, 0.5], num_test=4)
    raw["run"]["log_to"] = ["jsonl", "tensorboard"]
    CALLS.clear()
    BREVITY.clear()
    Trainer(config_from_dict(raw), log=lambda *a: None).train()
    return out, load_metrics(str(out / "metrics.jsonl")), list(CALLS)


def test_trl_layout_trains_with_speculative_rollouts(trained):
    out, recs, calls = trained
    assert [r["step"] for r in recs] == [0, 1]
    for r in recs:
        assert 0 <= r["reward/exact_sum"] <= 1 and -0.13 <= r["reward/brevity"] < 0
        assert r["speculative"] == "suffix" and r["mismatch/mean_abs"] < 1e-5
    assert recs[1]["drafter/suffix/proposed"] > 0               # the rollouts did speculate
    # reward/<name> is the mean where the function applies: its None rows are left out, not counted as 0
    steps = BREVITY[2:4]                                        # eval greedy, eval samples, then steps 0, 1
    assert any(None in vals for vals in steps), steps
    for r, vals in zip(recs, steps):
        applies = [v for v in vals if v is not None]
        assert r["reward/brevity"] == pytest.approx(sum(applies) / len(applies))
    # TRL's calling convention: conversational prompts/completions, the other columns as keywords
    assert [len(c["completions"]) for c in calls[:3]] == [4, 16, 8]   # eval: greedy, 4 samples; step 0
    c = calls[2]                                                       # this rank's samples, in one call
    assert c["prompts"][0][0] == {"role": "system", "content": "add"} and c["prompts"][0][1]["role"] == "user"
    assert all(x[0]["role"] == "assistant" and isinstance(x[0]["content"], str) for x in c["completions"])
    assert set(c) == {"prompts", "completions", "answer", "kind", "completion_ids"}
    assert all(isinstance(a, int) for a in c["answer"]) and all(isinstance(i, list) for i in c["completion_ids"])
    assert len(c["answer"]) == len(c["kind"]) == len(c["completion_ids"]) == 8
    assert "eval/accuracy" in recs[1]


def test_tensorboard_event_file_holds_the_reward_curve(trained):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    out, recs, _ = trained
    ev = EventAccumulator(str(out / "tensorboard"))
    ev.Reload()
    for key in ("reward_mean", "reward/exact_sum", "reward/brevity", "tokens_per_s"):
        got = [(e.step, e.value) for e in ev.Scalars(key)]
        assert got == [(r["step"], pytest.approx(r[key], rel=1e-6)) for r in recs], key
    assert "rank_busy_time" not in ev.Tags()["scalars"]           # lists stay in metrics.jsonl


def test_eval_takes_the_dataset_task_and_rewards(setup, tmp_path):
    spec = importlib.util.spec_from_file_location("nanospec_eval", ROOT / "eval.py")
    ev = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ev)
    data, model = setup
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(yaml.safe_dump(raw_cfg(data, model, tmp_path / "run", rewards=[
        "test_dataset:exact_sum", "test_dataset:brevity"])))
    res = ev.main(["--model", str(model), "--config", str(cfg), "--n", "4", "--k", "2", "--threads", "1"])
    assert res["task"] == "dataset" and res["n"] == 4 and res["greedy_identical"] is True
    assert 0 <= res["reward/exact_sum@1"] <= 1 and res["reward/brevity@1"] < 0 and "mean@2" in res


# ---- bad input: one line, exit 2, nothing half-written -------------------------------------------------
BAD = {
    "missing column": (dict(prompt="{question} ?"), r"task\.prompt: column 'question' not in .*data\.jsonl"),
    "no such module": (dict(rewards=["no_such_module:f"]), r"task\.rewards\[0\]: cannot import module 'no_such_module'"),
    "no such function": (dict(rewards=["test_dataset:nope"]), r"task\.rewards\[0\]: module 'test_dataset' has no function 'nope'"),
    "wrong length": (dict(rewards=["test_dataset:wrong_length"]), r"reward wrong_length: returned 9 values for 8 completions"),
    "raises": (dict(rewards=["test_dataset:raises_on_seven"]),
               r"reward raises_on_seven: raised ZeroDivisionError: (?:float )?division by zero on .*data\.jsonl train row (\d+)$"),
    "not finite": (dict(rewards=["test_dataset:not_finite"]), r"reward not_finite: returned nan for .*train row (\d+);"),
    "empty dataset": (dict(dataset="EMPTY"), r"task\.dataset: .*empty\.jsonl has no rows"),
    "prompt too long": (dict(dataset="LONG"), r"task: the prompt of .*long\.jsonl train row \d+ has \d+ tokens; the model's max_model_len"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_input_is_one_line_exit_2_nothing_written(case, setup, tmp_path, capsys):
    import re
    import train
    data, model = setup
    task, pattern = dict(BAD[case][0]), BAD[case][1]
    if task.get("dataset") == "EMPTY":
        task["dataset"] = str(write_jsonl(tmp_path / "empty.jsonl", []))
    elif task.get("dataset") == "LONG":
        long = [dict(r, prompt=[{"role": "user", "content": " ".join(["1"] * 200)}]) for r in rows(6)]
        task["dataset"] = str(write_jsonl(tmp_path / "long.jsonl", long))
    if case in ("raises", "not finite"):    # rows the first step surely draws
        task["dataset"] = str(write_jsonl(tmp_path / "data.jsonl", [dict(r, answer=7 if case == "raises" else 9)
                                                                    if i % 2 else r for i, r in enumerate(rows())]))
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(yaml.safe_dump(raw_cfg(data, model, tmp_path / "run", **task)))
    capsys.readouterr()
    assert train.main(["--config", str(cfg)]) == 2
    err = capsys.readouterr().err
    ours = [line for line in err.splitlines() if "error" in line.lower()]
    assert len(ours) == 1 and ours[0].startswith("train.py: error: ") and "Traceback" not in err, err
    m = re.search(pattern, ours[0])
    assert m, ours[0]
    if m.groups():           # the row it names is one the reward fails on
        bad = json.loads((tmp_path / "data.jsonl").read_text().splitlines()[int(m.group(1))])
        assert bad["answer"] in (7, 9)
    run = tmp_path / "run"
    assert not (run / "checkpoints").exists() and not (run / "tensorboard").exists()
    assert not (run / "metrics.jsonl").exists() or (run / "metrics.jsonl").read_text() == ""


def test_reward_error_exits_2_from_the_command_line(setup, tmp_path):
    data, model = setup
    bad = write_jsonl(tmp_path / "data.jsonl", [dict(r, answer=7) for r in rows()])
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(yaml.safe_dump(raw_cfg(bad, model, tmp_path / "run", rewards=["test_dataset:raises_on_seven"])))
    p = subprocess.run([sys.executable, "train.py", "--config", str(cfg)], cwd=ROOT, capture_output=True, text=True,
                       timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1",
                                         "PYTHONPATH": str(ROOT / "tests")})
    ours = [line for line in p.stderr.splitlines() if line.startswith("train.py: error:")]
    assert p.returncode == 2 and len(ours) == 1 and "raises_on_seven" in ours[0], p.stderr[-2000:]
    assert "Traceback" not in p.stderr


# ---- the task itself -----------------------------------------------------------------------------------
def test_template_prompt_columns_and_weights(tmp_path):
    """A format template over the columns; every column reaches the rewards; weights and None."""
    data = write_jsonl(tmp_path / "q.jsonl", [{"question": f"q{i}", "answer": i, "kind": "free" if i % 2 else "x"}
                                              for i in range(10)])
    task = DatasetTask(str(data), prompt="Q: {question}!", test_split=None, test_fraction=0.3,
                       rewards=["test_dataset:exact_sum", "test_dataset:brevity"], reward_weights=[2.0, 1.0])
    train, test = task.train(), task.test()
    assert (len(train), len(test)) == (7, 3) and not {p.prompt for p in train} & {p.prompt for p in test}
    assert task.train(3) == train[:3] and DatasetTask(str(data), prompt="Q: {question}!", test_split=None,
                                                      test_fraction=0.3, rewards=["test_dataset:exact_sum"]).test() == test
    p = train[0]
    assert p.prompt == f"Q: {p.meta['columns']['question']}!" and p.messages is None
    CALLS.clear()
    texts = [f"it is {q.meta['columns']['answer']}" for q in train]
    total, correct, parts = score(task, train, texts, [[1, 2, 3]] * len(train))
    assert CALLS[0]["prompts"] == [q.prompt for q in train] and CALLS[0]["completions"] == texts   # plain text
    assert set(CALLS[0]) == {"prompts", "completions", "answer", "question", "kind", "completion_ids"}
    assert all(correct) and parts["exact_sum"] == [1.0] * 7
    assert parts["brevity"] == [None if q.meta["columns"]["kind"] == "free" else -0.03 for q in train]
    assert total == [2.0 + (0.0 if b is None else b) for b in parts["brevity"]]


def test_folder_splits_parquet_csv_and_split_errors(tmp_path):
    import datasets
    folder = tmp_path / "mine"
    folder.mkdir()
    write_jsonl(folder / "train.jsonl", [{"prompt": f"p{i}", "answer": i} for i in range(5)])
    write_jsonl(folder / "test.jsonl", [{"prompt": f"t{i}", "answer": i} for i in range(2)])
    task = DatasetTask(str(folder), rewards=["test_dataset:exact_sum"])
    assert sorted(p.prompt for p in task.test()) == ["t0", "t1"] and len(task.train()) == 5
    assert task.train()[0].meta["columns"] == {"answer": task.train()[0].meta["index"]}
    ds = datasets.Dataset.from_list([{"prompt": "a", "answer": 1}, {"prompt": "b", "answer": 2}])
    ds.to_parquet(str(tmp_path / "d.parquet"))
    ds.to_csv(str(tmp_path / "d.csv"), index=False)
    for f in ("d.parquet", "d.csv"):
        t = DatasetTask(str(tmp_path / f), rewards=["test_dataset:exact_sum"], test_split=None, test_fraction=0.5)
        assert len(t.train()) == len(t.test()) == 1, f
    with pytest.raises(ValueError, match=r"task\.test_split: expected a split of .*d\.csv \(train\) or null"):
        DatasetTask(str(tmp_path / "d.csv"), rewards=["test_dataset:exact_sum"]).train()
    one = DatasetTask(str(write_jsonl(tmp_path / "one.jsonl", [{"prompt": "a", "answer": 1}])), rewards=["test_dataset:exact_sum"],
                      test_split=None)
    assert len(one.train()) == 1
    with pytest.raises(ValueError, match=r"task\.test_fraction: the seeded cut of 0\.2 of .*one\.jsonl's 1 rows leaves no test"):
        one.test()
    with pytest.raises(FileNotFoundError, match=r"task\.dataset: .*nowhere\.jsonl not found"):
        DatasetTask(str(tmp_path / "nowhere.jsonl"), rewards=["test_dataset:exact_sum"]).train()
    (tmp_path / "bad.jsonl").write_text('{"prompt": "a"}\n{not json\n')
    with pytest.raises(ValueError, match=r"task\.dataset: cannot load .*bad\.jsonl: JSON parse error"):
        DatasetTask(str(tmp_path / "bad.jsonl"), rewards=["test_dataset:exact_sum"]).train()
    write_jsonl(tmp_path / "num.jsonl", [{"prompt": 3, "answer": 1}])
    with pytest.raises(ValueError, match=r"task\.prompt: column 'prompt' of .*num\.jsonl train row 0 is '3'"):
        DatasetTask(str(tmp_path / "num.jsonl"), rewards=["test_dataset:exact_sum"], test_split=None,
                    test_fraction=0.0).train()


def test_reward_errors_name_function_and_row(tmp_path):
    data = write_jsonl(tmp_path / "r.jsonl", [{"prompt": f"p{i}", "answer": 7 if i == 2 else i} for i in range(4)])
    make = lambda fn: DatasetTask(str(data), rewards=[f"test_dataset:{fn}"], test_split=None, test_fraction=0.0)
    probs = sorted(make("raises_on_seven").train(), key=lambda p: p.meta["index"])
    with pytest.raises(RewardError, match=r"^reward raises_on_seven: raised ZeroDivisionError: (float )?division by zero "
                                          r"on .*r\.jsonl train row 2$"):
        score(make("raises_on_seven"), probs, ["x"] * 4)
    with pytest.raises(RewardError, match=r"^reward wrong_length: returned 5 values for 4 completions"):
        score(make("wrong_length"), probs, ["x"] * 4)
    write_jsonl(tmp_path / "na.jsonl", [{"prompt": "p", "solution": 1}] * 3)
    with pytest.raises(ValueError, match=r"task\.rewards\[0\]: exact_sum takes column 'answer', not in .*na\.jsonl "
                                         r"split 'train' \(columns: solution\)"):
        DatasetTask(str(tmp_path / "na.jsonl"), rewards=["test_dataset:exact_sum"], test_split=None).train()
    with pytest.raises(ValueError, match=r"task\.reward_weights: expected 1 weights"):
        DatasetTask(str(data), rewards=["test_dataset:exact_sum"], reward_weights=[1.0, 2.0])
    with pytest.raises(ValueError, match=r"task\.rewards\[1\]: expected 'module\.path:function', got 'exact_sum'"):
        DatasetTask(str(data), rewards=["test_dataset:exact_sum", "exact_sum"])


def test_tensorboard_asked_for_but_missing_is_one_config_line(monkeypatch):
    import importlib.util
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "tensorboard" else real(name, *a))
    with pytest.raises(ValueError, match=r"run\.log_to: expected no tensorboard without the tensorboard package "
                                         r"\(pip install tensorboard\), got \['jsonl', 'tensorboard'\]"):
        config_from_dict({"run": {"log_to": ["jsonl", "tensorboard"]}})
    assert config_from_dict({"run": {"log_to": ["jsonl"]}}).run.log_to == ["jsonl"]
