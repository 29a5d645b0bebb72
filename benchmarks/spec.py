"""Speculative vs AR on the same prompts, GRPO-like: P prompts x G samples at temperature 1.

Workload = the embedded task with the SFT model (runs/sft, made by `make train`; pass
`--model DIR` to use another). Every variant gets a fresh engine, one untimed *history* pass over the
same prompts (what the previous GRPO step would have left behind: prior rollouts, suffix trees), then
`--reps` timed passes, each a GRPO-like step (drafter `next_step()` in between), variants interleaved
pass by pass so drift of a shared machine hits them all alike. Distinct seeds per pass, so a timed
pass is new samples, not a replay. The "policies" rows add the engine's draft controller (its one
rule: each row's drafts where their estimated acceptance pays for the verify; engine/controller.py). The "draft model"
row needs a draft model directory (`--draft`, default runs/draft, made by `make draft`), the
"suffix+mlp" rows an n-gram MLP distilled from the SFT model (`--mlp`, default runs/ngram_mlp, `make mlp`), the
"head" rows a draft head warm-started on it (`--head`, default runs/head: `python distill_head.py`). Samples
differ between variants (same distribution, different draws), so `speedup` compares tokens/s;
`wall_speedup` compares the batch's wall time.
Without the SFT model the workload falls back to G samples of one repeated prompt on a random model.

A second table splits each variant's time by *phase* of the batch's drain (unfinished rows / all rows:
full, half, quarter, tail): where speculation wins and where it does not (compute-bound full batches
on CPU, the tail's hard-to-draft stragglers).
"""
import argparse
import time
from pathlib import Path

from nanospec import LLM, SamplingParams

PRIOR, SUFFIX = {"method": "prior", "num_draft_tokens": 8}, {"method": "suffix", "num_draft_tokens": 8}
VARIANTS = [    # (name, speculative config, engine-level policies: None or SpeculationConfig overrides)
    ("AR", None, None),
    ("ngram", {"method": "ngram", "num_draft_tokens": 8}, None),
    ("suffix", SUFFIX, None),
    ("suffix, policies", SUFFIX, {}),
    ("prior", PRIOR, None),
    ("prior+suffix", [PRIOR, SUFFIX], None),
    ("prior+suffix, policies", [PRIOR, SUFFIX], {}),
    ("self (nf4)", {"method": "self", "num_draft_tokens": 4}, None),
]
# The ceiling of this machine at this batch: greedy, where the prior rollout is exactly the next answer,
# so every draft is accepted and only the cost of verifying k+1 positions per row remains. Compared with
# greedy AR (greedy answers differ from T=1 ones in length, so the two groups have separate baselines).
CEILING = [("AR, greedy", None, None), ("prior, greedy (every draft right: ceiling)", PRIOR, None)]
PHASES = (("> 1/2", 0.5, 1.0), ("1/4-1/2", 0.25, 0.5), ("1/16-1/4", 1 / 16, 0.25), ("<= 1/16", 0.0, 1 / 16))


def track_phases(llm, num_rows: int) -> list[list[float]]:
    """Wrap llm.step: [seconds, tokens] per phase, by the fraction of rows still unfinished."""
    acc = [[0.0, 0] for _ in PHASES]
    step = llm.step

    def timed_step():
        left = (len(llm.scheduler.running) + len(llm.scheduler.waiting)) / num_rows
        a = acc[next(i for i, (_, lo, hi) in enumerate(PHASES) if lo < left <= hi)]
        before, t0 = llm.stats["generated_tokens"], time.perf_counter()
        finished = step()
        a[0] += time.perf_counter() - t0
        a[1] += llm.stats["generated_tokens"] - before
        return finished
    llm.step = timed_step
    return acc


def print_phases(rows: list[dict]) -> None:
    """Per phase: speedup (tokens/s vs that phase of the same temperature's AR) and share of the time."""
    base = {}
    print("\n== spec: by phase of the batch (unfinished rows / all): speedup vs AR in that phase, time share")
    print("name".ljust(44) + "".join(label.rjust(18) for label, *_ in PHASES))
    for r in rows:
        b = base.setdefault(r["temperature"], r["phases"])
        total = sum(p["seconds"] for p in r["phases"].values())
        cells = []
        for label, *_ in PHASES:
            p, q = r["phases"][label], b[label]
            if not (p["seconds"] and q["seconds"]):    # a phase this variant (or AR) never ran in
                cells.append("-".rjust(18))
                continue
            speedup = p["tokens"] / p["seconds"] / (q["tokens"] / q["seconds"])
            cells.append(f"{speedup:.2f}x {p['seconds'] / total:4.0%}".rjust(18))
        print(r["name"][:43].ljust(44) + "".join(cells))


def workload(model_dir, num_prompts: int):
    from nanospec.tasks import SyntheticTask, format_prompt
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(model_dir)
    problems = SyntheticTask(seed=0).test(num_prompts)
    return [format_prompt(tok, p.prompt) for p in problems], tok


def parse_opts(args):
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="runs/sft")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--G", type=int, default=8)
    ap.add_argument("--draft", default="runs/draft", help="draft model directory for the draft-model row")
    ap.add_argument("--mlp", default="runs/ngram_mlp", help="n-gram MLP directory for the suffix+mlp rows")
    ap.add_argument("--head", default="runs/head", help="draft head directory for the head rows (distill_head.py)")
    ap.add_argument("--reps", type=int, default=3, help="timed passes after the history pass")
    ap.add_argument("--device", default="cpu", help="cuda: every engine on the GPU with CUDA graphs")
    return ap.parse_known_args(args.extra)[0]


def model_and_prompts(opts, num_prompts: int):
    """-> (model_dir, prompts, tokenizer, workload label): the SFT model on the task's test prompts, or,
    without it, a random tiny model on one repeated prompt."""
    from nanospec.models.hub import resolve_model
    try:
        model_dir = str(resolve_model(opts.model))
    except (FileNotFoundError, ValueError) as e:
        model_dir = None
        print(f"spec suite: no model at {opts.model} (run `make train` first); random model, repeated prompt ({e})")
    if model_dir is not None:
        prompts, tok = workload(model_dir, num_prompts)
        return model_dir, prompts, tok, f"synthetic task, {opts.model}"
    import tempfile
    from benchmarks.engine import tiny_llama
    model_dir = tempfile.mkdtemp()
    tiny_llama(model_dir)
    return model_dir, [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6]] * num_prompts, None, "random model, one repeated prompt"


def trained_variants(opts, tok) -> list[tuple]:
    """The rows whose drafter was trained for this workload (n-gram MLP, draft head, draft model), where
    one is on disk; each skipped one says so."""
    variants = []
    if tok is not None and Path(opts.mlp, "ngram_mlp.json").is_file():   # suffix tree + distilled n-gram MLP
        SMLP = {"method": "suffix_mlp", "model": opts.mlp, "num_draft_tokens": 8}
        variants += [("suffix+mlp", SMLP, None, 1.0), ("prior+suffix+mlp", [PRIOR, SMLP], None, 1.0)]
    else:
        print(f"spec suite: suffix+mlp rows skipped: no n-gram MLP at {opts.mlp} (`make mlp`)")
    if tok is not None and Path(opts.head, "config.json").is_file():     # the learned draft head (EAGLE)
        HEAD = {"method": "head", "model": opts.head, "num_draft_tokens": 4}
        variants += [("head, k=4", HEAD, None, 1.0), ("prior+suffix+head", [PRIOR, SUFFIX, HEAD], None, 1.0)]
    else:
        print(f"spec suite: head rows skipped: no draft head for this workload at {opts.head} "
              "(`python distill_head.py`)")
    if tok is not None and Path(opts.draft, "config.json").is_file():
        variants.append(("draft model", {"method": "draft_model", "model": opts.draft, "num_draft_tokens": 3}, None, 1.0))
    else:
        print(f"spec suite: draft model row skipped: no draft model for this workload at {opts.draft} (`make draft`)")
    return variants


def run(args) -> list[dict]:
    from nanospec.config import SpeculationConfig
    opts = parse_opts(args)
    num_prompts = 4 if args.quick else opts.prompts
    model_dir, prompts, tok, label = model_and_prompts(opts, num_prompts)
    variants = [(*v, 1.0) for v in VARIANTS] + trained_variants(opts, tok) + [(*v, 0.0) for v in CEILING]
    keys = list(range(len(prompts)))
    sp = lambda seed, T: SamplingParams(temperature=T, max_tokens=112, n=opts.G, seed=seed)
    engines = {}
    for name, spec, policies, T in variants:
        # the engine's draft controller (engine/controller.py); None: fixed k
        controller = None if policies is None else SpeculationConfig(
            bubble_drafting=False, length_aware_assignment=False, length_classes=[], **policies)
        try:
            llm = LLM(model_dir, tokenizer=tok, max_num_seqs=num_prompts * opts.G, speculative=spec,
                      controller=controller, device=opts.device, use_cuda_graphs=opts.device.startswith("cuda"))
        except (ValueError, ImportError) as e:   # a drafter this model or box cannot run: say so, measure the rest
            print(f"spec suite: {name} skipped: {e}")
            continue
        llm.generate(prompts, sp(1, T), use_tqdm=False, prompt_keys=keys)       # history pass
        engines[name] = (llm, T, [0.0, 0], track_phases(llm, num_prompts * opts.G))   # seconds, tokens
    for rep in range(opts.reps):    # timed passes, variants interleaved: machine drift hits all alike
        for name, (llm, T, acc, phases) in engines.items():
            if llm.drafter is not None:
                llm.drafter.next_step()
            if rep == 0:
                llm.reset_stats()
                for p in phases:
                    p[:] = [0.0, 0]
            t0 = time.perf_counter()
            outs = llm.generate(prompts, sp(2 + rep, T), use_tqdm=False, prompt_keys=keys)
            acc[0] += time.perf_counter() - t0
            acc[1] += sum(len(o.token_ids) for o in outs)
    rows, base = [], {}     # base[T]: the first (AR) row of that temperature
    for name, (llm, T, (seconds, tokens), phases) in engines.items():    # variants' order, skipped ones left out
        s, spec = llm.summary(), llm.drafter is not None
        b = base.setdefault(T, (seconds, tokens / seconds))
        rows.append(dict(name=name, workload=label, temperature=T, tokens=tokens, seconds=seconds,
                         tokens_per_s=tokens / seconds,
                         target_forwards=s["target_forwards"],
                         target_forwards_per_token=s["target_forwards_per_token"],
                         mean_accepted_len=s["mean_accepted_len"] if spec else 1.0,
                         acceptance_rate=s["acceptance_rate"] if spec else None,
                         speedup=tokens / seconds / b[1], wall_speedup=b[0] / seconds, lossy=s["lossy"],
                         phases={label: dict(seconds=t, tokens=n) for (label, *_), (t, n) in zip(PHASES, phases)}))
    print_phases(rows)
    return rows
