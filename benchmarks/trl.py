"""`bench.py --suite trl`: nanospec and TRL 1.16's GRPOTrainer on the same job, step by step.

The job is a nanospec config (default: the worked example, configs/smollm2_dataset.yaml: its jsonl and
its TRL-shaped reward functions, unchanged). Both trainers get the same model, the same prompts in the
same order (nanospec's `data_permutation`, fed to TRL with its shuffle off), the same samples per prompt,
sampling, loss and optimizer settings. What differs is the engine: nanospec runs 2 gloo ranks x 1
thread with its paged, speculative rollouts; TRL runs one process x 2 threads with `transformers`'
`generate` (how a TRL user trains on a 2-core CPU). Per step: rollout time (TRL: generation + rewards,
`_generate_and_score_completions`), step time, and the task reward (the weighted reward functions of
the config, without the overlong penalty, as nanospec logs it).

TRL is a peer, never a dependency: it lives in its own venv (benchmarks/trl_build.sh), which this
suite runs as a subprocess (`python -m benchmarks.trl --worker ...`, this file):

    bash benchmarks/trl_build.sh
    OMP_NUM_THREADS=1 python bench.py --suite trl --steps 10 [--config configs/smollm2_dataset.yaml]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def trl_python() -> Path:
    from nanospec.models.hub import cache_dir
    return Path(os.environ.get("NANOSPEC_TRL") or cache_dir() / "trl") / "bin" / "python"


def task_reward(cfg, per_function: dict[str, float]) -> float:
    """The config's weighted task reward from per-function means (what nanospec's reward_mean is)."""
    names = [s.split(":")[-1] for s in cfg.task.rewards]
    weights = cfg.task.reward_weights or [1.0] * len(names)
    return sum(w * per_function[n] for n, w in zip(names, weights))


# ---- the TRL side: runs inside the TRL venv -------------------------------------------------------
def trl_dataset_rows(cfg) -> list[dict]:
    """The prompts nanospec's run takes, in its step order (its `data_permutation`, epoch by epoch), as
    TRL's dataset rows: TRL gets them with its shuffle off."""
    from nanospec.rl.grpo import data_permutation
    from nanospec.tasks import task_from_config
    g, task = cfg.grpo, task_from_config(cfg.task)
    pool, n = task.train(cfg.task.num_train), g.num_steps * g.prompts_per_step     # n prompts, in step order
    perms = [data_permutation(cfg.run.seed, epoch, len(pool)) for epoch in range((n - 1) // len(pool) + 1)]
    order = [pool[perms[i // len(pool)][i % len(pool)]] for i in range(n)]
    return [{"prompt": p.messages or [{"role": "user", "content": p.text}], **p.meta["columns"]} for p in order]


def trl_grpo_config(cfg, out: Path, weights: list[float]):
    """nanospec's grpo settings as TRL's GRPOConfig: the same batch, sampling, loss and optimizer, on the CPU."""
    from trl import GRPOConfig
    g = cfg.grpo
    return GRPOConfig(
        output_dir=str(out / "trl"), max_steps=g.num_steps, seed=cfg.run.seed, shuffle_dataset=False,
        per_device_train_batch_size=g.prompts_per_step * g.num_generations, num_generations=g.num_generations,
        gradient_accumulation_steps=g.gradient_accumulation_steps, num_iterations=g.num_iterations,
        max_completion_length=g.max_completion_length, temperature=g.temperature, top_p=g.top_p,
        top_k=max(g.top_k, 0), learning_rate=g.learning_rate, weight_decay=g.weight_decay,
        lr_scheduler_type="constant_with_warmup", warmup_steps=g.warmup_steps,
        max_grad_norm=g.max_grad_norm or 0.0, beta=g.beta, epsilon=g.epsilon, epsilon_high=g.epsilon_high,
        loss_type=g.loss_type, scale_rewards="group" if g.scale_rewards else "none",
        mask_truncated_completions=g.mask_truncated_completions, reward_weights=weights,
        logging_steps=1, report_to="none", save_strategy="no", use_cpu=True, bf16=False)


def run_trl(config: str, overrides: list[str], out: Path, threads: int) -> None:
    """TRL's GRPOTrainer on the nanospec config's job; one json line per step in out/trl_metrics.jsonl."""
    import torch
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOTrainer
    from trl.rewards import get_soft_overlong_punishment

    from nanospec.config import load_config
    from nanospec.models.hub import resolve_model
    from nanospec.tasks.rewards import load_reward

    torch.set_num_threads(threads)
    cfg = load_config(config, overrides)
    g = cfg.grpo
    rows = trl_dataset_rows(cfg)
    funcs = [load_reward(s, "task.rewards") for s in cfg.task.rewards]
    weights = list(cfg.task.reward_weights or [1.0] * len(funcs))
    if g.overlong_buffer:       # nanospec's grpo.overlong_buffer is TRL's DAPO reward function
        funcs.append(get_soft_overlong_punishment(g.max_completion_length, g.overlong_buffer))
        weights.append(g.overlong_penalty)
    args = trl_grpo_config(cfg, out, weights)

    class Timed(GRPOTrainer):
        rollout_s = 0.0

        def _generate_and_score_completions(self, inputs):
            t0 = time.perf_counter()
            out = super()._generate_and_score_completions(inputs)
            self.rollout_s = time.perf_counter() - t0
            return out

    class Log(TrainerCallback):
        def on_step_begin(self, *a, **k):
            self.t0 = time.perf_counter()

        def on_step_end(self, *a, **k):
            self.step_s = time.perf_counter() - self.t0

        def on_log(self, _args, state, _control, logs=None, **k):
            if logs is None or "reward" not in logs:
                return
            per_fn = {n.split("/")[1]: v for n, v in logs.items() if n.startswith("rewards/") and n.endswith("/mean")}
            rec = {"step": state.global_step - 1, "time_rollout": trainer.rollout_s, "time_step": self.step_s,
                   "reward_mean": task_reward(cfg, per_fn), "response_len_mean": logs["completions/mean_length"],
                   "clipped_ratio": logs["completions/clipped_ratio"]}
            with open(out / "trl_metrics.jsonl", "a") as f:
                f.write(json.dumps(rec) + "\n")

    trainer = Timed(model=str(resolve_model(cfg.model.path)), reward_funcs=funcs, args=args,
                    train_dataset=Dataset.from_list(rows), callbacks=[Log()])
    trainer.train()


# ---- the suite: runs in nanospec's venv -----------------------------------------------------------
def run(args) -> list[dict]:
    ap = argparse.ArgumentParser(prog="bench.py --suite trl")
    ap.add_argument("--config", default="configs/smollm2_dataset.yaml")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--set", nargs="*", default=[], metavar="SECTION.KEY=VALUE",
                    help="more config overrides, applied to both trainers")
    opts = ap.parse_args(args.extra)
    if args.quick:      # a smoke run: 2 small steps
        opts.steps, opts.set = 2, ["--grpo.prompts_per_step=2", "--grpo.num_generations=2",
                                   "--grpo.max_completion_length=24", "--grpo.overlong_buffer=8", *opts.set]
    from nanospec.config import load_config
    if load_config(opts.config, opts.set).task.name != "dataset":
        print(f"[trl] {opts.config}: expected a config with task.name: dataset (data + reward functions TRL takes)")
        return []
    py = trl_python()
    if not py.is_file():
        print(f"[trl] no TRL venv at {py.parent.parent}: run `bash benchmarks/trl_build.sh` (or set NANOSPEC_TRL)")
        return []
    out = Path(args.out) / "trl"
    if out.exists():
        import shutil
        shutil.rmtree(out)
    out.mkdir(parents=True)
    # no eval (task.num_test=0), no tensorboard: the two runs time the same work
    overrides = [f"--grpo.num_steps={opts.steps}", f"--run.seed={opts.seed}", "--task.num_test=0", "--run.log_to=[jsonl]",
                 *opts.set]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    walls = {}
    for name, cmd in (
            ("nanospec", [str(Path(sys.executable).parent / "torchrun"), "--standalone", "--nproc_per_node=2",
                          "train.py", "--config", opts.config, f"--run.out_dir={out / 'nanospec'}", *overrides]),
            ("TRL", [str(py), "-m", "benchmarks.trl", "--worker", opts.config, str(out), str(args.threads), *overrides])):
        t0 = time.perf_counter()
        p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
        walls[name] = time.perf_counter() - t0
        (out / f"{name}.log").write_text(p.stdout + p.stderr)
        if p.returncode:
            print(f"[trl] {name} failed (exit {p.returncode}); last lines of {out / f'{name}.log'}:\n"
                  + "\n".join((p.stdout + p.stderr).splitlines()[-15:]))
            return []
    from tools.report import load_metrics
    ours, theirs = load_metrics(str(out / "nanospec" / "metrics.jsonl")), load_metrics(str(out / "trl_metrics.jsonl"))
    rows = []
    for a, b in zip(ours, theirs):
        rows.append({"name": f"step {a['step']}", "nanospec rollout s": a["time_rollout"], "TRL rollout s": b["time_rollout"],
                     "nanospec step s": a["time_step"], "TRL step s": b["time_step"],
                     "nanospec reward": a["reward_mean"], "TRL reward": b["reward_mean"],
                     "nanospec length": a["response_len_mean"], "TRL length": b["response_len_mean"],
                     "speedup": b["time_step"] / a["time_step"], "lossy": False})
    total = lambda runs, k: sum(r[k] for r in runs)
    rows.append({"name": f"all {len(rows)} steps", "nanospec rollout s": total(ours, "time_rollout"),
                 "TRL rollout s": total(theirs, "time_rollout"), "nanospec step s": total(ours, "time_step"),
                 "TRL step s": total(theirs, "time_step"), "speedup": total(theirs, "time_step") / total(ours, "time_step"),
                 "lossy": False, "wall s (nanospec / TRL)": f"{walls['nanospec']:.0f} / {walls['TRL']:.0f}"})
    return rows


if __name__ == "__main__" and sys.argv[1:2] == ["--worker"]:
    config, out, threads, *overrides = sys.argv[2:]
    run_trl(config, overrides, Path(out), int(threads))
