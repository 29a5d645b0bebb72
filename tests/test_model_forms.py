"""Every entry point takes a model the same way: a hub id found in the local Hugging Face cache
resolves through `models.hub.resolve_model` in train.py, eval.py, simulate, bench.py and distill_mlp.py
(offline: HF_HUB_OFFLINE=1, a hub cache laid out as huggingface_hub writes it)."""
import os
import subprocess
import sys

import pytest

from conftest import ROOT, make_hf_model
from nanospec.tasks import build_tokenizer

HUB_ID = "nanospec-test/tiny-synthetic"


@pytest.fixture(scope="module")
def hub_cache(tmp_path_factory):
    """A hub cache holding HUB_ID: models--<org>--<name>/snapshots/<rev>/ and refs/main -> <rev>."""
    cache = tmp_path_factory.mktemp("hub")
    repo = cache / ("models--" + HUB_ID.replace("/", "--"))
    snap = repo / "snapshots" / "0123abcd"
    tok = build_tokenizer()
    make_hf_model(snap, "llama", vocab_size=len(tok), hidden_size=32, layers=2, max_pos=256)
    tok.save_pretrained(snap)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0123abcd")
    return cache


ENTRY_POINTS = {   # each resolves HUB_ID, then does the least work that uses the model
    "train": ["train.py", f"--model.path={HUB_ID}", "--task.num_train=4", "--task.num_test=0",
              "--grpo.num_steps=1", "--grpo.prompts_per_step=1", "--grpo.num_generations=2",
              "--grpo.max_completion_length=8", "--task.max_steps=1", "--rollout.speculative=null", "--speculation.length_classes=[]"],
    "eval": ["eval.py", "--model", HUB_ID, "--task", "synthetic", "--n", "2", "--k", "0", "--max-tokens", "4"],
    "simulate": ["-m", "tools.simulate", "--lengths", "gsm8k", "--acceptance", "0.4", "--model", HUB_ID,
                 "--hardware", "h100", "--steps", "1", "--prompts", "2", "--G", "2"],
    "bench": ["bench.py", "--suite", "spec", "--quick", "--model", HUB_ID, "--G", "2", "--reps", "1"],
    "distill_mlp": ["distill_mlp.py", "--model", HUB_ID, "--prompts", "1", "--steps", "10"],
}


@pytest.mark.parametrize("entry", ENTRY_POINTS)
def test_every_entry_point_resolves_a_cached_hub_id(hub_cache, entry, tmp_path):
    args = ENTRY_POINTS[entry] + {"train": [f"--run.out_dir={tmp_path / 'run'}"], "bench": ["--out", str(tmp_path)],
                                  "distill_mlp": ["--out", str(tmp_path / "mlp")]}.get(entry, [])
    env = {**os.environ, "HF_HUB_CACHE": str(hub_cache), "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1",
           "NANOSPEC_CACHE": str(tmp_path / "cache")}
    p = subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, (p.stdout + p.stderr)[-3000:]
    out = p.stdout + p.stderr
    assert "not a preset" not in out and "could not provide it" not in out
    if entry == "bench":
        assert f"synthetic task, {HUB_ID}" in out        # the model, not the random fallback
