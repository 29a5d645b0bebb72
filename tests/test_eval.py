"""eval.py: pass@1 / mean@k / lengths / AR-vs-speculative report, on a model dir, a run dir and GSM8K rows."""
import importlib.util
import json
from pathlib import Path

import pytest

from conftest import ROOT, make_hf_model
from nanospec.rl.checkpoint import save_checkpoint
from nanospec.config import config_from_dict, save_config
from nanospec.models.loader import load_model
from nanospec.tasks import build_tiny_vocab_tokenizer, build_tokenizer
from nanospec.tasks.dataset import GSM8K_PROMPT

spec = importlib.util.spec_from_file_location("nanospec_eval", ROOT / "eval.py")
ev = importlib.util.module_from_spec(spec)
spec.loader.exec_module(ev)

KEYS = {"model", "task", "n", "pass@1", "reward@1", "mean@2", "reward_mean@2", "response_len_mean",
        "response_len_p50", "response_len_max", "speculative", "ar_seconds", "spec_seconds", "speedup",
        "ar_tokens_per_s", "spec_tokens_per_s", "target_forwards_per_token", "mean_accepted_len",
        "greedy_identical", "lossy"}
GSM8K = Path(__file__).resolve().parents[2] / "shared" / "data" / "gsm8k"


@pytest.fixture(scope="module")
def synthetic_model(tmp_path_factory):
    d = tmp_path_factory.mktemp("synth")
    tok = build_tokenizer()
    make_hf_model(d, "llama", vocab_size=len(tok), hidden_size=64, layers=2, max_pos=128)
    tok.save_pretrained(d)
    return d, tok


def check(res, n):
    assert KEYS <= set(res), sorted(KEYS - set(res))
    assert res["n"] == n and 0 <= res["pass@1"] <= 1 and 0 <= res["mean@2"] <= 1
    assert res["greedy_identical"] is True and res["lossy"] is False
    assert res["response_len_p50"] <= res["response_len_max"] and res["target_forwards_per_token"] > 0


def test_eval_model_dir_synthetic(synthetic_model, tmp_path):
    d, _ = synthetic_model
    out = tmp_path / "eval.json"
    res = ev.main(["--model", str(d), "--task", "synthetic", "--n", "6", "--k", "2", "--max-tokens", "20",
                   "--threads", "1", "--out", str(out)])
    check(res, 6)
    assert json.loads(out.read_text())["pass@1"] == res["pass@1"]
    assert res["speculative"] == ev.DEFAULT_SPEC


def test_eval_run_dir_uses_latest_checkpoint_and_run_config(synthetic_model, tmp_path):
    d, tok = synthetic_model
    run = tmp_path / "run"
    cfg = config_from_dict({"model": {"path": str(d)}, "task": {"max_steps": 3},
                            "grpo": {"max_completion_length": 16},
                            "rollout": {"speculative": {"method": "ngram", "num_draft_tokens": 3}}})
    save_config(cfg, run / "config.yaml")
    model = load_model(d)
    for step in (1, 2):
        save_checkpoint(run, step, model, tok, {"step": step}, {})
    res = ev.main(["--model", str(run), "--n", "4", "--k", "2", "--threads", "1"])
    check(res, 4)
    assert res["model"].endswith("step_000002") and res["speculative"]["method"] == "ngram"
    assert res["response_len_max"] <= 16
    # the run's config takes --section.key=value overrides, as train.py; a bad one is one line, exit 2
    res = ev.main(["--model", str(run), "--n", "4", "--k", "0", "--threads", "1", "--task.max_steps=1",
                   "--grpo.max_completion_length=8",
                   "--rollout.speculative={method: suffix, num_draft_tokens: 2}"])
    assert res["response_len_max"] <= 8 and res["speculative"]["method"] == "suffix"
    for bad in ("--grpo.max_completion_lenght=6", "--stray"):
        with pytest.raises(SystemExit) as e:
            ev.main(["--model", str(run), "--n", "2", "--k", "0", bad])
        assert e.value.code == 2
    (run / "checkpoints" / "step_000002" / "config.json").write_text("{}")
    with pytest.raises(ValueError, match="config.json"):
        ev.main(["--model", str(run), "--n", "2", "--k", "0", "--threads", "1"])


def gsm8k_rows(tmp_path, n=4):
    """A data folder with the first n official test rows as both splits, and a word-level tokenizer
    covering them (each whitespace-separated word one token, like the embedded task's)."""
    rows = [json.loads(l) for l in (GSM8K / "test.jsonl").read_text().splitlines()[:n]]
    data = tmp_path / "gsm8k"
    data.mkdir()
    for split in ("train", "test"):
        (data / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    words = [w for r in rows for w in (GSM8K_PROMPT.format(**r) + " " + r["answer"]).split()]
    return data, build_tiny_vocab_tokenizer(words + [str(i) for i in range(10)] + ["####"])


def tiny_qwen3_on_gsm8k(tmp_path):
    """A few GSM8K rows, a chat-template tokenizer over their words, a tiny random Qwen3 dir using it."""
    data, tok = gsm8k_rows(tmp_path)
    d = tmp_path / "qwen3"
    make_hf_model(d, "qwen3", vocab_size=len(tok), hidden_size=64, layers=2, max_pos=512)
    tok.save_pretrained(d)
    return data, tok, d


@pytest.mark.skipif(not (GSM8K / "test.jsonl").is_file(), reason="no local GSM8K copy")
def test_eval_gsm8k_rows_tiny_qwen3(tmp_path):
    data, tok, d = tiny_qwen3_on_gsm8k(tmp_path)
    res = ev.main(["--model", str(d), "--task", "gsm8k", "--data", str(data / "test.jsonl"), "--n", "4",
                   "--k", "2", "--max-tokens", "12", "--threads", "1"])
    check(res, 4)
    assert res["task"] == "gsm8k" and res["pass@1"] * 4 == round(res["pass@1"] * 4)


@pytest.mark.skipif(not (GSM8K / "test.jsonl").is_file(), reason="no local GSM8K copy")
def test_gsm8k_config_trains_one_step_tiny_qwen3(tmp_path):
    """configs/gsm8k_qwen3.yaml plumbing on CPU: GSM8K rows, a chat-template tokenizer, Qwen3 layout."""
    from nanospec.config import load_config
    from nanospec.rl.grpo import Trainer
    from tools.report import load_metrics
    data, tok, d = tiny_qwen3_on_gsm8k(tmp_path)
    run = tmp_path / "run"
    cfg = load_config(ROOT / "configs" / "gsm8k_qwen3.yaml", [
        f"--model.path={d}", f"--task.dataset={data}", "--task.num_train=4", "--task.num_test=2",
        "--grpo.num_steps=1", "--grpo.prompts_per_step=2", "--grpo.num_generations=2",
        "--grpo.max_completion_length=12", "--rollout.dtype=float32", "--rollout.device=cpu",
        "--rollout.use_cuda_graphs=false", "--rollout.max_num_seqs=8", f"--run.out_dir={run}",
        "--speculation.toggle=false"])
    assert cfg.grpo.gradient_accumulation_steps == 4 and cfg.task.name == "dataset"
    out = Trainer(cfg, log=lambda *a: None).train()
    rec, = load_metrics(str(run / "metrics.jsonl"))
    assert rec["mismatch/mean_abs"] < 1e-5 and rec["response_len_max"] <= 12 and 0 <= rec["accuracy"] <= 1
    assert out["eval_after"]["eval/n"] == 2 and (run / "checkpoints" / "step_000001" / "COMPLETE.json").is_file()
