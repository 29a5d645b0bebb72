"""Rollout-policy ablation on 2 data-parallel gloo ranks (1 thread each), GRPO-like steps.

Each row adds one policy to the row above -- AR (and AR with length-aware assignment alone, to see
balancing without speculation's noise); +spec (prior+suffix drafters); +bubble drafting
(BubbleSpec); +length-aware assignment and length-class caps (DAS); +the controller's rule (toggle and
adaptive draft length in one: engine/controller.py); then, beside +spec, prior + suffix_mlp (suffix tree + n-gram MLP), its MLP learned online from
the rollouts or distilled beforehand (`make mlp`) -- then a forced-bad drafter without and with the toggle. Every variant has its own engines
(one core per rank) and runs the same `--steps` consecutive rollout steps, interleaved step by step
with the other variants (drifting load on a shared machine hits all of them alike), over a cycling
prompt pool (3 x prompts per step: the first steps see new prompts, later ones revisit them as
epochs would), with a tiny deterministic weight perturbation before each step to mimic optimizer
updates (load_weights -> prefix cache reset, drafter refresh). Step 0 is a warm-up, not averaged.
Workload: the embedded task with the SFT model (`--model DIR`, default the config's sft.out_dir),
else a random tiny model (then lengths are eos-by-chance and drafts rarely match: the row says so).
Samples differ between variants (same distribution, different draws): `speedup` compares the mean
rollout time per step (slowest rank), so length noise between variants shows up in it.
`--baseline-controller FILE` (e.g. `git show REV:nanospec/engine/controller.py > /tmp/ctl.py`) adds the
rule's row again with that file's controller, interleaved with this tree's in the same run: separate
runs of one tree differ by up to ~10% on a shared box, the same run by ~1.5% (docs/notebook.md). The
variants' order alternates step by step (ABC CBA): in one fixed order the last ran ~2% faster.
"""
import argparse
import json
import os
import socket
import tempfile
from pathlib import Path

import torch

SPEC_K = 8
SPEC = [{"method": "prior", "num_draft_tokens": SPEC_K}, {"method": "suffix", "num_draft_tokens": SPEC_K}]
CLASSES = dict(length_classes=[18, 72], length_class_budgets=[2, 4, 8])   # ~median and ~p90 of the task
NONE = dict(bubble_drafting=False, length_aware_assignment=False, length_classes=[], toggle=False)
VARIANTS = [
    ("AR", None, {}),
    ("AR + length-aware assign", None, dict(length_aware_assignment=True)),
    ("+spec (prior+suffix)", SPEC, {}),
    ("+bubble drafting", SPEC, dict(bubble_drafting=True)),
    ("+length-aware (assign+classes)", SPEC, dict(bubble_drafting=True, length_aware_assignment=True, **CLASSES)),
    ("+toggle and adaptive length", SPEC, dict(bubble_drafting=True, length_aware_assignment=True, **CLASSES,
                                               toggle=True)),
    ("+spec (prior+suffix_mlp, online)", [SPEC[0], {"method": "suffix_mlp", "num_draft_tokens": SPEC_K, "learn_lr": 3e-3, "learn_epochs": 8}], {}),
    ("+spec (prior+suffix_mlp, make mlp)", [SPEC[0], {"method": "suffix_mlp", "num_draft_tokens": SPEC_K,
                                                      "model": "runs/ngram_mlp"}], {}),
    ("bad drafter", "bad", dict(length_aware_assignment=True)),
    ("bad drafter + toggle", "bad", dict(length_aware_assignment=True, toggle=True)),
]


def bad_drafter(vocab_size: int):
    """Always drafts, almost always wrong: a fixed affine map of the last token (never the target's mode
    except by chance). What the toggle must switch off."""
    from nanospec.drafters.base import Drafter, Proposal

    class BadDrafter(Drafter):
        name = "bad"

        def propose(self, seqs, budgets):
            toks = [[(s.last_token * 7 + 3 + i) % vocab_size for i in range(k)] for s, k in zip(seqs, budgets)]
            return Proposal(toks, sources=["bad" if t else "" for t in toks])
    return BadDrafter()


RULE = next(v for v in VARIANTS if v[0] == "+toggle and adaptive length")
BASELINE = RULE[0] + " [baseline controller]"


def baseline_module(path: str):
    """A controller.py from another revision, imported under its own name (its imports are this tree's)."""
    import importlib.util
    import sys
    spec = importlib.util.spec_from_file_location("baseline_controller", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module           # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


def _rank_main(rank, port, model_path, opts, out_path):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2",
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE="2")
    torch.set_num_threads(1)
    if hasattr(os, "sched_setaffinity") and (os.cpu_count() or 1) >= 2:
        os.sched_setaffinity(0, {rank})     # one core per rank, as one GPU per rank: a bubble never steals
    from nanospec.rl import dist
    from nanospec.config import Config, GRPOConfig, SpeculationConfig
    from nanospec.engine.llm import LLM
    from nanospec.models.loader import load_model
    from nanospec.models.decoder import CausalLM
    from nanospec.engine.controller import build_controller
    from nanospec.rl.rollout import RolloutWorker
    from nanospec.rl.sft import init_weights, model_args
    from nanospec.tasks import SyntheticTask, build_tokenizer
    dist.init_distributed(timeout_s=1200)
    tok, P = build_tokenizer(), opts["prompts"]
    task = SyntheticTask(seed=0)
    pool = list({p.prompt: p for p in task.train(40 * P)}.values())[:3 * P]
    batch = lambda s: [pool[(s * P + i) % len(pool)] for i in range(P)]
    workers = {}
    variants = [VARIANTS[i] for i in opts["variants"]]
    if opts["baseline"]:
        variants.append((BASELINE, RULE[1], RULE[2]))
    for name, spec, pol in variants:
        if model_path:
            model = load_model(model_path)
        else:
            torch.manual_seed(0)
            model = init_weights(CausalLM(model_args(Config().model, tok)))
        cfg = Config(grpo=GRPOConfig(prompts_per_step=P, num_generations=opts["G"], max_completion_length=110),
                     speculation=SpeculationConfig(**{**NONE, **pol}))
        llm = LLM(model, tokenizer=tok, max_num_seqs=64, block_size=16, max_model_len=256, seed=1 + rank,
                  controller=None, speculative={"method": "ngram", "num_draft_tokens": SPEC_K} if spec == "bad" else spec)
        if spec == "bad":
            llm.drafter = bad_drafter(llm.vocab_size)
        build = baseline_module(opts["baseline"]).build_controller if name == BASELINE else build_controller
        llm.controller = build(cfg.speculation, llm)     # after the drafter swap: it reads its sources
        workers[name] = RolloutWorker(llm, tok, cfg, rank, 2)
    start = {k: v.clone() for k, v in next(iter(workers.values())).llm.model.state_dict().items()}
    results = {name: [] for name in workers}
    for s in range(opts["steps"]):
        # variants interleaved step by step, so drifting load on a shared machine hits all alike
        g = torch.Generator().manual_seed(s)   # same update on both ranks: synchronous DP
        update = {k: v + 1e-3 * v.std() * torch.randn(v.shape, generator=g) if v.dim() == 2 else v
                  for k, v in start.items()}
        for name, worker in list(workers.items())[::-1 if s % 2 else 1]:   # ABC CBA: no variant always first
            if s:
                worker.llm.load_weights(update)
            results[name].append(worker.run(s, batch(s), batch(s + 1))[1])
        if rank == 0:
            print(f"  rollout bench: step {s}: " + " ".join(f"{r[-1]['time_rollout']:.2f}" for r in results.values()),
                  flush=True)
    if rank == 0:
        Path(out_path).write_text(json.dumps(results))
    dist.cleanup()


def _mean(xs):
    xs = [x for x in xs if x is not None]
    return sum(xs) / len(xs) if xs else None


def _row(name, steps, label, base_time):
    st = steps[1:] or steps                                 # step 0 = warm-up
    t = _mean([m["time_rollout"] for m in st])
    per_rank = lambda k: "/".join(f"{_mean([m[k][r] for m in st]):.2f}" for r in range(len(st[0][k])))
    return dict(name=name, model=label, time_rollout_s=t, speedup=(base_time or t) / t,
                rank_busy_s=per_rank("rank_busy_time"), rank_bubble_s=per_rank("rank_bubble_time"),
                rank_bubble_draft_s=per_rank("rank_bubble_draft_time"),
                slowest_over_mean=_mean([m["rollout_imbalance"] for m in st]),
                target_forwards_per_token=_mean([m["target_forwards_per_token"] for m in st]),
                mean_accepted_len=_mean([m["mean_accepted_len"] if m.get("verify_steps") else None for m in st]),
                bubble_recovered_frac=_mean([m.get("bubble_recovered_frac") for m in st]),
                bubble_draft_tokens=_mean([m["bubble_draft_tokens"] for m in st]),
                bubble_draft_accepted=_mean([m["bubble_draft_accepted"] for m in st]),
                spec_on_frac=_mean([m.get("spec_on_frac") for m in st]),
                draft_len_mean=_mean([m["draft_len_mean"] if m.get("verify_steps") else None for m in st]),
                response_len_mean=_mean([m["response_len_mean"] for m in st]),
                tokens_per_s=_mean([m["tokens_per_s"] for m in st]), drafter_acceptance=_acceptance(st),
                time_rollout_per_step=[m["time_rollout"] for m in steps], steps=steps, lossy=False)


def _acceptance(steps) -> str:
    """'name accepted/proposed' per drafter source over the timed steps (where drafts came from)."""
    names = sorted({k.split("/")[1] for m in steps for k in m if k.startswith("drafter/") and k.endswith("/proposed")})
    tot = lambda n, w: sum(m.get(f"drafter/{n}/{w}", 0) for m in steps)
    return " ".join(f"{n}:{tot(n, 'accepted')}/{tot(n, 'proposed')}" for n in names) or "-"


def run(args) -> list[dict]:
    from nanospec.config import Config
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=Config().sft.out_dir)
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--prompts", type=int, default=8, help="global prompts per step (2 ranks)")
    ap.add_argument("--G", type=int, default=8)
    ap.add_argument("--variants", default=None, help="comma-separated row indices (default: all; 0 = AR is always run)")
    ap.add_argument("--baseline-controller", default=None, help="another revision's controller.py: the rule's row "
                    "again with it, interleaved in the same run")
    o, _ = ap.parse_known_args(args.extra)
    keep = sorted({0, *map(int, o.variants.split(","))}) if o.variants else range(len(VARIANTS))
    missing = lambda spec: [d["model"] for d in spec if "model" in d and not Path(d["model"]).is_dir()] \
        if isinstance(spec, list) else []
    for i in [i for i in keep if missing(VARIANTS[i][1])]:
        print(f"rollout suite: {VARIANTS[i][0]} skipped: no n-gram MLP at {missing(VARIANTS[i][1])[0]} (`make mlp`)")
    keep = [i for i in keep if not missing(VARIANTS[i][1])]
    if o.baseline_controller and not Path(o.baseline_controller).is_file():
        raise SystemExit(f"rollout suite: --baseline-controller {o.baseline_controller}: no such file")
    opts = dict(steps=o.steps or (3 if args.quick else 7), prompts=o.prompts, G=o.G, variants=list(keep),
                baseline=o.baseline_controller)
    from nanospec.models.hub import resolve_model
    try:
        model_path = str(resolve_model(o.model))
    except (FileNotFoundError, ValueError) as e:
        model_path = None
        print(f"rollout suite: no model at {o.model} (run `make train` first): random tiny model ({e})")
    label = f"SFT {o.model}" if model_path else f"RANDOM tiny model (no SFT model at {o.model})"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    import torch.multiprocessing as mp
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "rollout.json")
        ctx = mp.get_context("spawn")
        procs = [ctx.Process(target=_rank_main, args=(r, port, model_path, opts, out)) for r in range(2)]
        for p in procs:
            p.start()
        for p in procs:
            p.join()
        if any(p.exitcode for p in procs):
            raise RuntimeError(f"rollout suite: rank exit codes {[p.exitcode for p in procs]}")
        results = json.loads(Path(out).read_text())
    base = _mean([m["time_rollout"] for m in results["AR"][1:] or results["AR"]])
    return [_row(name, results[name], label, base) for name in results]
