"""Shared fixtures: tiny random HF models (built with transformers, saved to a temp dir)."""
import os
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
torch.set_num_threads(1)   # tests share 2 cores; 1 thread is faster for tiny models

ARCHS = ("llama", "qwen2", "qwen3")
TORCHRUN = [str(ROOT / ".venv" / "bin" / "torchrun"), "--standalone", "--nproc_per_node=2"]   # 2 ranks, this box


def make_hf_model(path, arch="llama", vocab_size=64, hidden_size=64, layers=2, heads=4, kv_heads=2,
                  max_pos=256, seed=0, tie=None, eos_token_id=None):
    """A tiny random transformers model of the given family, saved to `path`; returns (dir, hf_model)."""
    import transformers as tf
    cls = {"llama": (tf.LlamaConfig, tf.LlamaForCausalLM), "qwen2": (tf.Qwen2Config, tf.Qwen2ForCausalLM),
           "qwen3": (tf.Qwen3Config, tf.Qwen3ForCausalLM)}[arch]
    kw = dict(vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=hidden_size * 2,
              num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
              max_position_embeddings=max_pos, rope_theta=10000.0, eos_token_id=eos_token_id,
              bos_token_id=None, pad_token_id=None,
              tie_word_embeddings=(arch != "llama") if tie is None else tie)
    if arch == "qwen3":
        kw["head_dim"] = 24           # explicit head_dim != hidden/heads, as real Qwen3 configs do
    torch.manual_seed(seed)
    model = cls[1](cls[0](**kw)).eval()
    with torch.no_grad():             # random init is near-uniform; sharpen so greedy/sampling differ
        for p in model.parameters():
            p.mul_(4.0) if p.dim() == 2 else None
    model.save_pretrained(path)
    return str(path), model


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory):
    """{arch: (dir, hf_model)} for the three supported families."""
    return {a: make_hf_model(tmp_path_factory.mktemp(a), a, seed=i) for i, a in enumerate(ARCHS)}


@pytest.fixture(scope="session")
def soak_shared(tmp_path_factory):
    """The embedded default's short SFT model (2 gloo ranks, `soak.RUN`) and a fixed cost model, made once
    for every end-to-end torchrun test (test_faults, test_sharding): each run names this `--sft.out_dir`
    and reuses it by fingerprint, so the session pays for one SFT, not one per test."""
    import subprocess
    from tools.soak import RUN, write_profile
    shared = tmp_path_factory.mktemp("soak")
    write_profile(shared / "profile.json")
    cmd = [*TORCHRUN, "train.py", *RUN, "--sft-only", f"--run.out_dir={shared / 'sft_run'}",
           f"--sft.out_dir={shared / 'sft'}"]
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    return shared
