"""Tasks: synthetic running sums (determinism, splits, length tail, reward, SFT slips), tokenizer, GSM8K."""
import json
import random
from pathlib import Path

import numpy as np
import pytest

from nanospec.tasks import (SyntheticTask, build_tiny_vocab_tokenizer, build_tokenizer, format_prompt, get_task,
                            gsm8k_task, score, task_from_config)
from nanospec.tasks.dataset import default_gsm8k_dir
from nanospec.tasks.rewards import extract_answer, gsm8k_answer

INSTRUCTION = "Solve step by step, then give the final number after '####'."
from nanospec.tasks.synthetic import VOCAB


@pytest.fixture(scope="module")
def task():
    return SyntheticTask(seed=0)


def test_problem_structure(task):
    p = task.make_problem([3, 7, 2])
    assert p.prompt == "a 3 b 7 c 2 ?" and p.answer == "2"
    assert p.steps == [("a", 3, 3), ("b", 7, 0), ("c", 2, 2)]
    assert task.format_steps(p.steps) == "a 3 3 ; b 7 0 ; c 2 2 ; = 2"
    assert SyntheticTask(modulus=5).make_problem([3, 4]).answer == "2"


def test_determinism_by_seed(task):
    a, b = task.train(200), SyntheticTask(seed=0).train(200)
    assert [p.prompt for p in a] == [p.prompt for p in b]
    assert [p.prompt for p in task.train(50)] == [p.prompt for p in a[:50]]        # prefix-stable
    assert [p.prompt for p in SyntheticTask(seed=1).train(200)] != [p.prompt for p in a]
    assert [p.prompt for p in task.sample("train", 200, seed=1)] == [p.prompt for p in SyntheticTask(seed=1).train(200)]
    with pytest.raises(ValueError, match="split"):
        task.sample("val", 3)


def test_splits_disjoint(task):
    train, test = {p.prompt for p in task.train(3000)}, {p.prompt for p in task.test(1000)}
    assert not train & test
    assert len(test) > 300 and any(p.meta["k"] == 1 for p in task.test(200))      # short prompts in both


def test_length_distribution_is_long_tailed(task):
    lens = np.array([len(task.format_steps(p.steps).split()) for p in task.train(4000)])
    med, p90 = np.median(lens), np.percentile(lens, 90)
    assert 14 <= med <= 22, med                  # zipf_alpha 1.0: median 18, p90 74, max 106
    assert p90 >= 3.5 * med, (med, p90)
    assert lens.max() >= 5 * med and lens.max() <= task.max_response_tokens == 106


def test_reward_correct_partial_garbage(task):
    p = task.make_problem([3, 7, 2, 5])                  # sums 3 0 2 7
    good = "a 3 3 ; b 7 0 ; c 2 2 ; d 5 7 ; = 7"
    assert task.reward(p, good) == 1.0 and task.is_correct(p, good)
    assert task.reward(p, "  " + good.replace(" ", "  ") + "\n") == 1.0         # whitespace-robust
    # one arithmetic slip at step b, carried on consistently: 3 of 4 steps right, final wrong
    slip = "a 3 3 ; b 7 1 ; c 2 3 ; d 5 8 ; = 8"
    assert task.reward(p, slip) == pytest.approx(0.5 * 3 / 4) and not task.is_correct(p, slip)
    # right answer, wrong working: partial, not correct
    assert task.reward(p, "a 3 3 ; = 7") == pytest.approx(0.5 + 0.5 * 1 / 4)
    assert not task.is_correct(p, "a 3 3 ; = 7")
    # truncated (no answer yet) and too many steps
    assert task.reward(p, "a 3 3 ; b 7 0 ; c 2") == pytest.approx(0.5 * 2 / 4)
    assert task.reward(p, good[:-4] + "e 1 8 ; = 7") == pytest.approx(0.5 + 0.5 * 4 / 5)
    for junk in ["", "garbage", "= = ;;", "☃ ² ; = ²", None, 17, "a a a a ; = x", good + " ; extra"]:
        r = task.reward(p, junk)
        assert 0.0 <= r < 1.0 and not task.is_correct(p, junk)
    assert task.reward(p, "garbage") == 0.0


def test_sft_traces_error_rate(task):
    probs, rng = task.train(3000), random.Random(0)
    assert all(task.is_correct(p, task.sft_text(p, rng)) for p in probs[:300])  # error_rate 0: all exact
    texts = [task.sft_text(p, rng, error_rate=0.3) for p in probs]
    bad = [t for p, t in zip(probs, texts) if not task.is_correct(p, t)]
    assert abs(len(bad) / len(probs) - 0.3) < 0.04
    rewards = [task.reward(p, t) for p, t in zip(probs, texts) if not task.is_correct(p, t)]
    assert 0 < np.mean(rewards) < 1                     # imperfect traces still earn partial credit
    assert set(" ".join(bad).split()) <= set(VOCAB)
    with pytest.raises(ValueError, match="error_rate"):
        task.sft_text(probs[0], rng, error_rate=1.5)


def test_task_knob_validation():
    with pytest.raises(ValueError, match="max_steps"):
        SyntheticTask(max_steps=27)
    with pytest.raises(ValueError, match="modulus"):
        SyntheticTask(modulus=11)
    with pytest.raises(ValueError, match="unknown task"):
        get_task("mnist")
    assert isinstance(get_task("synthetic", seed=3), SyntheticTask)


def test_tokenizer_roundtrip_chat_template_save_load(task, tmp_path):
    from transformers import AutoTokenizer
    tok = build_tokenizer()
    assert len(tok) < 100 and tok.pad_token_id == 0 and tok.bos_token_id != tok.eos_token_id
    p = task.train(20)[-1]
    ids = format_prompt(tok, p.prompt)
    assert ids[0] == tok.bos_token_id and tok.convert_ids_to_tokens(ids[-1]) == "<assistant>"
    assert tok.unk_token_id not in ids
    completion = task.format_steps(p.steps)
    cids = tok.encode(completion, add_special_tokens=False) + [tok.eos_token_id]
    assert len(cids) == 4 * len(p.steps) + 3 and tok.unk_token_id not in cids
    text = tok.decode(cids, skip_special_tokens=True)
    assert text == completion and task.reward(p, text) == 1.0
    tok.save_pretrained(tmp_path)
    tok2 = AutoTokenizer.from_pretrained(tmp_path)
    assert format_prompt(tok2, p.prompt) == ids and tok2.decode(cids, skip_special_tokens=True) == completion
    chat = tok2.apply_chat_template([{"role": "user", "content": "a 1 ?"}, {"role": "assistant", "content": "a 1 1 ; = 1"}],
                                    tokenize=False)
    assert chat == "<s><user> a 1 ? <assistant> a 1 1 ; = 1 </s>"


def test_tiny_vocab_tokenizer(tmp_path):
    from transformers import AutoTokenizer
    words = ["w0", "w1", "w2", "w3", "w4", "w5", "w6", "w7"]
    tok = build_tiny_vocab_tokenizer(words)
    assert len(tok) == 8 + 7 and tok.convert_tokens_to_ids("w0") == 7
    tok.save_pretrained(tmp_path)
    tok = AutoTokenizer.from_pretrained(tmp_path)
    ids = format_prompt(tok, "w3 w1")
    assert tok.decode(ids[2:-1]) == "w3 w1"
    assert tok.encode("w9", add_special_tokens=False) == [tok.unk_token_id]
    with pytest.raises(ValueError, match="whitespace"):
        build_tiny_vocab_tokenizer(["ok", "two words"])


GSM8K = default_gsm8k_dir()


@pytest.fixture(scope="module")
def gsm8k():
    if not (GSM8K / "train.jsonl").is_file():
        pytest.skip(f"no local GSM8K copy at {GSM8K}")
    return gsm8k_task()


def test_gsm8k_dataset_task_keeps_rows_order_and_rewards(gsm8k):
    """GSM8K moved onto the dataset task: the same prompts, in the same seeded order as the
    hand-written reader it replaced (re-derived here from the raw lines), and the '####' reward
    gives 1 to every reference solution and 0 to an off-by-one final number."""
    for split, n in (("train", 7473), ("test", 1319)):
        raw = [json.loads(l) for l in (GSM8K / f"{split}.jsonl").read_text().splitlines() if l.strip()]
        assert len(raw) == n and len(gsm8k.rows(split)) == n
        order = list(range(n))
        random.Random(f"nanospec-gsm8k/0/{split}").shuffle(order)     # the old reader's order
        got = gsm8k.sample(split, 300)
        assert [p.prompt for p in got] == [f"{raw[i]['question'].strip()}\n{INSTRUCTION}" for i in order[:300]]
        assert [p.meta["index"] for p in got] == order[:300] and got[0].messages is None
        answers = [p.meta["columns"]["answer"] for p in got]
        rewards, correct, parts = score(gsm8k, got, answers)
        assert rewards == [1.0] * 300 and all(correct) and parts == {"gsm8k_answer": rewards}
        off = [a.rsplit("####", 1)[0] + f"#### {int(extract_answer(a)) + 1}" for a in answers]
        assert score(gsm8k, got, off)[0] == [0.0] * 300
    assert gsm8k.sample("test", 5, seed=1) != gsm8k.test(5) and gsm8k.test(5) == gsm8k_task().test(5)
    tok = build_tiny_vocab_tokenizer(got[0].prompt.split())       # chat-template prompt, any tokenizer
    assert tok.unk_token_id not in format_prompt(tok, got[0].prompt)
    # configs/gsm8k_qwen3.yaml spells out the same task
    from nanospec.config import load_config
    cfg = load_config(Path(__file__).resolve().parents[1] / "configs" / "gsm8k_qwen3.yaml",
                      [f"--task.dataset={GSM8K}"])
    same = task_from_config(cfg.task)
    assert [p.prompt for p in same.test(50)] == [p.prompt for p in gsm8k.test(50)]
    assert same.rewards.fns == gsm8k.rewards.fns


@pytest.mark.parametrize("text,want", [
    ("so the answer is 72.", 72), ("#### 1,234", 1234), ("It costs $1,000.50 in total", 1000.5),
    ("#### $18.00 dollars", 18), ("#### 72\nthen 99", 72), ("3 then 4", 4), ("down to -5", -5),
    ("nothing here", None), ("", None), (None, None)])
def test_gsm8k_answer_extraction(text, want):
    assert extract_answer(text) == want


def test_gsm8k_reward_parsing():
    for ok in ["The total is $1,200.", "#### 1200", "#### 1200.00", "1,200"]:
        assert gsm8k_answer(["q?"], [ok], answer=["a\n#### 1,200"]) == [1.0], ok
        assert gsm8k_answer([[{"role": "user", "content": "q?"}]], [[{"role": "assistant", "content": ok}]],
                            answer=["#### 1200"]) == [1.0], ok
    for bad in ["#### 120", "1200 then 5", "", "no number"]:
        assert gsm8k_answer(["q?"], [bad], answer=["a\n#### 1,200"]) == [0.0], bad
    assert gsm8k_answer(["q?"], ["#### 3"], answer=["no number stated"]) == [None]   # does not apply


def test_gsm8k_data_dir_env(monkeypatch, tmp_path):
    monkeypatch.setenv("NANOSPEC_DATA", str(tmp_path))
    assert default_gsm8k_dir() == tmp_path / "gsm8k"
    (tmp_path / "gsm8k").mkdir()
    for split in ("train", "test"):
        (tmp_path / "gsm8k" / f"{split}.jsonl").write_text(json.dumps({"question": "1+1?", "answer": "#### 2"}) + "\n")
    p, = gsm8k_task().test()
    assert p.prompt == f"1+1?\n{INSTRUCTION}" and score(gsm8k_task(), [p], ["#### 2"])[0] == [1.0]


def test_arith_word_problems_reward_split_and_tail():
    """`arith`: running totals in words, GSM8K's '#### N' format with partial credit, disjoint splits,
    a heavy tail of operations, and reference solutions that score 1."""
    from nanospec.tasks import ArithTask
    task = get_task("arith", seed=0)
    train, test = task.train(300), task.test(100)
    assert not {p.prompt for p in train} & {p.prompt for p in test}
    assert task.train(50) == train[:50]                                   # prefix-stable in n
    ks = [p.meta["k"] for p in train]
    assert ks.count(1) > len(ks) / 3 and max(ks) >= 5                     # mostly short, some long
    p = train[0]
    assert p.prompt.endswith("Give the final number after '####'.") and int(p.answer) == p.steps[-1]
    assert all(task.reward(q, task.sft_text(q, random.Random(0))) == 1.0 for q in train[:50])
    wrong = str(int(p.answer) + 1)
    assert task.reward(p, f"so #### {p.answer}") == 1.0 and task.is_correct(p, f"so #### {p.answer}")
    assert task.reward(p, f"so #### {wrong}") == task.format_credit == 0.1
    assert task.reward(p, f"the answer is {p.answer}") == 1.0               # no '####': the last number
    assert task.reward(p, f"the answer is {wrong}") == 0.0
    assert task.reward(p, "#### none") == 0.0
    with pytest.raises(ValueError, match="task.format_credit"):
        ArithTask(format_credit=1.5)
