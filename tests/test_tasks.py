"""Tasks: synthetic running sums (determinism, splits, length tail, reward, SFT slips), tokenizer, GSM8K."""
import json
import random

import numpy as np
import pytest

from nanospec.tasks import (GSM8KTask, SyntheticTask, build_tiny_vocab_tokenizer, build_tokenizer, format_prompt, get_task)
from nanospec.tasks.gsm8k import default_data_dir, extract_answer
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


@pytest.fixture(scope="module")
def gsm8k():
    if not (default_data_dir() / "train.jsonl").is_file():
        pytest.skip(f"no local GSM8K copy at {default_data_dir()}")
    return GSM8KTask()


def test_gsm8k_loads_real_file(gsm8k):
    rows = gsm8k.rows("train")
    assert len(rows) == 7473 and len(gsm8k.rows("test")) == 1319
    assert rows[0]["question"].startswith("Natalia sold clips")
    first = gsm8k.make_problem(rows[0], 0, "train")
    assert first.answer == "72" and first.prompt.startswith("Natalia") and "####" in first.prompt
    assert gsm8k.reward(first, gsm8k.sft_text(first, random.Random(0))) == 1.0
    assert gsm8k.reward(first, gsm8k.sft_text(first, random.Random(0), error_rate=1.0)) == 0.0
    ps = gsm8k.train(5)
    assert [p.meta["index"] for p in ps] == [p.meta["index"] for p in GSM8KTask().train(5)]
    assert all(gsm8k.reward(p, p.meta["solution"]) == 1.0 for p in ps)
    tok = build_tiny_vocab_tokenizer(first.prompt.split())       # chat-template prompt, any tokenizer
    assert tok.unk_token_id not in format_prompt(tok, first.prompt)


@pytest.mark.parametrize("text,want", [
    ("so the answer is 72.", 72), ("#### 1,234", 1234), ("It costs $1,000.50 in total", 1000.5),
    ("#### $18.00 dollars", 18), ("#### 72\nthen 99", 72), ("3 then 4", 4), ("down to -5", -5),
    ("nothing here", None), ("", None), (None, None)])
def test_gsm8k_answer_extraction(text, want):
    assert extract_answer(text) == want


def test_gsm8k_reward_parsing(gsm8k):
    p = gsm8k.make_problem({"question": "q?", "answer": "a\n#### 1,200"}, 0, "test")
    assert p.answer == "1200"
    for ok in ["The total is $1,200.", "#### 1200", "#### 1200.00", "1,200"]:
        assert gsm8k.is_correct(p, ok) and gsm8k.reward(p, ok) == 1.0, ok
    for bad in ["#### 120", "1200 then 5", "", "no number", None]:
        assert gsm8k.reward(p, bad) == 0.0, bad


def test_gsm8k_clear_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"nowhere.*train\.jsonl"):
        GSM8KTask(data_path=tmp_path / "nowhere").train(3)
    good = json.dumps({"question": "q", "answer": "so #### 3"}) + "\n"
    (tmp_path / "train.jsonl").write_text(good + "\n" + json.dumps({"question": "q", "answer": "no final marker"}) + "\n")
    with pytest.raises(ValueError, match=r"train\.jsonl: line 3 is malformed.*####"):
        GSM8KTask(data_path=tmp_path).train(1)
    (tmp_path / "test.jsonl").write_text(good * 4 + "{not json\n")
    with pytest.raises(ValueError, match=r"test\.jsonl: line 5: invalid JSON"):
        GSM8KTask(data_path=tmp_path).test(1)


def test_gsm8k_data_dir_env(monkeypatch, tmp_path):
    monkeypatch.setenv("NANOSPEC_DATA", str(tmp_path))
    assert default_data_dir() == tmp_path / "gsm8k"
    (tmp_path / "gsm8k").mkdir()
    (tmp_path / "gsm8k" / "test.jsonl").write_text(json.dumps({"question": "1+1?", "answer": "#### 2"}) + "\n")
    assert [p.answer for p in GSM8KTask().test()] == ["2"]


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
