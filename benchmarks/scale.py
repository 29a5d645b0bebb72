"""Memory per rank, replicated vs FSDP2 (run.sharding), on 2 gloo ranks of this machine.

    python bench.py --suite scale [--params 0.8e9] [--steps 2] [--max-tokens 16] [--skip-smollm2]

1. SmolLM2-135M-Instruct (configs/smollm2_arith.yaml, short): run.sharding none vs fsdp, the latter at
   rollout.sleep_level 1 and 2. Peak RSS per rank (ru_maxrss, model loading included) and the training
   state each rank holds (parameters, gradients, AdamW moments: the trainer's `rank_train_state_gib`
   metric) in bytes per parameter.
2. A random model of SmolLM2-1.7B's width (hidden 2048, MLP 8192, 32 heads, SmolLM2's tokenizer)
   with as many layers as give >= --params parameters, under fsdp with rollout.sleep_level 2 (the
   engine's weights freed while training): --steps GRPO steps of --max-tokens completions. Its
   replicated state (~16 bytes per parameter per rank, x2 ranks) is what this suite exists to avoid;
   at 0.8B it needs ~20 GiB in all: run it only where that is free.
Each run is a torchrun of train.py; rows come from its metrics.jsonl. No speedups: memory only.
"""
import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SMOL = "HuggingFaceTB/SmolLM2-135M-Instruct"
WIDE = dict(hidden_size=2048, intermediate_size=8192, num_heads=32, num_kv_heads=32, head_dim=64)   # SmolLM2-1.7B


def parse(extra) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="bench.py --suite scale")
    ap.add_argument("--params", type=float, default=0.8e9, help="parameters of the random model (>= this)")
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=16, help="completion length")
    ap.add_argument("--skip-smollm2", action="store_true", help="only the random model")
    return ap.parse_args(extra)


def random_model(params: float, out: Path) -> tuple[Path, int]:
    """An HF directory: SmolLM2's tokenizer, SmolLM2-1.7B's layer shape, random (GPT-2 init) weights."""
    import torch
    from transformers import AutoTokenizer
    from nanospec.models.decoder import CausalLM, ModelArgs
    from nanospec.models.hub import resolve_model
    from nanospec.models.loader import read_args, save_model
    from nanospec.rl.sft import init_weights
    smol = resolve_model(SMOL)
    tok, base = AutoTokenizer.from_pretrained(smol), read_args(smol)
    D, F = WIDE["hidden_size"], WIDE["intermediate_size"]
    per_layer, embed = 4 * D * D + 3 * D * F + 2 * D, base.vocab_size * D
    layers = max(1, math.ceil((params - embed) / per_layer))
    args = ModelArgs(arch="llama", vocab_size=base.vocab_size, num_layers=layers, tie_word_embeddings=True,
                     rms_norm_eps=base.rms_norm_eps, rope_theta=base.rope_theta, max_position_embeddings=2048,
                     bos_token_id=base.bos_token_id, eos_token_id=base.eos_token_id,
                     pad_token_id=base.pad_token_id, **WIDE)
    torch.manual_seed(0)
    with torch.no_grad():
        model = init_weights(CausalLM(args))
    n = sum(p.numel() for p in model.parameters())
    save_model(model, out, tok)
    return out, n


def train(run: Path, *extra) -> list[dict]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "train.py",
           "--config", "configs/smollm2_arith.yaml", f"--run.out_dir={run}", "--task.num_test=0",
           "--grpo.prompts_per_step=2", "--grpo.num_generations=4", "--rollout.kv_cache_gib=0.25", *extra]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=env)
    if p.returncode != 0:
        raise SystemExit(f"bench scale: {' '.join(cmd)} failed:\n{p.stdout[-2000:]}{p.stderr[-3000:]}")
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]


def row(name, recs, params, sharding, sleep) -> dict:
    rss = [max(r["rank_peak_rss_gib"][i] for r in recs) for i in range(2)]
    state = [max(r["rank_train_state_gib"][i] for r in recs) for i in range(2)]
    return dict(name=name, sharding=sharding, sleep_level=sleep, params_M=params / 1e6, steps=len(recs),
                peak_rss_gib_rank0=rss[0], peak_rss_gib_rank1=rss[1],
                train_state_gib_per_rank=max(state), train_state_bytes_per_param=max(state) * 2**30 / params,
                step_s=sum(r["time_step"] for r in recs) / len(recs))


def run(args) -> list[dict]:
    a = parse(args.extra)
    rows, short = [], [f"--grpo.num_steps={a.steps}", f"--grpo.max_completion_length={a.max_tokens}",
                       "--grpo.overlong_buffer=0"]           # the config's 32 needs 128-token completions
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        if not a.skip_smollm2:
            from nanospec.models.loader import read_args
            from nanospec.models.hub import resolve_model
            import torch
            from nanospec.models.decoder import CausalLM
            with torch.device("meta"):
                n = sum(p.numel() for p in CausalLM(read_args(resolve_model(SMOL))).parameters())
            for sh, sleep in (("none", 1), ("fsdp", 1), ("fsdp", 2)):
                recs = train(tmp / f"smol_{sh}{sleep}", *short, f"--run.sharding={sh}", f"--rollout.sleep_level={sleep}")
                rows.append(row(f"SmolLM2-135M {sh}" + (" sleep 2" if sleep == 2 else ""), recs, n, sh, sleep))
        model, n = random_model(a.params, tmp / "random")
        recs = train(tmp / "random_run", *short, f"--model.path={model}", "--run.sharding=fsdp",
                     "--rollout.sleep_level=2")
        rows.append(row(f"random {n / 1e9:.2f}B fsdp", recs, n, "fsdp", 2))
    return rows
