"""What speculation costs when it does not pay: the default `LLM(speculative=[prior, suffix])` against
plain AR, in lock-step passes (benchmarks/real.lockstep: one engine step each in turn, the order
reversed every other pass), each pass on new prompts; `speedup` is the median per-pass ratio of AR's
seconds to the row's. An `AR (A/A)` twin shows the noise floor.

- `random model`: benchmarks/engine.tiny_llama's random weights, 64 rows of 8-24 random tokens, T=1,
  96 tokens, EOS ignored: text no history drafter can predict (issue 49's goal: >= 0.97x).
- `draft model, pair s`: batch 1, greedy, 96 tokens, a random 8-layer target (seed s) and a random
  2-layer draft model (seed 1000 + s), under the default rule (issue 49's goal: >= 0.97x its own AR
  on every pair). They mostly disagree; two random tiny Llamas can both settle into repeating a token,
  and then they agree.
- `toy T=1`: the embedded default's SFT model (`--model`, default runs/sft; skipped without it), 8
  prompts x 8 samples of the synthetic task, T=1, 110 tokens, 3 prompt sets cycled, no bubble drafts.
"""
import argparse
import statistics
import tempfile
from pathlib import Path

import torch

from benchmarks.engine import tiny_llama
from benchmarks.real import lockstep
from nanospec import LLM, SamplingParams
from nanospec.engine.llm import frozen_heap

SPEC = [{"method": "prior"}, {"method": "suffix"}]


def passes(engines: dict, batches, params: SamplingParams) -> dict:
    """Run every batch of prompts through every engine in lock-step; pass 0 warms up. -> per-pass
    seconds of each engine and the spec engine's share of steps that verified drafts."""
    seconds, drafting = {name: [] for name in engines}, []
    for p, prompts in enumerate(batches):
        for llm in engines.values():
            llm.reset_stats()
            for i, prompt in enumerate(prompts):
                llm.add_request(prompt, params, i)     # (its history's key: the prompt's ids)
        order = list(engines) if p % 2 else list(engines)[::-1]
        with frozen_heap(collect=False):        # as in `LLM.generate`, which these passes step through
            took = lockstep({name: engines[name] for name in order})
        for llm in engines.values():
            if llm.drafter is not None:
                llm.drafter.next_step()
        if p:
            for name, s in took.items():
                seconds[name].append(s)
            st = engines["spec"].stats
            drafting.append(st["drafting_steps"] / max(st["target_forwards"], 1))
    return dict(seconds=seconds, spec_on_frac=statistics.mean(drafting))


def rows_of(setting: str, result: dict) -> list[dict]:
    ar = result["seconds"]["AR"]
    out = []
    for name in ("AR (A/A)", "spec"):
        ratios = [a / b for a, b in zip(ar, result["seconds"][name])]
        out.append(dict(name=f"{setting}: {'prior+suffix, the rule' if name == 'spec' else name}",
                        passes=len(ratios), seconds=statistics.median(result["seconds"][name]),
                        speedup=statistics.median(ratios), min=min(ratios), max=max(ratios),
                        spec_on_frac=result["spec_on_frac"] if name == "spec" else None, lossy=False))
    return out


def random_model(num_passes: int) -> list[dict]:
    with tempfile.TemporaryDirectory() as d:
        tiny_llama(d)
        make = lambda spec: LLM(d, max_num_seqs=64, block_size=16, speculative=spec, seed=0)
        engines = {"AR": make(None), "AR (A/A)": make(None), "spec": make(SPEC)}
        batches = []
        for p in range(num_passes + 1):
            g = torch.Generator().manual_seed(100 + p)
            batches.append([torch.randint(0, 512, (int(n),), generator=g).tolist()
                            for n in torch.randint(8, 24, (64,), generator=g)])
        result = passes(engines, batches, SamplingParams(temperature=1.0, max_tokens=96, ignore_eos=True))
    return rows_of("random model", result)


def draft_model_pairs(num_pairs: int, num_passes: int) -> list[dict]:
    rows = []
    for pair in range(num_pairs):
        with tempfile.TemporaryDirectory() as d:
            tiny_llama(f"{d}/target", layers=8, seed=pair)
            tiny_llama(f"{d}/draft", layers=2, seed=1000 + pair)
            draft = {"method": "draft_model", "model": f"{d}/draft"}
            make = lambda spec: LLM(f"{d}/target", max_num_seqs=1, speculative=spec, seed=0)
            engines = {"AR": make(None), "AR (A/A)": make(None), "spec": make(draft)}
            g = torch.Generator().manual_seed(pair)
            batches = [[torch.randint(0, 512, (16,), generator=g).tolist()] for _ in range(num_passes + 1)]
            result = passes(engines, batches, SamplingParams(temperature=0.0, max_tokens=96, ignore_eos=True))
        rows += [dict(r, name=r["name"].replace("prior+suffix", "disagreeing draft model"))
                 for r in rows_of(f"draft model, pair {pair}", result)]
    return rows


def toy(model: str, num_passes: int) -> list[dict]:
    if not Path(model, "config.json").is_file():
        print(f"idle suite: no SFT model at {model} (make train writes runs/sft): the toy rows are skipped")
        return []
    from transformers import AutoTokenizer
    from nanospec.tasks import format_prompt, get_task
    tok = AutoTokenizer.from_pretrained(model)
    problems = get_task("synthetic").test(24)
    sets = [[format_prompt(tok, p.messages or p.prompt) for p in problems[i::3][:8]] for i in range(3)]
    make = lambda spec: LLM(model, tokenizer=tok, max_num_seqs=64, block_size=16, max_model_len=256,
                            speculative=spec, seed=0)
    engines = {"AR": make(None), "AR (A/A)": make(None), "spec": make(SPEC)}
    batches = [sets[p % 3] for p in range(num_passes + 1)]
    result = passes(engines, batches, SamplingParams(temperature=1.0, max_tokens=110, n=8))
    return rows_of("toy T=1", result)


def run(args) -> list[dict]:
    ap = argparse.ArgumentParser(prog="bench.py --suite idle")
    ap.add_argument("--passes", type=int, default=None, help="timed passes per setting (default 9; 3 with --quick)")
    ap.add_argument("--model", default="runs/sft", help="the toy rows' SFT model")
    o = ap.parse_args(args.extra)
    n = o.passes or (3 if args.quick else 9)
    return random_model(n) + draft_model_pairs(3, n) + toy(o.model, n)
