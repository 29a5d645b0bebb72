"""Faults: a rank SIGKILLed mid-rollout, mid-optimizer step or mid-save resumes exactly; damaged
checkpoints are skipped, never resumed from; bad input is one line and exit status 2.

The e2e run is the embedded default on 2 gloo ranks (torchrun), shrunk to a short SFT + 4 GRPO
steps, with every speculation policy on, in its repeatable mode: a fixed latency profile in place
of the clock and a token budget for the bubble, the two choices that otherwise follow wall-clock
time (two runs would then draft differently, and a different draft length changes which uniforms a
row draws). In that mode two runs agree on every metric that does not measure time, so a resumed
run must too.
"""
import hashlib
import os
import random
import subprocess

import pytest

from conftest import ROOT, TORCHRUN
from nanospec.config import read_jsonl
from nanospec.rl.checkpoint import list_checkpoints, resume_point, verify_checkpoint
from tools.soak import untimed


def metrics(out) -> list[dict]:
    return [r for _, r in read_jsonl(out / "metrics.jsonl")]


def engine_steps(rec: dict) -> int:
    """A lower bound on every rank's engine steps in a step's rollout (each step is one forward of each
    running sequence, so a rank stepped at least as often as its most-forwarded response): a fault's n
    must not exceed it, or a short rollout (8-token drafts, mostly accepted) ends before the kill."""
    most, G = {}, len(rec["response_forwards"]) // len(rec["prompt_rank"])
    for i, r in enumerate(rec["prompt_rank"]):
        most[r] = max(most.get(r, 0), *rec["response_forwards"][i * G:(i + 1) * G])
    return min(most.get(r, 0) for r in range(len(rec["rank_busy_time"])))


def sha(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


HEAD = ('--rollout.speculative=[{method: prior, num_draft_tokens: 8}, {method: suffix, num_draft_tokens: 8}, '
        '{method: head, num_draft_tokens: 4}]')    # a fresh draft head, trained online (drafters/head.py)


@pytest.mark.slow
@pytest.mark.parametrize("sharding", ["none", "fsdp"])
def test_kill_a_rank_anywhere_and_resume_exactly(e2e, tmp_path, sharding):
    """Replicated with prior+suffix; FSDP with a draft head chained after them (its weights and AdamW
    state are checkpointed beside the policy's: the resumed run's head/loss must match too).
    The repeatable mode is repeatable: the resumed run's steps 0-1 come from another process than the
    reference's, steps 2-3 from a third, and every untimed metric must match."""
    args = [f"--run.sharding={sharding}", *([HEAD] if sharding == "fsdp" else [])]
    ref_dir = e2e.reference(*args)
    log, ref = e2e.log(*args), metrics(ref_dir)
    assert [r["step"] for r in ref] == [0, 1, 2, 3]
    spec = "prior+suffix+head" if sharding == "fsdp" else "prior+suffix"
    assert all(len(r["rank_busy_time"]) == 2 and r["speculative"] == spec for r in ref)
    assert sharding != "fsdp" or all(r["head/positions"] > 0 and "head/loss" in r for r in ref)
    assert "before" in log and "after" in log and "python -m tools.report" in log
    from transformers import AutoModelForCausalLM     # a checkpoint is an ordinary HF model directory
    assert AutoModelForCausalLM.from_pretrained(ref_dir / "checkpoints" / "step_000004").config.model_type == "llama"
    assert sum(r["accepted_tokens"] for r in ref) > 0 and sum(r["bubble_draft_accepted"] for r in ref) > 0
    # one run, killed twice; each relaunch resumes from the last complete checkpoint. The first kill
    # is mid-rollout or mid-optimizer step of step 3 (after the step-2 save), the second mid-save of
    # step 4, after a resume: the soak (tools/soak.py) draws longer sequences of kills.
    seed = random.randrange(10**6)
    rng = random.Random(seed)
    rank = lambda: rng.randrange(2)
    n = min(6, engine_steps(ref[3]))
    faults = [f"rollout:3:{rank()}:{rng.randint(1, n)}" if rng.random() < 0.5 else f"optimizer:3:{rank()}:1",
              f"save:4:0:{rng.randint(1, 3)}" if rng.random() < 0.5 else "save:4:1:1"]
    run = tmp_path / "run"
    for i, fault in enumerate(faults):
        log = e2e.launch(run, *args, *(["--resume"] if i else []), fault=fault, ok=False)
        where = f"seed {seed}, fault {fault}"
        ckpts = list_checkpoints(run)
        assert [c.name for c in ckpts] == ["step_000002"], (where, log[-2000:])
        for c in (run / "checkpoints").iterdir():        # a step_* directory is complete or absent
            if c.name.startswith("step_"):
                verify_checkpoint(c)
    log = e2e.launch(run, *args, "--resume")
    assert "continuing at step 2" in log
    assert [untimed(r) for r in metrics(run)] == [untimed(r) for r in ref], f"seed {seed}, faults {faults}"
    final = lambda d: d / "checkpoints" / "step_000004" / "model.safetensors"
    assert sha(final(run)) == sha(final(ref_dir))


@pytest.mark.slow
def test_off_policy_on_two_ranks_resumes_exactly(e2e, tmp_path):
    """grpo.max_staleness=1 under torchrun: the rollout thread's gathers run in their own process group
    beside the trainer's all-reduces; a rank killed inside the thread's rollout of step 3 (made while
    step 2 trains) resumes from the step-2 checkpoint, which holds that step's rollout made ahead."""
    args = ["--run.sharding=none", "--grpo.max_staleness=1"]
    ref = metrics(e2e.reference(*args))
    assert [r["staleness"] for r in ref] == [0, 1, 1, 1] and all(r["time_overlap"] > 0 for r in ref[:3])
    run = tmp_path / "run"
    fault = f"rollout:3:{random.randrange(2)}:{random.randint(1, min(6, engine_steps(ref[3])))}"
    e2e.launch(run, *args, fault=fault, ok=False)
    assert [c.name for c in list_checkpoints(run)] == ["step_000002"]
    e2e.launch(run, *args, "--resume")
    assert [untimed(r) for r in metrics(run)] == [untimed(r) for r in ref]


@pytest.fixture(scope="module")
def two_checkpoints(tmp_path_factory):
    """A world-1 run of the tiny test model with checkpoints at steps 1 and 2."""
    from test_grpo import tiny_cfg
    from nanospec.rl.grpo import Trainer
    tmp = tmp_path_factory.mktemp("ckpt")
    cfg = tiny_cfg(tmp, run__save_every=1, run__out_dir=str(tmp / "run"),
                   rollout__speculative=[{"method": "prior", "num_draft_tokens": 4},
                                         {"method": "suffix", "num_draft_tokens": 4}])
    Trainer(cfg, log=lambda *a: None).train()
    return cfg, tmp / "run"


@pytest.mark.parametrize("damage", ["truncate", "flip", "manifest"])
def test_resume_falls_back_past_a_damaged_checkpoint(two_checkpoints, tmp_path, damage):
    import shutil
    from nanospec.rl.grpo import Trainer
    cfg, src = two_checkpoints
    run = tmp_path / "run"
    shutil.copytree(src, run)
    bad = run / "checkpoints" / "step_000002"
    f = bad / ("COMPLETE.json" if damage == "manifest" else "model.safetensors")
    data = bytearray(f.read_bytes())
    if damage == "truncate":
        data = data[:len(data) // 2]
    elif damage == "flip":
        data[len(data) // 2] ^= 1
    else:
        data = data[:-5]
    f.write_bytes(bytes(data))
    logs = []
    assert resume_point(run, logs.append, quarantine=False) == run / "checkpoints" / "step_000001"
    assert "falling back to step_000001" in logs[0] and f.name in logs[0]
    cfg.run.out_dir, cfg.run.resume = str(run), True
    logs = []
    tr = Trainer(cfg, log=logs.append)
    assert tr.step == 1 and any("falling back" in line for line in logs)
    assert not bad.exists() and (run / "checkpoints" / "step_000002.corrupt").is_dir()   # kept, set aside
    assert [c.name for c in list_checkpoints(run)] == ["step_000001"]


def test_no_checkpoint_verifies_is_an_error_and_renames_nothing(two_checkpoints, tmp_path):
    import shutil
    _, src = two_checkpoints
    run = tmp_path / "run"
    shutil.copytree(src, run)
    for c in list_checkpoints(run):
        (c / "trainer_state.pt").write_bytes(b"")
    with pytest.raises(ValueError, match=r"no checkpoint.*step_000002.*trainer_state\.pt.*step_000001"):
        resume_point(run)
    assert [c.name for c in list_checkpoints(run)] == ["step_000001", "step_000002"]


@pytest.mark.parametrize("args, message", [
    (["--grpo.epsilon=-0.1"], "grpo.epsilon: expected > 0, got -0.1"),
    (["--config", "nope.yaml"], "config file nope.yaml not found"),
    (["--speculation.latency_profile=nope.json"], "speculation.latency_profile: expected null or an existing"),
    (["--model.path=/nonexistent/model"], "/nonexistent/model"),
])
@pytest.mark.parametrize("launcher", ["python", "torchrun"])
def test_user_errors_are_one_line_and_exit_2(args, message, launcher):
    py = str(ROOT / ".venv" / "bin" / "python")
    cmd = ([py] if launcher == "python" else TORCHRUN) + ["train.py", *args]
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
    ours = [line for line in p.stderr.splitlines() if line.startswith("train.py: error:")]
    assert len(ours) == 1 and message in ours[0], p.stderr[-2000:]
    assert "Traceback" not in p.stderr.split("train.py: error:")[0]
    if launcher == "python":
        assert p.returncode == 2 and p.stderr.strip() == ours[0] and not p.stdout.strip()
    else:        # torchrun reports each rank's exit status 2 after our line, in its own format
        assert p.returncode != 0 and "exitcode  : 2" in p.stderr
