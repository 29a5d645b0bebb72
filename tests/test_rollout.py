"""Data-parallel rollouts: bubble drafting, length-aware assignment, exactness.

World-2 checks run in two spawned gloo processes (one thread each) that write their results to a
pickle; the parent asserts. World-1 checks run in-process.
"""
import os
import pickle
import socket
import tempfile
import time
import traceback
import warnings
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.multiprocessing as mp

from conftest import make_hf_model
from nanospec.rl import dist
from nanospec.rl import rollout
from nanospec.config import Config, GRPOConfig, SpeculationConfig
from nanospec.engine.llm import LLM
from nanospec.rl.scheduling import assign_to_ranks, imbalance, rank_work
from nanospec.engine.controller import build_controller
from nanospec.rl.rollout import RolloutWorker, assign_prompts, generate_until
from nanospec.engine.sequence import SamplingParams
from tools.soak import write_profile
from nanospec.tasks import Problem, SyntheticTask, build_tiny_vocab_tokenizer, build_tokenizer

MAX_TOKENS, G = 24, 2
SPEC = [{"method": "prior", "num_draft_tokens": 4}, {"method": "suffix", "num_draft_tokens": 4}]
LONG_TAIL = [90, 80, 5, 5, 4, 4, 3, 3]       # predicted lengths of the step-3 prompts (world 2)


def greedy_cfg(**policies):
    """Every policy on, the controller priced by a fixed profile (soak.write_profile), not this machine's
    clock: which drafts run, and so the assertions on their counts, do not depend on load."""
    profile = Path(tempfile.gettempdir()) / f"nanospec-test-profile-{os.getpid()}.json"
    if not profile.exists():
        write_profile(profile)
    return Config(grpo=GRPOConfig(num_generations=G, max_completion_length=MAX_TOKENS, temperature=0.0),
                  speculation=SpeculationConfig(length_classes=[8, 16], length_class_budgets=[0, 2, 4],
                                                latency_profile=str(profile), **policies))


def problems(n=16):
    """n distinct prompts (the Zipf task repeats short ones), so per-prompt predictions stay distinct."""
    return list({p.prompt: p for p in SyntheticTask(seed=0).train(8 * n)}.values())[:n]


def make_llm(model_dir, tok, seed=0, spec=SPEC, cfg=None):
    llm = LLM(model_dir, tokenizer=tok, max_model_len=128, max_num_seqs=32, block_size=16, controller=None, speculative=spec,
              seed=seed)
    llm.controller = build_controller(cfg.speculation, llm) if cfg is not None else None
    return llm


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, tok):
    return make_hf_model(tmp_path_factory.mktemp("rollout"), "llama", vocab_size=len(tok),
                         eos_token_id=tok.eos_token_id, max_pos=256, seed=5)[0]


@pytest.fixture(scope="module")
def reference(model_dir, tok):
    """Plain greedy AR (no drafter, no policy): {prompt: (completion ids, logprobs)}."""
    probs = problems()
    w = RolloutWorker(make_llm(model_dir, tok, spec=None), tok, greedy_cfg())
    outs = w.llm.generate([w.prompt_ids(p) for p in probs], SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS),
                          use_tqdm=False)
    return {p.prompt: (o.token_ids, o.logprobs) for p, o in zip(probs, outs)}


def check_greedy(samples, reference, label):
    groups = Counter(s.prompt_key for s in samples)
    assert all(c == G for c in groups.values()), f"{label}: groups not whole: {groups}"
    for s in samples:
        want, lps = reference[s.prompt_key]
        assert s.completion_ids == want, f"{label}: {s.prompt_key!r}"
        np.testing.assert_allclose(s.logprobs, lps, atol=1e-4)


# ---- world 1 --------------------------------------------------------------------------------------
def test_assign_prompts_equal_counts_and_errors():
    assert assign_prompts([1, 2, 3, 4], 2, False) == [[0, 1], [2, 3]]
    assert sorted(sum(assign_prompts(LONG_TAIL, 2, True), [])) == list(range(8))
    with pytest.raises(ValueError, match="multiple of world_size=2"):
        assign_prompts([1, 2, 3], 2, True)


def test_greedy_all_policies_identical_to_ar(model_dir, tok, reference):
    """Speculation (prior+suffix) + the controller's rule + length classes + length-aware assignment +
    bubble drafting switched on: token-identical to plain AR over 3 steps with repeated prompts."""
    probs = problems(8)
    cfg = greedy_cfg()
    w = RolloutWorker(make_llm(model_dir, tok, cfg=cfg), tok, cfg)
    proposed = prior_accepted = drafting_time = 0
    for step, batch in enumerate([probs[0:4], probs[2:6], probs[2:6]]):
        order = assign_prompts([w.predict(p) for p in batch], 1, True)[0]
        samples, m = w.run(step, batch, probs[4:8])
        check_greedy(samples, reference, f"step {step}")
        assert [s.prompt_key for s in samples[::G]] == [batch[i].prompt for i in order]   # whole groups, LPT order
        assert m["rank_busy_time"][0] > 0 and m["step"] == step and 0 <= m["spec_on_frac"] <= 1
        parts = [m[f"rank_time_{k}"][0] for k in ("prefill", "decode", "propose")]   # where the time went
        assert parts[0] > 0 and parts[1] > 0 and parts[2] >= 0 and sum(parts) < m["rank_busy_time"][0]
        drafting_time += parts[2]
        proposed += m["proposed_tokens"]
        prior_accepted += m.get("drafter/prior/accepted", 0)
        assert not w.llm.scheduler.has_work() and w.llm.num_free_blocks == w.llm.blocks.num_blocks
    assert proposed > 0 and prior_accepted > 0 and drafting_time > 0
    w2 = RolloutWorker(w.llm, tok, cfg)
    w2.load_state_dict(w.state_dict())
    assert w2.predict(probs[2]) == w.predict(probs[2]) == MAX_TOKENS
    with pytest.raises(ValueError, match="world_size"):
        RolloutWorker(w.llm, tok, cfg, rank=0, world_size=2)        # no process group


class FakeSignal:
    """'Everyone done' after `polls` calls of done() (world-1 stand-in for a slow peer)."""
    def __init__(self, polls):
        self.polls = polls

    def done(self):
        self.polls -= 1
        return self.polls < 0


def exact_distribution(model, prompt, eos, max_tokens):
    """{continuation: probability} of temperature-1 AR sampling, by enumerating every prefix."""
    out, frontier = {}, {(): 1.0}
    for depth in range(max_tokens):
        prefixes = list(frontier)
        with torch.inference_mode():
            logits = model.logits(model(torch.tensor([prompt + list(c) for c in prefixes])))[:, -1]
        for c, row in zip(prefixes, torch.softmax(logits.double(), -1).numpy()):
            for t, pt in enumerate(row):
                (out if t == eos or depth == max_tokens - 1 else frontier)[c + (t,)] = frontier[c] * pt
            del frontier[c]
    assert abs(sum(out.values()) - 1) < 1e-6
    return out


def test_bubble_drafts_are_exact_chi_square(tmp_path):
    """Bubble drafts pre-generated (through the bubble path, cut short -> partial drafts) at perturbed
    weights, then 20k samples at the true weights through RolloutWorker.run: the continuation
    distribution must be the enumerated AR one (p > 0.01), with many bubble drafts verified."""
    from test_exactness import chi2
    tok = build_tiny_vocab_tokenizer(["x"])                       # vocab 8: ids 0-6 special, x = 7
    path, _ = make_hf_model(tmp_path, "llama", vocab_size=8, hidden_size=32, eos_token_id=tok.eos_token_id, seed=3)
    problem = Problem("x x x", "")
    cfg = Config(grpo=GRPOConfig(num_generations=5000, max_completion_length=4, temperature=1.0),
                 speculation=SpeculationConfig(toggle=False, length_classes=[]))
    llm = LLM(path, tokenizer=tok, block_size=4, max_model_len=16, max_num_seqs=5000, num_kv_blocks=20_000,
              controller=None, speculative=[{"method": "prior", "num_draft_tokens": 3}], seed=1234)
    llm.controller = build_controller(cfg.speculation, llm)                  # None: always the cap
    w = RolloutWorker(llm, tok, cfg)
    true = {k: v.clone() for k, v in llm.model.state_dict().items()}
    g = torch.Generator().manual_seed(0)
    llm.load_weights({k: v + 0.3 * v.std() * torch.randn(v.shape, generator=g) if v.dim() == 2 else v
                      for k, v in true.items()})
    pre = RolloutWorker(llm, tok, Config(grpo=GRPOConfig(num_generations=16, max_completion_length=4)))
    drafts = pre._bubble(FakeSignal(2), [problem] * 16)           # prefill + 1 decode step, then abort
    assert len(drafts) == 16 and not llm.scheduler.has_work() and llm.num_free_blocks == 20_000
    assert any(len(ids) < 4 and ids[-1] != tok.eos_token_id for _, ids, _ in drafts), "no partial draft kept"
    assert not w.prior._cache, "bubble responses leaked into the prior cache as 'prior'"
    llm.load_weights(true)
    for key, ids, lps in drafts:
        w.prior.add(key, ids, lps, source="bubble")
    w.prior.observe = lambda seq: None         # keep only the bubble entries (20k finishers would evict them)
    samples, m = w.run(0, [problem] * 4)
    dist_ = exact_distribution(llm.model, w.prompt_ids(problem), tok.eos_token_id, 4)
    p, tv = chi2([tuple(s.completion_ids) for s in samples], dist_)
    assert m["drafter/bubble/proposed"] > 1000 and m["bubble_draft_accepted"] > 0, m
    assert p > 0.01, f"bubble drafts changed the distribution: p={p:.2e} TV={tv:.4f}"


# ---- world 2: spawned gloo ranks -------------------------------------------------------------------
def _timed_steps(llm, log):
    step = llm.step

    def timed():
        t = time.time()
        out = step()
        log.append((t, time.time()))
        return out
    llm.step = timed


def _signal_case(rank, model_dir, tok):
    """Rank 0 has no prompts: arrives at once and generates (bubble); rank 1 arrives once rank 0 has run
    4 of its 240 engine steps (counted in the store: no sleep that a loaded or a fast box outruns)."""
    sig, out, store = dist.DoneSignal(), {}, torch.distributed.distributed_c10d._get_default_store()
    if rank == 0:
        llm = LLM(model_dir, tokenizer=tok, max_model_len=256, max_num_seqs=16)
        llm.add_request([1, 5, 7, 8, 6], SamplingParams(temperature=0.0, max_tokens=240, ignore_eos=True, n=16))
        log = []
        _timed_steps(llm, log)
        step = llm.step
        llm.step = lambda: (step(), store.add("nanospec-test/bubble-steps", 1))[0]
    dist.barrier()
    if rank == 0:
        sig.arrive()
        out["n"] = generate_until(llm, sig.done)
        out.update(t_exit=time.time(), steps=log, busy_at_exit=llm.scheduler.has_work())
    else:
        while store.add("nanospec-test/bubble-steps", 0) < 4:
            time.sleep(0.002)
        out["t_signal"] = time.time()
        sig.arrive()
    sig.wait()
    return dist.all_gather_object(out)


def _worker_case(rank, model_dir, tok):
    cfg = greedy_cfg()
    llm = make_llm(model_dir, tok, seed=rank, cfg=cfg)
    w = RolloutWorker(llm, tok, cfg, rank, 2)
    probs, log, arrivals = problems(), [], []
    if rank == 1:           # the straggler, deterministically: its last engine step ends 0.2 s after rank 0 arrived
        step_fn = llm.step

        def last_step_late():
            out = step_fn()
            if not llm.scheduler.has_work():
                store, key = torch.distributed.distributed_c10d._get_default_store(), f"nanospec/done/{dist.DoneSignal._created + 1}"
                while store.add(key, 0) < 1:
                    time.sleep(0.002)
                time.sleep(0.2)
            return out
        llm.step = last_step_late
    _timed_steps(llm, log)
    arrive, until, exits = dist.DoneSignal.arrive, rollout.generate_until, []
    dist.DoneSignal.arrive = lambda self: (arrivals.append(time.time()), arrive(self))[1]
    rollout.generate_until = lambda *a: (until(*a), exits.append(time.time()))[0]
    res = []
    for step, (batch, upcoming) in enumerate([(probs[0:4], probs[4:8]), (probs[4:8], probs[8:16])]):
        samples, m = w.run(step, batch, upcoming)
        res.append(dict(samples=[(s.prompt_key, s.completion_ids, s.logprobs) for s in samples], m=m))
    for p, L in zip(probs[8:16], LONG_TAIL):      # identical observations on both ranks
        for _ in range(4):
            w.predictor.observe(p.prompt, [L])
    pred = [w.predict(p) for p in probs[8:16]]
    samples, m = w.run(2, probs[8:16], [])
    res.append(dict(samples=[(s.prompt_key, s.completion_ids, s.logprobs) for s in samples], m=m, pred=pred))
    with warnings.catch_warnings(record=True) as rec:      # both ranks seed 7: must be told and reseeded
        warnings.simplefilter("always")
        shared = make_llm(model_dir, tok, seed=7, spec=None)
        RolloutWorker(shared, tok, cfg, rank, 2)
    reseed = ([str(r.message) for r in rec], shared.generator.initial_seed())
    return dict(res=res, steps=log, arrivals=arrivals, bubble_exits=exits, reseed=reseed, free=llm.num_free_blocks == llm.blocks.num_blocks)


def _rank_main(rank, port, model_dir, out_dir):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2",
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE="2")
    torch.set_num_threads(1)
    try:
        dist.init_distributed(timeout_s=90)
        tok = build_tokenizer()
        res = {"signal": _signal_case(rank, model_dir, tok), "worker": _worker_case(rank, model_dir, tok)}
        with open(os.path.join(out_dir, f"rank{rank}.pkl"), "wb") as f:
            pickle.dump(res, f)
        dist.cleanup()
    except BaseException:
        with open(os.path.join(out_dir, f"rank{rank}.err"), "w") as f:
            f.write(traceback.format_exc())
        raise


@pytest.fixture(scope="module")
def world2(model_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("world2")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_rank_main, args=(r, port, model_dir, str(out))) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)
    for p in procs:
        if p.is_alive():
            p.kill()
    errs = "".join(f.read_text() for f in sorted(out.glob("*.err")))
    assert [p.exitcode for p in procs] == [0, 0], f"a rank failed or hung (deadlock?)\n{errs}"
    return [pickle.load(open(out / f"rank{r}.pkl", "rb")) for r in range(2)]


def test_empty_rank_bubble_stops_within_one_engine_step(world2):
    r0, r1 = world2[0]["signal"]
    assert r0["busy_at_exit"], "the bubble ran out of work before the signal: test has no power"
    assert r0["n"] > 3, "no bubble generation happened while waiting"
    t = r1["t_signal"]
    after = [s for s in r0["steps"] if s[0] > t]
    assert len(after) <= 1, f"{len(after)} engine steps started after the last rank finished"
    longest = max(b - a for a, b in r0["steps"])
    assert r0["t_exit"] - t < longest + 0.25, (r0["t_exit"] - t, longest)      # slack: a descheduled rank


def test_world2_greedy_identical_assignment_and_bubble(world2, reference):
    w0, w1 = (w["worker"] for w in world2)
    assert w0["free"] and w1["free"], "KV blocks leaked (bubble sequences not aborted?)"
    assert all(any("share engine seeds" in m for m in w["reseed"][0]) for w in (w0, w1))
    assert w0["reseed"][1] != w1["reseed"][1]
    probs = problems()
    for step, (a, b) in enumerate(zip(w0["res"], w1["res"])):
        keys = [k for k, _, _ in a["samples"]] + [k for k, _, _ in b["samples"]]
        batch = [probs[0:4], probs[4:8], probs[8:16]][step]
        assert Counter(keys) == Counter(p.prompt for p in batch for _ in range(G)), f"step {step}: not each prompt once"
        for key, ids, lps in a["samples"] + b["samples"]:
            assert ids == reference[key][0], f"step {step}: world-2 output differs from world-1 AR"
            np.testing.assert_allclose(lps, reference[key][1], atol=1e-4)
        for k in ("rank_busy_time", "rank_predicted_work", "bubble_draft_tokens", "proposed_tokens"):
            assert a["m"][k] == b["m"][k], f"step {step}: ranks disagree on {k}"
    m0, m1, m2 = (r["m"] for r in w0["res"])
    # rank 0 is fast: its bubble pre-generated the next prompts, which rank 0 and 1 used next step
    assert m0["rank_bubble_time"][0] > m0["rank_bubble_time"][1] and m0["rank_bubble_draft_time"][0] > 0
    assert m0["rank_bubble_draft_tokens"][0] > 0 and m0["rank_bubble_draft_tokens"][1] == 0
    assert m1["bubble_draft_accepted"] > 0 and 0 < m1["bubble_recovered_frac"] <= 1
    # the fast rank stopped bubbling within one engine step of the straggler's arrival
    assert len(w0["bubble_exits"]) == 2 and not w1["bubble_exits"]
    longest = max(b - a for a, b in w0["steps"])
    for t, t_exit in zip(w1["arrivals"], w0["bubble_exits"]):
        assert len([a for a, _ in w0["steps"] if t < a <= t_exit]) <= 1
        assert t_exit - t < longest + 0.05
    # step 3: long-tailed predictions -> LPT assignment, better balanced than contiguous
    pred = w0["res"][2]["pred"]
    assert pred == w1["res"][2]["pred"], "ranks' length predictors diverged"
    lpt = assign_to_ranks(pred, 2)
    assert m2["rank_predicted_work"] == rank_work(pred, lpt)
    assert m2["predicted_imbalance"] < imbalance(rank_work(pred, [[0, 1, 2, 3], [4, 5, 6, 7]])) - 0.3
    for r, w in enumerate((w0, w1)):
        got = {k for k, _, _ in w["res"][2]["samples"]}
        assert got == {probs[8 + i].prompt for i in lpt[r]}


def test_no_gc_pauses_turns_the_collector_off_inside_and_restores_it():
    import gc
    from nanospec.rl.rollout import no_gc_pauses
    assert gc.isenabled()
    with pytest.raises(RuntimeError), no_gc_pauses():
        assert not gc.isenabled()
        raise RuntimeError("boom")
    assert gc.isenabled()                   # restored on an error path too
    gc.disable()
    try:
        with no_gc_pauses():
            pass
        assert not gc.isenabled()           # a caller's own choice is kept
    finally:
        gc.enable()


def test_build_controller_maps_the_speculation_config(model_dir, tok):
    """toggle -> the rule (a profiled latency model); length classes -> caps, only when their budgets are
    given; toggle off and no classes -> no controller: every row drafts num_draft_tokens."""
    llm = make_llm(model_dir, tok)
    pol = build_controller(SpeculationConfig(length_classes=[8, 16], length_class_budgets=[0, 2, 4]), llm)
    assert pol.latency is not None and pol.classes.thresholds == (8, 16) and pol.classes.budgets == (0, 2, 4)
    assert pol.min_speedup == SpeculationConfig().toggle_min_speedup
    pol = build_controller(SpeculationConfig(length_classes=[8, 16], length_class_budgets=[0, 2, 4], toggle=False), llm)
    assert pol.classes.budgets == (0, 2, 4) and pol.latency is None
    assert build_controller(SpeculationConfig(toggle=False), llm) is None
