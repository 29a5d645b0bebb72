"""End to end: the embedded default on 2 gloo ranks (torchrun), shrunk to a tiny SFT + 3 GRPO steps;
its checkpoint loads in transformers, and resuming from a mid-run checkpoint reproduces the next step.

The toggle and bubble drafting are off here: both react to wall-clock timings, so with them on the
*drafts* (never the sampled distribution) differ from run to run, and drafts decide how many of the
sampler's uniforms a step consumes. Everything else of the default (prior+suffix drafters, length-
aware assignment, length classes, ladder, TIS) stays on.
"""
import json
import os
import shutil
import subprocess

import pytest

from conftest import ROOT

TORCHRUN = [str(ROOT / ".venv" / "bin" / "torchrun"), "--standalone", "--nproc_per_node=2"]
SMALL = ["--sft.steps=24", "--sft.batch_size=16", "--grpo.num_steps=3", "--grpo.prompts_per_step=4",
         "--grpo.num_generations=4", "--task.num_test=8", "--task.num_train=64", "--run.save_every=2",
         "--speculation.toggle=false", "--speculation.bubble_drafting=false"]
STABLE = ("reward_mean", "reward_std", "accuracy", "response_len_mean", "response_len_p50", "response_len_max",
          "loss", "grad_norm", "target_forwards_per_token", "mean_accepted_len", "mismatch/mean_abs")


def train(tmp_path, out, *extra):
    cmd = TORCHRUN + ["train.py", "--config", "configs/default.yaml", f"--run.out_dir={out}",
                      f"--sft.out_dir={tmp_path / 'sft'}", *SMALL, *extra]
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    return p.stdout, [json.loads(l) for l in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_default_two_ranks_checkpoint_and_resume(tmp_path):
    out, recs = train(tmp_path, tmp_path / "a")
    assert [r["step"] for r in recs] == [0, 1, 2]
    assert all(len(r["rank_busy_time"]) == 2 and r["speculative"] == "prior+suffix" for r in recs)
    assert "before" in out and "after" in out and "python -m nanospec.rl.report" in out
    ck = tmp_path / "a" / "checkpoints"
    assert sorted(p.name for p in ck.iterdir()) == ["step_000002", "step_000003"]
    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(ck / "step_000003")
    assert hf.config.model_type == "llama"

    (tmp_path / "b" / "checkpoints").mkdir(parents=True)          # "killed" after step 2's checkpoint
    shutil.copytree(ck / "step_000002", tmp_path / "b" / "checkpoints" / "step_000002")
    out_b, recs_b = train(tmp_path, tmp_path / "b", "--resume")
    assert "reusing" in out_b and "continuing at step 2" in out_b
    assert [r["step"] for r in recs_b] == [2]
    for key in STABLE:
        assert recs_b[0][key] == pytest.approx(recs[2][key], abs=1e-6), key
