"""Suffix drafters replayed on real token streams: ours vs Arctic Inference's SuffixDecodingCache.

    python bench.py --suite suffix [--questions 16] [--G 8] [--max-tokens 160] [--temps 1.0,0.6] [--k 8]
                                   [--seed 100]   (streams: seeds `seed` and `seed + 1` for the two passes)

Why a replay: the drafter alone decides how many tokens a verify step emits, so two drafters can be
compared exactly on the *same* samples, with no model in the loop and no timing noise from it.
1. Streams: plain AR rollouts of SmolLM2-135M-Instruct (nanospec's engine, speculative=None) for Q
   GSM8K test questions (chat template, as the `real` suite builds them) x G samples, two passes
   (new seeds) per temperature; cached as JSON under $NANOSPEC_CACHE/bench, so reruns are fast.
2. Replay, per drafter and temperature: pass 1 is history (observed, then a GRPO step boundary);
   pass 2 is measured sample by sample in the order a batch finishes (sample j of every question,
   then sample j + 1), each finished sample becoming history for the next ones. At every step the
   drafter gets prompt + stream prefix and a budget of min(k, tokens left - 1); accepted = the
   longest prefix of the draft equal to the stream's continuation (a greedy-match verify), and the
   step emits accepted + 1 tokens.
Columns: tokens_per_step (stream tokens / verify steps), proposed_per_step (draft tokens offered per
step), no_draft (fraction of steps with an empty draft), first_accepted (accepted tokens of the
draft at the first position, drafted from the prompt alone), draft_ms (drafting time per step and
sequence: ours `propose`, which also appends the new tokens to its trie; Arctic `add_active_response`
+ `speculate`, the same work), observe_ms (per finished sample: ours `observe` + `free`, Arctic
`add_active_response` of the last tokens + `stop_request`), total_ms (both, per step). The
collector is off while replaying, as during rollouts (rollout.no_gc_pauses). speedup =
tokens_per_step / that of the first row of its temperature (Arctic when it is built).

Arctic is an optional peer, never a dependency: `bash benchmarks/arctic_build.sh` builds its
suffix-decoding core into $NANOSPEC_ARCTIC (default ~/.cache/nanospec/arctic); without it the
Arctic rows are skipped. It runs with the settings of its vLLM integration (tree depth 64, max spec
factor 1, min token prob 0.1, no cache limit).
"""
from __future__ import annotations

import argparse
import gc
import hashlib
import json
import os
import sys
import time
from pathlib import Path

from nanospec.drafters.suffix import SuffixDrafter
from nanospec.engine.sequence import SamplingParams, Sequence

CACHE = Path(os.environ.get("NANOSPEC_CACHE", Path.home() / ".cache" / "nanospec"))
ARCTIC_DIR = Path(os.environ.get("NANOSPEC_ARCTIC", CACHE / "arctic"))
VARIANTS = [    # (row name, SuffixDrafter kwargs): the default, then one part of it changed
    ("ours", {}),
    ("ours, no own text", {"own_prefix": False}),
    ("ours, no global trie", {"use_global": False}),
    ("ours, global depth 12", {"global_depth": 12}),
    ("ours, raw frequencies", {"shrink": 0.0, "alpha": 1.0}),     # Arctic's rule: p = c / n, <= match_len
]


# ---- streams --------------------------------------------------------------------------------------
def streams(opts) -> dict:
    """{"prompts": [Q prompt ids], str(T): [pass 1, pass 2]}, each pass Q x G completion ids."""
    from nanospec.models.hub import resolve_model
    model_dir = resolve_model(opts.model)
    key = json.dumps([str(model_dir), opts.questions, opts.G, opts.max_tokens, opts.temps, opts.seed])
    path = CACHE / "bench" / f"suffix_streams-{hashlib.sha1(key.encode()).hexdigest()[:12]}.json"
    if path.is_file():
        return json.loads(path.read_text())
    from transformers import AutoTokenizer
    from nanospec.engine.llm import LLM
    from nanospec.tasks import format_prompt, gsm8k_task
    tok = AutoTokenizer.from_pretrained(model_dir)
    prompts = [format_prompt(tok, problem.prompt) for problem in gsm8k_task().test(opts.questions)]
    llm = LLM(str(model_dir), tok, max_num_seqs=opts.questions * opts.G, speculative=None,
              kv_cache_gib=0.5, max_model_len=512)
    out = {"prompts": prompts}
    for T in opts.temps:
        out[str(T)] = []
        for p in range(2):
            t0 = time.perf_counter()
            params = SamplingParams(temperature=T, max_tokens=opts.max_tokens, n=opts.G, seed=opts.seed + p)
            outs = llm.generate(prompts, params, use_tqdm=False)        # group-major: G per prompt
            out[str(T)].append([[o.token_ids for o in outs[q * opts.G:(q + 1) * opts.G]]
                                for q in range(len(prompts))])
            print(f"[suffix] streams T={T} pass {p + 1}: {sum(len(o.token_ids) for o in outs)} tokens "
                  f"in {time.perf_counter() - t0:.0f}s", file=sys.stderr)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(out))
    tmp.replace(path)
    return out


# ---- peers: one interface over both drafters ------------------------------------------------------
class Ours:
    def __init__(self, **kw):
        self.d = SuffixDrafter(**kw)
        self.params = SamplingParams(max_tokens=1 << 20)

    def history(self, key, prompt, response) -> None:
        s = Sequence(prompt, self.params, prompt_key=key)
        s.token_ids += response
        self.d.observe(s)
        self.d.free(s)

    def next_pass(self) -> None:
        self.d.next_step()

    def start(self, key, prompt) -> None:
        self.s = Sequence(prompt, self.params, prompt_key=key)

    def draft(self, new: list[int], k: int) -> list[int]:
        self.s.token_ids += new                       # the engine appends; the drafter catches up
        return self.d.propose([self.s], [k]).tokens[0]

    def finish(self, new: list[int]) -> None:
        self.s.token_ids += new
        self.d.observe(self.s)
        self.d.free(self.s)


class Arctic:
    """SuffixDecodingCache as its vLLM integration drives it (arctic_inference/vllm/model_runner.py)."""
    depth, factor, min_prob = 64, 1.0, 0.1

    def __init__(self):
        from arctic_inference.suffix_decoding import SuffixDecodingCache
        self.cache, self.n = SuffixDecodingCache(max_tree_depth=self.depth, max_cached_requests=-1), 0

    def history(self, key, prompt, response) -> None:
        self.start(key, prompt)
        self.finish(response)

    def next_pass(self) -> None:
        pass

    def start(self, key, prompt) -> None:
        self.n += 1
        self.cache.start_request(self.n, prompt)
        self.ctx = list(prompt)

    def draft(self, new: list[int], k: int) -> list[int]:
        if new:
            self.cache.add_active_response(self.n, new)
            self.ctx += new
        return self.cache.speculate(self.n, self.ctx[-self.depth:], max_spec_tokens=k, max_spec_factor=self.factor,
                                    min_token_prob=self.min_prob).token_ids

    def finish(self, new: list[int]) -> None:
        if new:
            self.cache.add_active_response(self.n, new)
        self.cache.stop_request(self.n)


def arctic_available() -> bool:
    if ARCTIC_DIR.is_dir() and str(ARCTIC_DIR) not in sys.path:
        sys.path.insert(0, str(ARCTIC_DIR))
    try:
        import arctic_inference.suffix_decoding  # noqa: F401
        return True
    except ImportError:
        return False


# ---- replay ---------------------------------------------------------------------------------------
def replay(peer, prompts: list[list[int]], passes: list, k: int) -> dict:
    gc.collect()
    gc.disable()            # as during rollouts (rollout.no_gc_pauses): no collector pauses in the timings
    try:
        return _replay(peer, prompts, passes, k)
    finally:
        gc.enable()


def _replay(peer, prompts: list[list[int]], passes: list, k: int) -> dict:
    Q, G = len(prompts), len(passes[0][0])
    for j in range(G):                                   # pass 1: history
        for q in range(Q):
            peer.history(q, prompts[q], passes[0][q][j])
    peer.next_pass()
    tokens = steps = proposed = empty = first = 0
    draft_ns = observe_ns = 0
    clock = time.perf_counter_ns
    for j in range(G):                                   # pass 2: measured, finished samples -> history
        for q in range(Q):
            resp = passes[1][q][j]
            peer.start(q, prompts[q])
            i, new = 0, []
            while i < len(resp):
                budget = min(k, len(resp) - i - 1)
                t0 = clock()
                draft = peer.draft(new, budget)
                draft_ns += clock() - t0
                assert len(draft) <= budget, (len(draft), budget)
                acc = 0
                while acc < len(draft) and draft[acc] == resp[i + acc]:
                    acc += 1
                first += acc if i == 0 else 0
                steps, proposed, empty = steps + 1, proposed + len(draft), empty + (not draft)
                new = resp[i:i + acc + 1]
                i += acc + 1
            t0 = clock()
            peer.finish(new)
            observe_ns += clock() - t0
            tokens += len(resp)
    n = Q * G
    return dict(tokens_per_step=tokens / steps, proposed_per_step=proposed / steps, no_draft=empty / steps,
                first_accepted=first / n, draft_ms=draft_ns / steps / 1e6, observe_ms=observe_ns / n / 1e6,
                total_ms=(draft_ns + observe_ns) / steps / 1e6, samples=n, tokens=tokens, steps=steps)


def run(args) -> list[dict]:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="HuggingFaceTB/SmolLM2-135M-Instruct")
    ap.add_argument("--questions", type=int, default=16)
    ap.add_argument("--G", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=160)
    ap.add_argument("--temps", default="1.0,0.6")
    ap.add_argument("--k", type=int, default=8, help="draft budget per step")
    ap.add_argument("--seed", type=int, default=100)
    opts, _ = ap.parse_known_args(args.extra)
    if args.quick:
        opts.questions, opts.G, opts.max_tokens = 4, 4, 64
    opts.temps = [float(t) for t in opts.temps.split(",")]
    data = streams(opts)
    peers = [("arctic", Arctic)] if arctic_available() else []
    if not peers:
        print(f"[suffix] Arctic's suffix decoding not built ({ARCTIC_DIR}): run benchmarks/arctic_build.sh "
              f"for the peer rows", file=sys.stderr)
    peers += [(name, lambda kw=kw: Ours(**kw)) for name, kw in VARIANTS]
    rows = []
    for T in opts.temps:
        base = None
        for name, make in peers:
            r = replay(make(), data["prompts"], data[str(T)], opts.k)
            base = base or r["tokens_per_step"]
            rows.append(dict(name=f"T={T}: {name}", temperature=T, **r, speedup=r["tokens_per_step"] / base,
                             lossy=False))
    return rows
