"""Evaluate a model (or a training run's latest checkpoint) on a task, with and without speculation.

    python eval.py --model runs/default --task synthetic [--n 256] [--k 4]
    python eval.py --model /path/to/Qwen3 --task gsm8k --data /path/to/gsm8k --n 100
    python eval.py --model runs/smollm2_dataset --config configs/smollm2_dataset.yaml   # your dataset + rewards
    python eval.py --model runs/smollm2_dataset --task.dataset=my.jsonl    # + any --section.key=value override

Reports (JSON on stdout, also --out FILE):
  pass@1          greedy accuracy (task.is_correct; a dataset task: its first reward function gives 1),
                  reward@1 its mean reward, reward/<function>@1 each reward function's mean (dataset task)
  mean@k          accuracy averaged over k samples per prompt (temperature --temperature)
  response_len_*  greedy response lengths in tokens (mean / p50 / max)
  speculative     the same greedy decode, plain AR vs speculative engine, timed on the same prompts:
                  speedup, tokens/s, target forwards per token, mean accepted length, and whether the
                  outputs are token-identical (they must be: exactness). The speculative engine first
                  generates the k samples (its drafters see them, as in RL where earlier rollouts of the
                  same prompts exist), then the timed greedy pass.
A run directory (RUN_DIR/config.yaml) or --config supplies the task (for a dataset task: its data,
prompt and reward functions), max tokens and `rollout.speculative`; --task gsm8k is the dataset task
over GSM8K's jsonl files (tasks/dataset.gsm8k_task).
"""
import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

DEFAULT_SPEC = [{"method": "prior", "num_draft_tokens": 8}, {"method": "suffix", "num_draft_tokens": 8}]


def resolve(path: str):
    """-> (model dir, the run's config.yaml or None). A run dir resolves to its latest complete checkpoint."""
    from nanospec.rl.checkpoint import latest_checkpoint, verify_checkpoint
    from nanospec.models.hub import resolve_model
    p = Path(path)
    cfg = p / "config.yaml" if (p / "config.yaml").is_file() else None
    if (p / "config.json").is_file() or not p.is_dir():    # an HF dir, a .gguf file or a hub id
        return resolve_model(p), cfg
    ck = latest_checkpoint(p)
    if ck is None:
        raise SystemExit(f"--model {p}: neither an HF model dir (config.json) nor a run dir with a complete "
                         f"checkpoint under {p / 'checkpoints'}")
    verify_checkpoint(ck)
    return ck, cfg


def decode(llm, prompts, params):
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    return outs, time.perf_counter() - t0


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, help="HF model dir, .gguf file, hub id, or run dir (latest checkpoint)")
    ap.add_argument("--task", default=None, help="synthetic, arith, dataset (from --config or the run's) or "
                    "gsm8k; default: the run's task")
    ap.add_argument("--config", default=None, help="a training YAML config whose task (and max tokens, "
                    "speculative) to use; default: the run dir's")
    ap.add_argument("--data", default=None, help="gsm8k: folder with test.jsonl, or the test.jsonl file")
    ap.add_argument("--n", type=int, default=256, help="test prompts")
    ap.add_argument("--k", type=int, default=4, help="samples per prompt for mean@k (0: skip)")
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--max-tokens", type=int, default=None, help="default: the run's max_completion_length or 256")
    ap.add_argument("--speculative", default=None, help="JSON speculative config; default: the run's or prior+suffix")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (tiny models: 1 is fastest)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="also write the JSON here")
    return ap


def load_task(a, run_cfg, overrides: list[str]):
    """-> (config or None, task name, task); bad input raises ValueError / FileNotFoundError."""
    from nanospec.config import load_config
    from nanospec.tasks import get_task, gsm8k_task, task_from_config
    if overrides and not (a.config or run_cfg):
        raise ValueError(f"{overrides[0]}: a config override needs --config or a run dir")
    cfg = load_config(a.config or run_cfg, overrides) if a.config or run_cfg else None
    name = a.task or (cfg.task.name if cfg else "synthetic")
    if name == "gsm8k":
        data = Path(a.data) if a.data else None
        return cfg, name, gsm8k_task(data.parent if data and data.is_file() else data)
    if cfg and cfg.task.name == name:
        return cfg, name, task_from_config(cfg.task)
    if name == "dataset":
        raise ValueError("--task dataset: pass --config (or a run dir) whose task names the dataset and rewards")
    return cfg, name, get_task(name)


def greedy_metrics(task, problems, outs) -> dict:
    """pass@1, reward@1 (and per reward function), greedy response lengths."""
    from nanospec.tasks import score
    lens = sorted(len(o.token_ids) for o in outs)
    rewards, correct, parts = score(task, problems, [o.text for o in outs], [o.token_ids for o in outs])
    return {"pass@1": statistics.fmean(map(float, correct)), "reward@1": statistics.fmean(rewards),
            **{f"reward/{k}@1": statistics.fmean(x for x in v if x is not None) for k, v in parts.items()
               if any(x is not None for x in v)},
            "response_len_mean": statistics.fmean(lens), "response_len_p50": lens[len(lens) // 2],
            "response_len_max": lens[-1]}


def sampled_metrics(sp, task, problems, prompts, a, max_tokens: int, stop: list[int]) -> dict:
    """mean@k and reward_mean@k over k samples per prompt (the speculative engine's drafters see them)."""
    from nanospec import SamplingParams
    from nanospec.tasks import score
    sampled = SamplingParams(temperature=a.temperature, max_tokens=max_tokens, stop_token_ids=stop,
                             n=a.k, seed=a.seed)
    souts, _ = decode(sp, prompts, sampled)
    rewards, correct, _ = score(task, [problems[i // a.k] for i in range(len(souts))], [o.text for o in souts],
                                [o.token_ids for o in souts])
    return {f"mean@{a.k}": statistics.fmean(map(float, correct)), f"reward_mean@{a.k}": statistics.fmean(rewards)}


def main(argv=None) -> dict:
    ap = parser()
    from nanospec.config import parse_with_overrides    # no torch yet
    a, overrides = parse_with_overrides(ap, argv)    # + --section.key=value on the config, as train.py
    if a.n < 1 or a.k < 0:
        ap.error(f"--n must be >= 1 and --k >= 0, got n={a.n}, k={a.k}")

    import torch
    from transformers import AutoTokenizer
    from nanospec import LLM, SamplingParams
    from nanospec.tasks import format_prompt

    torch.set_num_threads(a.threads)
    model_dir, run_cfg = resolve(a.model)
    try:    # bad input (config, data, reward functions): one line and exit 2, as train.py
        cfg, name, task = load_task(a, run_cfg, overrides)
        problems = task.test(a.n)
    except (ValueError, FileNotFoundError) as e:
        ap.error(str(e.args[0]) if isinstance(e, FileNotFoundError) and e.args else str(e))
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    prompts = [format_prompt(tok, p.messages or p.prompt) for p in problems]
    max_tokens = a.max_tokens or (cfg.grpo.max_completion_length if cfg else 256)
    spec = json.loads(a.speculative) if a.speculative else (cfg.rollout.speculative if cfg else None) or DEFAULT_SPEC
    stop = [] if tok.eos_token_id is None else [tok.eos_token_id]
    greedy = SamplingParams(temperature=0.0, max_tokens=max_tokens, stop_token_ids=stop)
    warm = SamplingParams(temperature=0.0, max_tokens=8, stop_token_ids=stop)
    kw = dict(dtype=a.dtype, device=a.device, max_num_seqs=64, seed=a.seed)

    ar = LLM(str(model_dir), tok, **kw)
    decode(ar, prompts[:8], warm)            # first calls pay one-off costs (allocator, kernel setup)
    outs, t_ar = decode(ar, prompts, greedy)
    res = {"model": str(model_dir), "task": name, "n": len(problems), **greedy_metrics(task, problems, outs)}
    sp = LLM(str(model_dir), tok, speculative=spec, **kw)
    decode(sp, prompts[:8], warm)
    if a.k:
        res.update(sampled_metrics(sp, task, problems, prompts, a, max_tokens, stop))
    sp.reset_stats()
    souts, t_sp = decode(sp, prompts, greedy)
    s, n_tok = sp.summary(), sum(len(o.token_ids) for o in outs)
    res.update({"speculative": spec, "ar_seconds": t_ar, "spec_seconds": t_sp, "speedup": t_ar / t_sp,
                "ar_tokens_per_s": n_tok / t_ar, "spec_tokens_per_s": n_tok / t_sp,
                "target_forwards_per_token": s["target_forwards_per_token"],
                "mean_accepted_len": s["mean_accepted_len"], "acceptance_rate": s["acceptance_rate"],
                "greedy_identical": all(x.token_ids == y.token_ids for x, y in zip(outs, souts)),
                "lossy": s["lossy"]})
    text = json.dumps(res, indent=1)
    print(text)
    if a.out:
        Path(a.out).write_text(text + "\n")
    return res


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from nanospec.tasks import RewardError
    try:
        main()
    except RewardError as e:      # the user's reward function misbehaved: one line, exit 2
        print(f"eval.py: error: {e}", file=sys.stderr)
        sys.exit(2)
    sys.exit(0)
