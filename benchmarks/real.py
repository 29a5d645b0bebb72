"""A real pretrained model (SmolLM2-135M-Instruct, `python -m nanospec.models.hub smollm2`), as users run it.

    python bench.py --suite real [--prompts 1] [--G 8] [--max-tokens 128] [--history 0,1,5]

1. Engine vs `transformers.generate`: greedy, EOS ignored, batch 1 / 16 / 64, median of --repeats
   interleaved runs (the `engine` suite's method, on the real model).
2. Every drafter vs AR on GSM8K rollouts: P test prompts x G samples at T=1 (`--temperature`), as a GRPO
   step makes them. `--task arith --prompts 2 --temperature 0.7 --fresh-prompts --ignore-eos`: one rank's
   share of a `make smollm2` step (new prompts every pass), every sample 128 tokens: the same work in every
   engine, so tokens/s compares the engines alone.
   Each variant is a fresh engine over the one shared model; all variants make passes 0..max(history)+reps-1
   over the same prompts with new seeds each pass, in lock-step: every engine takes one step in turn (the
   order reversed every other pass) and only its own steps are timed, so the box's drift falls on every
   variant alike. A row for history h covers passes h .. h + reps - 1, its speedup the median of their
   per-pass tokens/s ratios to AR (speedup_sd: the ratios' sd, one pass's noise), its other columns over the
   same passes (counts summed, the controller's shares averaged); the row 'AR (A/A)' is a second AR engine
   drawing other samples, the table's own noise floor. There the drafters have seen h (and more) earlier
   rollouts of these prompts (the prior-rollout store, the suffix trees), as they would after that many GRPO
   epochs. `+policies` rows run the trainer's draft controller (engine/controller.py's rule, the
   `speculation` config defaults); next to each row's measured speedup stand the fraction of steps that
   verified drafts and the mean draft length verified. `--fixed-k 1,2,4` adds rows '<drafter> k=K': that
   draft length on every step, no controller, the best of which the rule should match. The draft model is the
   policy's first `--draft-layers` layers (same tokenizer; no smaller SmolLM2 is reachable here).
3. Peak RSS of the whole run.
Samples differ between variants (same distribution, other draws): speedup compares tokens/s, and each row
checks "same distribution" on what it sampled: its mean response length and GSM8K reward over its passes,
with the two-sample Kolmogorov-Smirnov p-value of its response lengths against AR's on the same passes
(exactness: a small p in a row without `lossy` would be a bug).
"""
import argparse
import resource
import statistics
import tempfile
import time

import torch
from scipy.stats import ks_2samp

from nanospec import LLM, SamplingParams
from nanospec.engine.llm import frozen_heap

PRIOR, SUFFIX = {"method": "prior", "num_draft_tokens": 8}, {"method": "suffix", "num_draft_tokens": 8}
DRAFTERS = [("ngram", {"method": "ngram", "num_draft_tokens": 8}), ("suffix", SUFFIX), ("prior", PRIOR),
            ("prior+suffix", [PRIOR, SUFFIX]), ("self (nf4)", {"method": "self", "num_draft_tokens": 4}),
            ("draft model", {"method": "draft_model", "num_draft_tokens": 4})]
PLAIN = ("ngram", "suffix", "prior+suffix")     # also measured without the controller
AA = "AR (A/A)"                                 # a second AR engine: the noise floor of every speedup


def engine_vs_transformers(model_dir, model, batches, max_tokens, repeats) -> list[dict]:
    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    llm = LLM(model, max_num_seqs=max(batches), kv_cache_gib=0.5)
    rows = []
    for batch in batches:
        g = torch.Generator().manual_seed(batch)
        prompts = [torch.randint(100, 40000, (int(n),), generator=g).tolist()
                   for n in torch.randint(32, 96, (batch,), generator=g)]
        sp = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        width = max(map(len, prompts))
        ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        run = {"nanospec": lambda: llm.generate(prompts, sp, use_tqdm=False),
               "transformers": lambda: hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_tokens,
                                                   min_new_tokens=max_tokens, do_sample=False, pad_token_id=0)}
        times = {k: [] for k in run}
        for rep in range(repeats + 1):                  # the first round is a warm-up
            for name, fn in run.items():
                t0 = time.perf_counter()
                with torch.inference_mode():
                    fn()
                if rep:
                    times[name].append(time.perf_counter() - t0)
        med = {k: statistics.median(v) for k, v in times.items()}
        for name in ("transformers", "nanospec"):
            rows.append(dict(name=f"engine: {name} b{batch}", batch=batch, seconds=med[name],
                             tokens_per_s=batch * max_tokens / med[name],
                             speedup=med["transformers"] / med[name], lossy=False))
    return rows


def truncated_draft(model_dir, layers: int, out: str) -> str:
    """The policy's first `layers` decoder layers + its final norm and head: a cheap same-vocab draft."""
    from nanospec.models.loader import load_model, save_model
    m = load_model(model_dir)
    m.model.layers = m.model.layers[:layers]
    m.args.num_layers = layers
    from transformers import AutoTokenizer
    save_model(m, out, AutoTokenizer.from_pretrained(model_dir))
    return out


def with_k(spec, k: int):
    """A drafter spec (one dict, or a chain's list of them) drafting `k` tokens."""
    return [dict(s, num_draft_tokens=k) for s in spec] if isinstance(spec, list) else dict(spec, num_draft_tokens=k)


def lockstep(engines: dict) -> dict[str, float]:
    """Run every engine to completion, one step of each in turn; returns each engine's own seconds.
    Two identical AR passes run one after the other differ by several percent on a shared VM; stepped
    in turn, a slow stretch of the box lands on every variant alike (the A/A rows in docs/results.md)."""
    seconds = dict.fromkeys(engines, 0.0)
    while live := [name for name, llm in engines.items() if llm.scheduler.has_work()]:
        for name in live:
            t0 = time.perf_counter()
            engines[name].step()
            seconds[name] += time.perf_counter() - t0
    return seconds


def rollout_variants(opts) -> list[tuple]:
    """(name, speculative spec, with the controller) of every row: AR, its A/A twin, each drafter under the
    rule, the plain ones without it, and at each --fixed-k; a --head adds the head's rows."""
    drafters, plain = DRAFTERS, PLAIN
    if opts.head:        # a trained draft head (distill_head.py): alone and after the history drafters
        head = {"method": "head", "model": opts.head, "num_draft_tokens": 8}
        drafters = DRAFTERS + [("head", head), ("prior+suffix+head", [PRIOR, SUFFIX, head])]
        plain = PLAIN + ("head", "prior+suffix+head")
    variants = [("AR", None, False), (AA, None, False)] + [(f"{n} +policies", s, True) for n, s in drafters] + \
               [(n, s, False) for n, s in drafters if n in plain] + \
               [(f"{n} k={k}", with_k(s, k), False) for k in opts.fixed_k for n, s in drafters if n in plain]
    if opts.only:                                   # AR, the baseline, always runs
        variants = [v for v in variants if v[0] in ("AR", AA) or v[0] in opts.only.split(",")]
    return variants


def rollouts(model_dir, model, tok, opts, workdir) -> list[dict]:
    from nanospec.config import SpeculationConfig
    from nanospec.tasks import format_prompt, get_task, gsm8k_task, score
    task = get_task("arith") if opts.task == "arith" else gsm8k_task()
    timed = sorted(opts.history)
    num_passes = max(timed) + opts.reps
    # the same prompts every pass (drafters see earlier rollouts of them: GRPO epochs), or, as within
    # one epoch of GRPO, new prompts every pass
    pool = task.test(opts.prompts * (num_passes if opts.fresh_prompts else 1))
    batch = lambda p: pool[p * opts.prompts:(p + 1) * opts.prompts] if opts.fresh_prompts else pool
    draft = truncated_draft(model_dir, opts.draft_layers, f"{workdir}/draft")
    variants = rollout_variants(opts)
    engines = {}
    for name, spec, policies in variants:
        if isinstance(spec, dict) and spec["method"] == "draft_model":
            spec = dict(spec, model=draft)
        controller = SpeculationConfig(bubble_drafting=False, length_aware_assignment=False,
                                       length_classes=[]) if policies else None
        llm = LLM(model, tok, max_num_seqs=opts.prompts * opts.G, speculative=spec, kv_cache_gib=0.25,
                  controller=controller)
        engines[name] = llm
    acc, drawn = {}, {}                      # (name, pass) -> seconds, tokens, summary, policy stats;
    for p in range(num_passes):              #   -> [(response length, reward)] of every sample
        problems = batch(p)                  # pass p: the drafters have seen p earlier rollouts
        prompts = [format_prompt(tok, q.prompt) for q in problems]
        keys = [(p, i) if opts.fresh_prompts else i for i in range(len(prompts))]
        order = dict(list(engines.items())[::1 if p % 2 == 0 else -1])   # ABC CBA ...: no variant always first
        seqs = {}
        for name, llm in order.items():
            if llm.drafter is not None:
                llm.drafter.next_step()
            llm.reset_stats()
            params = SamplingParams(temperature=opts.temperature, max_tokens=opts.max_tokens, n=opts.G,
                                    seed=(200_000 if name == AA else 100) + p, ignore_eos=opts.ignore_eos)
            seqs[name] = [s for i, q in enumerate(prompts) for s in llm.add_request(q, params, i, keys[i])]
        seconds = lockstep(order)
        for name, llm in order.items():
            outs = [llm.output(s) for s in seqs[name]]
            acc[name, p] = (seconds[name], sum(len(o.token_ids) for o in outs), llm.summary())
            rewards = score(task, [problems[i // opts.G] for i in range(len(outs))], [o.text for o in outs])[0]
            drawn[name, p] = [(len(o.token_ids), r) for o, r in zip(outs, rewards)]
    return history_rows(engines, acc, drawn, timed, opts.reps)


def history_rows(engines: dict, acc: dict, drawn: dict, timed: list[int], reps: int) -> list[dict]:
    """A row per (history h, variant) from the passes h .. h + reps - 1 that `rollouts` timed and sampled."""
    rows = []
    rate = lambda name, p: acc[name, p][1] / acc[name, p][0]       # tokens / s of one pass
    for h in timed:         # passes h .. h + reps - 1: every column covers them all
        passes = range(h, h + reps)
        for name, llm in engines.items():
            seconds, tokens = (sum(acc[name, p][i] for p in passes) for i in (0, 1))
            total = lambda key: sum(acc[name, p][2][key] for p in passes)           # engine counters
            # median of per-pass ratios: both sides of a ratio ran minutes apart at most, so the box's
            # drift between passes cancels (a ratio of sums would carry it); their sd: one pass's noise
            ratios = [rate(name, p) / rate("AR", p) for p in passes]
            mine, ar = ([x for p in passes for x in drawn[n, p]] for n in (name, "AR"))
            rows.append(dict(name=f"h{h}: {name}", history=h, tokens=tokens, seconds=seconds,
                             tokens_per_s=tokens / seconds, speedup=statistics.median(ratios),
                             speedup_sd=statistics.stdev(ratios) if len(ratios) > 1 else None,
                             target_forwards_per_token=total("seq_forwards") / max(total("generated_tokens"), 1),
                             acceptance_rate=total("accepted_tokens") / max(total("proposed_tokens"), 1)
                             if llm.drafter is not None else None,
                             draft_len=total("proposed_tokens") / max(total("verify_steps"), 1)
                             if llm.drafter is not None else None,
                             tokens_per_verify=(total("accepted_tokens") + total("verify_steps"))
                             / max(total("verify_steps"), 1) if llm.drafter is not None else None,
                             spec_on_frac=total("drafting_steps") / max(total("target_forwards"), 1)
                             if llm.controller is not None else None,
                             len_mean=statistics.fmean(n for n, _ in mine),
                             reward_mean=statistics.fmean(r for _, r in mine),
                             len_ks_p=float(ks_2samp([n for n, _ in mine], [n for n, _ in ar]).pvalue),
                             lossy=acc[name, h][2]["lossy"], **accept_by_position([acc[name, p][2] for p in passes])))
    return rows


def accept_by_position(summaries: list[dict]) -> dict:
    """drafter/<name>/accept_pos<j> (acceptance at draft position j, given the drafts before it were
    accepted), the mean over the passes that drafted there."""
    keys = sorted({k for s in summaries for k in s if "/accept_pos" in k})
    return {k: statistics.fmean(s[k] for s in summaries if s.get(k) is not None) for k in keys
            if any(s.get(k) is not None for s in summaries)}


def run(args) -> list[dict]:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None, help="default: SmolLM2-135M-Instruct (fetched once)")
    ap.add_argument("--prompts", type=int, default=1)
    ap.add_argument("--task", default="gsm8k", choices=["gsm8k", "arith"], help="arith: make smollm2's task")
    ap.add_argument("--fresh-prompts", action="store_true", help="new prompts every pass (default: the same)")
    ap.add_argument("--ignore-eos", action="store_true", help="every sample runs to --max-tokens: the same "
                    "work in every engine (with EOS a pass's tokens/s also depends on the lengths it drew)")
    ap.add_argument("--G", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--temperature", type=float, default=1.0, help="rollout temperature (GRPO samples at 1.0)")
    ap.add_argument("--history", default="0,1,5", help="timed passes: earlier rollouts the drafters have seen")
    ap.add_argument("--reps", type=int, default=3, help="timed passes per history point (h .. h+reps-1)")
    ap.add_argument("--batches", default="1,16,64")
    ap.add_argument("--engine-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--draft-layers", type=int, default=6)
    ap.add_argument("--only", default=None, help="comma-separated rollout variant names (default: all)")
    ap.add_argument("--skip-engine", action="store_true", help="only the rollout table")
    ap.add_argument("--fixed-k", default="", help="e.g. 1,2,4: also rows '<drafter> k=K', a fixed draft length "
                    "without the controller, to set '+policies' against the best fixed k")
    ap.add_argument("--head", default=None, help="a draft head directory (distill_head.py): adds its rows")
    opts, _ = ap.parse_known_args(args.extra)
    opts.history = [int(x) for x in opts.history.split(",")]
    opts.fixed_k = [int(x) for x in opts.fixed_k.split(",") if x]
    if args.quick:
        opts.history, opts.max_tokens, opts.G, opts.repeats, opts.batches, opts.reps = [0, 1], 32, 4, 1, "1,4", 1
    from transformers import AutoTokenizer
    from nanospec.models.hub import fetch_smollm2, resolve_model
    from nanospec.models.loader import load_model
    model_dir = str(resolve_model(opts.model) if opts.model else fetch_smollm2())
    model, tok = load_model(model_dir), AutoTokenizer.from_pretrained(model_dir)
    rows = [] if opts.skip_engine else engine_vs_transformers(
        model_dir, model, [int(b) for b in opts.batches.split(",")], opts.engine_tokens, opts.repeats)
    with tempfile.TemporaryDirectory() as workdir, frozen_heap():     # the heap frozen, as in the trainer
        rows += rollouts(model_dir, model, tok, opts, workdir)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    print(f"real suite: peak RSS {rss:.2f} GiB ({model_dir})")
    for r in rows:
        r["peak_rss_gib"] = rss
    return rows
