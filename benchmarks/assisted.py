"""A draft model at batch 1: nanospec (fixed k, and its default adaptive controller) vs transformers'
assisted generation, on SmolLM2-135M-Instruct (`python -m nanospec.models.hub smollm2`).

    python bench.py --suite assisted [--prompts 4] [--max-tokens 64] [--reps 3] [--ks 1,2,3,5,8,12] [--only ...]

Target: SmolLM2's first 8 layers, where layers 2..7 write `scale` x their output into the residual
stream (o_proj and down_proj scaled); draft: the target's first 2 layers (+ its norm and tied head).
`scale` sets how often the draft agrees: at 1 it is the truncated real model (the draft rarely agrees),
at 0 the draft computes exactly the target's logits (always agrees), in between it mostly agrees. A
fourth setting negates the draft's final norm, so its argmax is the target's least likely token (always
wrong). Every variant decodes the same GSM8K chat prompts one at a time (batch 1), greedy, EOS ignored;
`same_tokens` checks every variant's output against transformers' plain greedy output. Variants are
interleaved per round (the first round is a warm-up; the order reverses every round, nanospec's AR and
adaptive engines always adjacent), and each row reports the median round; every
ratio (`speedup` over transformers' assisted generation, `vs_nanospec_ar`, `vs_best_fixed_k` over the
fixed k with the lowest median) is the median of per-round ratios of the two variants' times.
"""
import argparse
import statistics
import tempfile
import time

import torch

from nanospec import LLM, SamplingParams

SETTINGS = [("disagrees", 1.0, False), ("mostly agrees", 0.1, False), ("always agrees", 0.0, False),
            ("always wrong", 1.0, True)]


def make_pair(model_dir: str, out: str, scale: float, wrong: bool, tok) -> tuple[str, str]:
    """Write the (target, draft) HF dirs of one setting; see the module docstring."""
    from nanospec.models.loader import load_model, save_model
    target = load_model(model_dir)
    target.model.layers = target.model.layers[:8]
    target.args.num_layers = 8
    with torch.no_grad():
        for layer in target.model.layers[2:]:
            layer.self_attn.o_proj.weight.mul_(scale)
            layer.mlp.down_proj.weight.mul_(scale)
    save_model(target, f"{out}/target", tok)
    target.model.layers = target.model.layers[:2]
    target.args.num_layers = 2
    if wrong:
        with torch.no_grad():
            target.model.norm.weight.neg_()      # logits negated: the draft's argmax is the target's argmin
    save_model(target, f"{out}/draft", tok)
    return f"{out}/target", f"{out}/draft"


def run_setting(name, target_dir, draft_dir, prompts, opts) -> list[dict]:
    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    hf_draft = AutoModelForCausalLM.from_pretrained(draft_dir, dtype=torch.float32).eval()
    n = opts.max_tokens
    gen = dict(max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)
    sp = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)

    def hf_run(assistant):
        outs = []
        for p in prompts:
            ids = torch.tensor([p])
            out = hf.generate(input_ids=ids, attention_mask=torch.ones_like(ids), assistant_model=assistant, **gen)
            outs.append(out[0, len(p):].tolist())
        return outs

    def engine(k, controller):
        spec = {"method": "draft_model", "model": draft_dir, "num_draft_tokens": k}
        return LLM(target_dir, max_num_seqs=1, kv_cache_gib=0.25, speculative=spec, controller=controller)

    # adaptive right after AR: the two run back to back in every round (in either order), so their
    # ratio, the always-wrong goal, is not spread over the other variants' minutes of drift
    engines = {"nanospec AR": lambda: LLM(target_dir, max_num_seqs=1, kv_cache_gib=0.25),
               f"nanospec adaptive (k<={max(opts.ks)})": lambda: engine(max(opts.ks), "auto")}
    engines.update({f"nanospec k={k}": lambda k=k: engine(k, None) for k in opts.ks})
    keep = lambda label: not opts.only or label in ("transformers AR", "nanospec AR") or label in opts.only.split(",")
    engines = {label: make() for label, make in engines.items() if keep(label)}
    runs = {"transformers AR": lambda: hf_run(None), "transformers assisted": lambda: hf_run(hf_draft)}
    runs = {label: run for label, run in runs.items() if keep(label)}
    for label, llm in engines.items():
        runs[label] = lambda llm=llm: [o.token_ids for o in (llm.generate([p], sp, use_tqdm=False)[0] for p in prompts)]
    times, outs, summaries = {k: [] for k in runs}, {}, {}
    for rnd in range(opts.reps + 1):                   # round 0: warm-up
        for label in (list(runs) if rnd % 2 else list(runs)[::-1]):
            for llm in engines.values():
                llm.reset_stats()
            t0 = time.perf_counter()
            with torch.inference_mode():
                outs[label] = runs[label]()
            if rnd:
                times[label].append(time.perf_counter() - t0)
                if label in engines:
                    summaries[label] = engines[label].summary()
    med = {k: statistics.median(v) for k, v in times.items()}
    # this box drifts +-20% between rounds: a ratio is the median of per-round ratios (paired, same round)
    paired = lambda a, b: statistics.median(x / y for x, y in zip(a, b))
    best = min((k for k in runs if k.startswith("nanospec k=")), key=med.get, default=None)
    ref, rows = outs["transformers AR"], []
    for label in runs:
        summ = summaries.get(label, {})
        rows.append(dict(name=f"{name}: {label}", setting=name, seconds=med[label],
                         speedup=paired(times["transformers assisted"], times[label]) if "transformers assisted"
                         in times else float("nan"),
                         vs_nanospec_ar=paired(times["nanospec AR"], times[label]),
                         vs_best_fixed_k=paired(times[best], times[label]) if best else float("nan"),
                         acceptance=summ["acceptance_rate"] if summ.get("proposed_tokens") else float("nan"),
                         same_tokens=outs[label] == ref, lossy=False))
    return rows


def run(args) -> list[dict]:
    ap = argparse.ArgumentParser(prog="bench.py --suite assisted")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--ks", default="1,2,3,5,8,12")
    ap.add_argument("--settings", default=",".join(s[0] for s in SETTINGS))
    ap.add_argument("--only", default=None, help="comma-separated variants to run besides the two AR baselines "
                    "(e.g. 'nanospec adaptive (k<=12)': many cheap rounds for the vs-own-AR ratio)")
    opts = ap.parse_args(args.extra)
    opts.ks = [int(k) for k in opts.ks.split(",")]
    from transformers import AutoTokenizer
    from nanospec.models.hub import fetch_smollm2
    from nanospec.tasks import format_prompt, gsm8k_task
    model_dir = str(fetch_smollm2())
    tok = AutoTokenizer.from_pretrained(model_dir)
    task = gsm8k_task()
    prompts = [format_prompt(tok, p.prompt) for p in task.test(opts.prompts)]
    rows = []
    with tempfile.TemporaryDirectory() as work:
        for i, (name, scale, wrong) in enumerate(SETTINGS):
            if name not in opts.settings.split(","):
                continue
            target, draft = make_pair(model_dir, f"{work}/{i}", scale, wrong, tok)
            rows += run_setting(name, target, draft, prompts, opts)
    return rows
