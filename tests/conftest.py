"""Shared fixtures: tiny random HF models (built with transformers, saved to a temp dir) and the torchrun runs
of the end-to-end tests (`E2E`)."""
import os
import signal
import socket
import subprocess
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


class E2E:
    """The embedded default's short run (`tools.soak.RUN`: 150 SFT steps, 4 GRPO steps, a checkpoint every
    2, every speculation policy on, the repeatable mode) under torchrun, for every end-to-end test
    (test_faults, test_sharding): one SFT model and one fixed cost model per session, reused by each
    launch through `--sft.out_dir` (by fingerprint), and each uninterrupted run made once: test_faults'
    references are test_sharding's replicated runs."""

    def __init__(self, root: Path):
        from tools.soak import write_profile
        self.root, self.runs = root, {}
        write_profile(root / "profile.json")
        self.launch(root / "sft_run", "--sft-only")

    def args(self, out, *extra) -> list[str]:
        """The short run's arguments into `out`, on this session's SFT model and cost model."""
        from tools.soak import RUN
        return [*RUN, f"--run.out_dir={out}", f"--sft.out_dir={self.root / 'sft'}",
                f"--speculation.latency_profile={self.root / 'profile.json'}", *extra]

    def launch(self, out, *extra, fault=None, ok=True, nodes=1, procs=2, script="train.py") -> str:
        """`script` on nodes x procs ranks (nodes > 1: one torchrun per node, c10d rendezvous on this box),
        run into `out`; fault: tools/faults.py kills a rank (NANOSPEC_FAULT). -> the launches' output."""
        args = [*(["-m", "tools.faults"] if fault else []), script, *self.args(out, *extra)]
        run = [str(ROOT / ".venv" / "bin" / "python"), "-m", "torch.distributed.run", f"--nproc_per_node={procs}"]
        if nodes == 1:
            cmds = [[*run, "--standalone", *args]]
        else:
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            cmds = [[*run, f"--nnodes={nodes}", "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}",
                     "--rdzv-id=nanospec-test", *args] for _ in range(nodes)]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "NANOSPEC_FAULT": fault or "",
               "PYTHONPATH": str(ROOT)}                   # a script outside the repo imports nanospec
        ps = [subprocess.Popen(c, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                               start_new_session=True) for c in cmds]
        try:
            logs = [p.communicate(timeout=600)[0] for p in ps]
        finally:                  # a hung launch: its ranks too, not only torchrun, or they outlive the test
            for p in ps:
                if p.poll() is None:
                    os.killpg(p.pid, signal.SIGKILL)
        rcs = [p.returncode for p in ps]
        assert all(rc == 0 for rc in rcs) == ok, f"fault={fault} rc={rcs}\n" + "\n".join(log[-3000:] for log in logs)
        return "\n".join(logs)

    def reference(self, *extra) -> Path:
        """The uninterrupted run with these extra arguments, launched once per session -> its directory."""
        if extra not in self.runs:
            out = self.root / f"ref{len(self.runs)}"
            self.runs[extra] = out, self.launch(out, *extra)
        return self.runs[extra][0]

    def log(self, *extra) -> str:
        return self.runs[extra][1]


@pytest.fixture(scope="session")
def e2e(tmp_path_factory):
    return E2E(tmp_path_factory.mktemp("e2e"))
