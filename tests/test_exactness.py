"""Speculative decoding is exact.

Greedy: every token-level drafter gives token-identical output to greedy AR, ragged batches 1..16,
stops and max_tokens inside an accepted run, with preemption.
Sampling: a vocab-8 model, max_tokens 4 (<= 8^4 continuations, eos stops early): the exact AR
distribution over whole continuations by enumeration, vs >= 20k speculative samples, chi-square.
A lossy (lenient) drafter must be rejected by the same test, which shows the test has power.
"""
from collections import Counter

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from conftest import make_hf_model
from nanospec.drafters.base import Drafter, Proposal
from nanospec.drafters.chain import ChainDrafter, find_drafter
from nanospec.drafters.prior import PriorRolloutDrafter
from nanospec.engine.llm import LLM
from nanospec.models.loader import load_model
from nanospec.engine.sequence import SamplingParams

ATOL = 1e-4
K = 3                                    # num_draft_tokens


def run_requests(llm, reqs, prompt_keys=None):
    seqs = [s for i, (p, sp) in enumerate(reqs)
            for s in llm.add_request(p, sp, i, None if prompt_keys is None else prompt_keys[i])]
    while llm.scheduler.has_work():
        llm.step()
    return [llm.output(s) for s in seqs]


def full_forward_logprobs(model, outs, temperatures):
    """log_softmax(logits / T)[token] from one fresh dense forward per output (the trainer's view)."""
    res, dev = [], model.lm_head.weight.device
    with torch.inference_mode():
        for o, T in zip(outs, temperatures):
            ids = o.prompt_token_ids + o.token_ids
            logits = model.logits(model(torch.tensor([ids], device=dev)))[0, len(o.prompt_token_ids) - 1:-1]
            lp = torch.log_softmax(logits.cpu() / (T if T > 0 else 1.0), -1)
            res.append(lp.gather(-1, torch.tensor(o.token_ids)[:, None])[:, 0].numpy())
    return res


def record_proposals(llm):
    """Wrap llm.drafter.propose: seq_id -> (len(seq) when drafted, draft) of its latest proposal."""
    log, orig = {}, llm.drafter.propose

    def propose(seqs, budgets):
        p = orig(seqs, budgets)
        for s, d in zip(seqs, p.tokens):
            log[s.seq_id] = (len(s), list(d))
        return p
    llm.drafter.propose = propose
    return log


class RandomQDrafter(Drafter):
    """A stochastic drafter with a fixed q per draft position (not the target's p): d_j ~ q_j."""
    name, stochastic = "randq", True

    def __init__(self, q, seed=0, only=None):
        self.q, self.only = q, only                # q: [K, V]
        self.g = torch.Generator().manual_seed(seed)

    def propose(self, seqs, budgets):
        B, kmax, V = len(seqs), max(budgets), self.q.shape[-1]
        u = torch.rand(B, kmax, generator=self.g)
        cdf = self.q[:kmax].cumsum(-1)                                      # [kmax, V]
        d = torch.searchsorted(cdf.expand(B, kmax, V).contiguous(), (u * cdf[:, -1]).unsqueeze(-1))
        d = d.squeeze(-1).clamp_(max=V - 1).tolist()
        toks = [row[:k] if self.only is None or self.only(s) else [] for row, k, s in zip(d, budgets, seqs)]
        return Proposal(toks, q=self.q[:kmax].expand(B, kmax, V).clone(),
                        sources=[self.name if t else "" for t in toks])


class ConstantDrafter(Drafter):
    """Deliberately bad deterministic drafts (a fixed pattern per sequence, eos included)."""
    name = "const"
    PATTERNS = ([0, 0, 0], [1, 7, 2], [7, 3, 3], [5, 1, 0])

    def propose(self, seqs, budgets):
        toks = [list(self.PATTERNS[s.seq_id % 4][:k]) for s, k in zip(seqs, budgets)]
        return Proposal(toks, sources=[self.name if t else "" for t in toks])


# ---- greedy: token-identical to AR --------------------------------------------------------------
def repetitive_prompts(n, seed):
    g = np.random.default_rng(seed)
    out = []
    for i in range(n):
        period = g.integers(1, 5)
        motif = g.integers(0, 64, period).tolist()
        out.append((motif * 20)[: int(g.integers(2, 14))])
    return out


GREEDY_SPECS = {
    "ngram": {"method": "ngram", "num_draft_tokens": K},
    "suffix": {"method": "suffix", "num_draft_tokens": K},
    "prior": {"method": "prior", "num_draft_tokens": K},
    "prior+suffix": [{"method": "prior", "num_draft_tokens": K},
                     {"method": "suffix", "num_draft_tokens": K, "min_prob": 0.05}],
}


@pytest.fixture(scope="module")
def greedy_model(tiny_models):
    return load_model(tiny_models["llama"][0])


@pytest.mark.parametrize("name", list(GREEDY_SPECS))
def test_greedy_speculative_is_token_identical(greedy_model, name):
    model = greedy_model
    prompts = repetitive_prompts(16, seed=1)
    keys = [f"p{i}" for i in range(16)]
    ar_llm = LLM(model, block_size=4, max_model_len=64, max_num_seqs=16)
    ar = ar_llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=24), use_tqdm=False)
    for B in (1, 16):
        llm = LLM(model, block_size=4, max_model_len=64, max_num_seqs=16, num_kv_blocks=48,
                  controller=None, speculative=GREEDY_SPECS[name])
        for rnd in range(2):                     # the 2nd round drafts from the 1st round's responses
            outs = llm.generate(prompts[:B], SamplingParams(temperature=0.0, max_tokens=24), use_tqdm=False,
                                prompt_keys=keys[:B])
            for i, (o, r) in enumerate(zip(outs, ar)):
                assert o.token_ids == r.token_ids, f"{name} B={B} round {rnd} prompt {i}"
                np.testing.assert_allclose(o.logprobs, r.logprobs, atol=ATOL)
        assert llm.stats["accepted_tokens"] > 0, f"{name}: no draft was ever accepted"
        if B == 16:
            assert llm.scheduler.num_preemptions > 0
            assert any(any(o.from_verify) for o in outs)
        # round 3: per-request stop tokens and max_tokens that fall inside drafted runs
        reqs = []
        for i, (p, r) in enumerate(zip(prompts[:B], ar)):
            if i % 2:
                reqs.append((p, SamplingParams(temperature=0.0, max_tokens=24, stop_token_ids=[r.token_ids[6 + i % 5]])))
            else:
                reqs.append((p, SamplingParams(temperature=0.0, max_tokens=5 + i)))
        log = record_proposals(llm)
        seqs = [s for i, (p, sp) in enumerate(reqs) for s in llm.add_request(p, sp, i, keys[i])]
        while llm.scheduler.has_work():
            llm.step()
        stop_inside = full_run_at_limit = 0
        for s, (p, sp), r in zip(seqs, reqs, ar):
            want = r.token_ids[:sp.max_tokens]
            if sp.stop_token_ids:
                want = want[:want.index(sp.stop_token_ids[0]) + 1]
            assert s.completion_token_ids == want and s.finish_reason == ("stop" if sp.stop_token_ids else "length")
            L, d = log.get(s.seq_id, (0, []))
            emitted = s.token_ids[L:]
            if d and 0 < len(emitted) <= len(d) + 1 and emitted[:len(d)] == d[:len(emitted)]:
                stop_inside += sp.stop_token_ids != [] and len(emitted) < len(d)
                full_run_at_limit += not sp.stop_token_ids and len(emitted) == len(d) + 1
        assert llm.num_free_blocks == 48
        if name.startswith("prior") and B == 16:     # it replays whole responses: runs cross the stops
            assert stop_inside > 0 and full_run_at_limit > 0, (stop_inside, full_run_at_limit)
            summary = llm.summary()
            assert summary["target_forwards_per_token"] < 0.8 and summary["drafter/prior/accepted"] > 0
            assert summary["acceptance_rate"] == llm.stats["accepted_tokens"] / llm.stats["proposed_tokens"]


def test_greedy_speculation_up_to_max_model_len(greedy_model):
    """Drafts that would run past max_model_len are clipped; output equals AR at the same limit."""
    prompts = repetitive_prompts(6, seed=9)
    params = SamplingParams(temperature=0.0, max_tokens=40)
    long = LLM(greedy_model, block_size=4, max_model_len=64).generate(prompts, params, use_tqdm=False)
    ar = LLM(greedy_model, block_size=4, max_model_len=20).generate(prompts, params, use_tqdm=False)
    llm = LLM(greedy_model, block_size=4, max_model_len=20, controller=None, speculative={"method": "prior", "num_draft_tokens": 5})
    for p, o in zip(prompts, long):
        llm.drafter.add(tuple(p), o.token_ids)                 # cached runs reach past the limit
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.token_ids for o in outs] == [o.token_ids for o in ar]
    assert all(len(o.prompt_token_ids) + len(o.token_ids) == 20 and o.finish_reason == "length" for o in outs)
    assert llm.stats["accepted_tokens"] > 20


def test_speculative_prefill_verifies_the_opening_in_the_prefill_forward(greedy_model):
    """A fresh prompt's drafts ride in its prefill: with the greedy answers cached, the prefill step
    alone emits num_draft_tokens + 1 tokens per prompt, the ones AR emits, logprobs included; prompts
    with a shorter cached opening, or none, draft fewer in the same forward (packed logits: the LM head
    and the verify see each row's real positions only)."""
    prompts = repetitive_prompts(4, seed=3)
    params = SamplingParams(temperature=0.0, max_tokens=20)
    ar = LLM(greedy_model, block_size=4, max_model_len=64).generate(prompts, params, use_tqdm=False)
    llm = LLM(greedy_model, block_size=4, max_model_len=64, controller=None, speculative={"method": "prior", "num_draft_tokens": 5})
    cached = (20, 0, 2, 20)                                              # tokens of each answer cached
    for p, o, n in zip(prompts, ar, cached):
        if n:
            llm.drafter.add(tuple(p), o.token_ids[:n])
    seqs = [s for i, p in enumerate(prompts) for s in llm.add_request(p, params, i)]
    assert llm.step() == [] and llm.stats["target_forwards"] == 1       # the prefill
    assert [s.completion_token_ids for s in seqs] == [o.token_ids[:1 + min(n, 5)] for o, n in zip(ar, cached)]
    while llm.scheduler.has_work():
        llm.step()
    for s, o in zip(seqs, ar):
        assert s.completion_token_ids == o.token_ids
        np.testing.assert_allclose(s.logprobs, o.logprobs, atol=ATOL)


def test_greedy_rows_exact_next_to_sampled_rows_and_stochastic_drafts(greedy_model):
    """Greedy rows in one verify batch with sampled rows, a stochastic drafter and history drafts."""
    model = greedy_model
    prompts = repetitive_prompts(8, seed=4)
    ar = LLM(model, block_size=4, max_model_len=64).generate(prompts, SamplingParams(temperature=0.0,
                                                             max_tokens=20), use_tqdm=False)
    q = torch.softmax(torch.randn(K, 64, generator=torch.Generator().manual_seed(0)) * 3, -1)
    llm = LLM(model, block_size=4, max_model_len=64, controller=None, speculative={"method": "prior", "num_draft_tokens": K})
    llm.drafter = ChainDrafter([llm.drafter, RandomQDrafter(q, only=lambda s: s.seq_id % 2 == 0)])
    for p, r in zip(prompts, ar):
        llm.drafter.drafters[0].add(tuple(p), r.token_ids[:12] + [(t + 1) % 64 for t in r.token_ids[12:]])
    reqs = []
    for i, p in enumerate(prompts):
        reqs.append((p, SamplingParams(temperature=0.0, max_tokens=20)))
        reqs.append((p, SamplingParams(temperature=1.0, max_tokens=20, seed=i)))
    outs = run_requests(llm, reqs)
    assert [o.token_ids for o in outs[::2]] == [r.token_ids for r in ar]
    assert llm.stats["per_drafter"]["randq"]["proposed"] > 0 and llm.stats["per_drafter"]["prior"]["accepted"] > 0
    temps = [sp.temperature for _, sp in reqs]
    for o, ref in zip(outs, full_forward_logprobs(model, outs, temps)):
        np.testing.assert_allclose(o.logprobs, ref, atol=ATOL)


def test_seeded_sampling_with_speculation_is_batch_invariant(greedy_model):
    """A seeded request with a per-sequence drafter (ngram: drafts from its own context only) must
    give the same tokens alone and in a batch: uniforms must not depend on other rows' draft counts."""
    prompts = repetitive_prompts(6, seed=2)
    spec = {"method": "ngram", "num_draft_tokens": K}
    params = SamplingParams(temperature=1.0, max_tokens=24, seed=7)
    batched = LLM(greedy_model, block_size=4, max_model_len=64, controller=None, speculative=spec).generate(
        prompts, params, use_tqdm=False)
    for i in (0, 3):
        alone = LLM(greedy_model, block_size=4, max_model_len=64, controller=None, speculative=spec).generate(
            [prompts[i]], params, use_tqdm=False)[0]
        assert alone.token_ids == batched[i].token_ids, i


# ---- sampling: the exact distribution over all continuations ------------------------------------
V, EOS, MAX_TOKENS, N = 8, 7, 4, 20_000
PROMPT = [1, 2, 3, 1, 2]
TEMP1 = SamplingParams(temperature=1.0, max_tokens=MAX_TOKENS)
FILTERED = SamplingParams(temperature=0.9, top_k=5, top_p=0.85, max_tokens=MAX_TOKENS)
TEMP07 = SamplingParams(temperature=0.7, max_tokens=MAX_TOKENS)
TOP_P06 = SamplingParams(temperature=0.6, top_p=0.9, max_tokens=MAX_TOKENS)
PARAMS = {"temp1": TEMP1, "filtered": FILTERED, "temp07": TEMP07, "top_p06": TOP_P06}


@pytest.fixture(scope="module")
def v8(tmp_path_factory):
    path, _ = make_hf_model(tmp_path_factory.mktemp("v8"), "llama", vocab_size=V, hidden_size=32,
                            eos_token_id=EOS, seed=3)
    return load_model(path)


def reference_probs(logits: torch.Tensor, params: SamplingParams, swap_filters: bool = False) -> torch.Tensor:
    """The sampling distribution written out here, independent of nanospec.engine.sampler: softmax(logits / T)
    after top-k (the k largest logits) and then top-p over the renormalised survivors (the smallest head,
    in descending order, whose mass reaches top_p: a token is kept while the mass ranked above it is
    < top_p) -- the HF / vLLM order. `swap_filters` applies top-p first: the bug the suite must catch."""
    x = logits.double() / params.temperature                                    # [n, V]

    def top_k(x):
        if params.top_k <= 0:
            return x
        return x.masked_fill(x < x.topk(params.top_k, -1).values[:, -1:], float("-inf"))

    def top_p(x):
        if params.top_p >= 1:
            return x
        p_sorted, order = x.softmax(-1).sort(-1, descending=True)
        keep_sorted = p_sorted.cumsum(-1) - p_sorted < params.top_p
        return x.masked_fill(~torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted), float("-inf"))

    return (top_k(top_p(x)) if swap_filters else top_p(top_k(x))).softmax(-1)


def exact_distribution(model, params, swap_filters=False):
    """{continuation tuple: probability} by enumerating every prefix from the model's logits, with the
    sampling distribution of `reference_probs` (not the engine's sampler: the code under test)."""
    dist, frontier = {}, {(): 1.0}
    with torch.inference_mode():
        for depth in range(MAX_TOKENS):
            prefixes = list(frontier)
            ids = torch.tensor([PROMPT + list(c) for c in prefixes])
            logits = model.logits(model(ids))[:, -1]                               # [n, V]
            p = reference_probs(logits, params, swap_filters).numpy()
            nxt = {}
            for c, row in zip(prefixes, p):
                for t in np.nonzero(row)[0]:
                    c2, pr = c + (int(t),), frontier[c] * row[t]
                    if t == EOS or depth == MAX_TOKENS - 1:
                        dist[c2] = pr
                    else:
                        nxt[c2] = pr
            frontier = nxt
    assert abs(sum(dist.values()) - 1) < 1e-6
    return dist


@pytest.fixture(scope="module")
def exact(v8):
    return {"temp1": exact_distribution(v8, TEMP1), "filtered": exact_distribution(v8, FILTERED),
            "temp07": exact_distribution(v8, TEMP07), "top_p06": exact_distribution(v8, TOP_P06)}


def test_reference_tells_the_filter_order_apart(v8, exact):
    """top-p before top-k is another distribution here, far beyond sampling noise: a sampler that swapped
    the order fails test_plain_sampling_matches_enumeration[filtered] and every filtered case below."""
    swapped = exact_distribution(v8, FILTERED, swap_filters=True)
    ref = exact["filtered"]
    tv = 0.5 * sum(abs(ref.get(c, 0.0) - swapped.get(c, 0.0)) for c in set(ref) | set(swapped))
    floor, sd = tv_noise(ref, N)
    assert tv > floor + 20 * sd, (tv, floor, sd)


def chi2(samples, dist):
    """-> (p-value, total variation). Cells with expected count < 5 are pooled; zero-probability
    continuations must never be sampled at all."""
    n, counts = len(samples), Counter(samples)
    impossible = [c for c in counts if c not in dist]
    assert not impossible, f"sampled zero-probability continuations {impossible[:5]}"
    keys = sorted(dist, key=dist.get, reverse=True)
    exp = np.array([dist[k] for k in keys]) * n
    obs = np.array([counts.get(k, 0) for k in keys], dtype=float)
    big = exp >= 5
    exp_c, obs_c = list(exp[big]), list(obs[big])
    if (~big).any():
        exp_c.append(exp[~big].sum())
        obs_c.append(obs[~big].sum())
        if exp_c[-1] < 5:                     # fold a tiny pooled cell into the smallest big one
            exp_c[-2] += exp_c.pop()
            obs_c[-2] += obs_c.pop()
    exp_c = np.array(exp_c) * n / sum(exp_c)
    tv = 0.5 * sum(abs(counts.get(k, 0) / n - dist[k]) for k in keys)
    return chisquare(obs_c, exp_c).pvalue, tv


def tv_noise(dist, n, draws=20):
    """TV between n exact samples and the distribution (the floor any sampler shows): mean, sd."""
    p = np.array(list(dist.values()))
    rng = np.random.default_rng(0)
    tvs = [0.5 * np.abs(rng.multinomial(n, p / p.sum()) / n - p).sum() for _ in range(draws)]
    return float(np.mean(tvs)), float(np.std(tvs))


def sample_with(model, spec, params, drafter=None, setup=None, n=N, **llm_kw):
    """n samples of PROMPT in batches of 5000; drafter replaces the configured one if given."""
    llm = LLM(model, block_size=4, max_model_len=16, max_num_seqs=5000, num_kv_blocks=20_000,
              controller=None, speculative=spec, seed=1234, **llm_kw)
    if drafter is not None:
        llm.drafter = drafter
    if setup is not None:
        setup(llm)
    outs = llm.generate([PROMPT] * 4, SamplingParams(**{**params.__dict__, "n": n // 4}), use_tqdm=False)
    assert len(outs) == n
    return llm, outs


def check_exact(llm, outs, dist, label):
    p, tv = chi2([tuple(o.token_ids) for o in outs], dist)
    floor, sd = tv_noise(dist, len(outs))
    st = llm.stats
    assert st["proposed_tokens"] > 1000 and st["accepted_tokens"] > 0, f"{label}: too few drafts {dict(st)}"
    msg = (f"{label}: chi-square p={p:.2e}, TV={tv:.4f} (exact sampling: {floor:.4f} +- {sd:.4f}), "
           f"accepted {st['accepted_tokens']}/{st['proposed_tokens']} drafts")
    # 1e-3, not 0.01: a 1% false alarm per case is too many over ~30 cases (each a fixed draw: seed 1234,
    # no wall-clock choices); the mutations this suite exists to catch score p < 1e-30
    # (test_model_drafters_sampling_from_q_are_exact)
    assert p > 1e-3 and tv < floor + 6 * sd, msg
    return p, tv


def check_logprobs(model, outs, params):
    uniq = list({tuple(o.token_ids): o for o in outs}.values())[:150]
    for o, ref in zip(uniq, full_forward_logprobs(model, uniq, [params.temperature] * len(uniq))):
        np.testing.assert_allclose(o.logprobs, ref, atol=ATOL)


@pytest.mark.parametrize("key, params", [("temp1", TEMP1), pytest.param("filtered", FILTERED, marks=pytest.mark.slow)])
def test_plain_sampling_matches_enumeration(v8, exact, key, params):
    """The reference itself: AR engine samples follow the enumerated distribution."""
    llm, outs = sample_with(v8, None, params)
    p, tv = chi2([tuple(o.token_ids) for o in outs], exact[key])
    floor, sd = tv_noise(exact[key], N)
    assert p > 0.01 and tv < floor + 6 * sd, f"AR {key}: p={p:.2e} TV={tv:.4f} (floor {floor:.4f})"
    assert key == "temp1" or len(exact[key]) < len(exact["temp1"]) / 2    # the filter really cuts


def _q(seed, support=None):
    g = torch.Generator().manual_seed(seed)
    q = torch.softmax(torch.randn(K, V, generator=g) * 2, -1)
    if support is not None:
        q = q * support
        q = q / q.sum(-1, keepdim=True)
    return q


def _preload_prior(dist):
    """Oracle-ish: the prior-rollout cache holds the 16 likeliest continuations (the AR mode newest).
    observe() is switched off: in a 20k group the first finishers (eos at once) would evict them."""
    def setup(llm):
        prior = find_drafter(llm.drafter, "prior")
        prior.observe = lambda seq: None
        for c in sorted(dist, key=dist.get)[-16:]:          # newest entry = the mode
            prior.add(tuple(PROMPT), list(c))
    return setup


SLOW = pytest.mark.slow
CASES = [pytest.param(c, "temp1", id=f"{c}-temp1") for c in
         ("bad", "oracle", "stochastic", "chain_stochastic_prior", "suffix", "ngram", "prior_suffix",
          "prior_suffix_policies")]
CASES += [pytest.param("stochastic", "filtered", id="stochastic-filtered")]
CASES += [pytest.param(c, "filtered", id=f"{c}-filtered", marks=SLOW) for c in ("bad", "oracle", "ngram")]


@pytest.mark.parametrize("case, key", CASES)
def test_speculative_sampling_is_exact(v8, exact, case, key):
    """(a) bad deterministic drafts, (b) an oracle-ish prior cache, (c) a stochastic q != p (support
    mismatch too), chained with point-mass drafts, (d) suffix / ngram / prior+suffix history drafters."""
    _exact_case(v8, exact, case, key)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("case, key", [("stochastic", "filtered"), ("oracle", "temp1"), ("bad", "temp1"),
                                       ("prior_suffix", "temp1")])
def test_speculative_sampling_is_exact_on_cuda_graphs(v8, exact, case, key):
    """The same on the GPU path: CUDA-graph decode/verify replays, padded batch buckets."""
    import copy
    _exact_case(copy.deepcopy(v8).cuda(), exact, case, key, device="cuda", use_cuda_graphs=True)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("spec, key", [({}, "temp1"), ({}, "top_p06"), ({"draft_vocab": 5}, "top_p06")])
def test_head_sampling_is_exact_on_cuda_graphs(v8, exact, spec, key):
    """A (fresh) draft head drafting on the GPU path: its q through graph-replayed verifies."""
    import copy
    llm, outs = sample_with(copy.deepcopy(v8).cuda(), {"method": "head", "num_draft_tokens": K, **spec},
                            PARAMS[key], device="cuda", use_cuda_graphs=True)
    check_exact(llm, outs, exact[key], f"head{spec}/{key}")


@pytest.fixture(scope="module")
def v8_draft(tmp_path_factory):
    """Another random vocab-8 model: a draft model whose q is far from the target's p."""
    path, _ = make_hf_model(tmp_path_factory.mktemp("v8draft"), "llama", vocab_size=V, hidden_size=32,
                            eos_token_id=EOS, seed=11)
    return path


@pytest.mark.parametrize("method, key", [(m, k) for m in ("self", "draft_model", "head")
                                         for k in ("temp1", "temp07", "filtered", "top_p06")]
                         + [("head_vocab5", "temp1"), ("head_vocab5", "top_p06")])
def test_model_drafters_sampling_from_q_are_exact(v8, v8_draft, exact, method, key):
    """The nf4 self-drafter, a draft model and a (fresh) draft head sample d ~ q and report that q: exact
    at T=1, T<1 and with top-k/top-p. A drafter that emitted argmax(q) while reporting q fails here
    (tests/test_head.py: p < 1e-30)."""
    spec = {"method": method, "num_draft_tokens": K}
    if method == "draft_model":
        spec["model"] = v8_draft
    if method == "head_vocab5":          # a reduced draft vocabulary: q = 0 on 3 of the 8 tokens
        spec = {"method": "head", "num_draft_tokens": K, "draft_vocab": 5}
    llm, outs = sample_with(v8, spec, PARAMS[key])
    check_exact(llm, outs, exact[key], f"{method}/{key}")
    assert any(any(o.from_verify) for o in outs)


def replay_controller(llm) -> None:
    """The engine's draft controller priced by a fixed profile, not this run's clock: its choices (so
    the drafts, so the draws) are the same on every machine and under any load."""
    import json, tempfile
    from nanospec.config import SpeculationConfig
    from nanospec.engine.controller import build_controller
    from nanospec.engine.latency import LatencyModel
    prices = [1.0, 0.0, 1e-5, 0.0, 0.0, 0.05]      # mostly a per-step cost, as a tiny model's is
    grid = [(B, C, Q) for B in (1, 64, 5000) for C in (4, 12) for Q in (1, K + 1)]
    with tempfile.TemporaryDirectory() as tmp:
        path = f"{tmp}/profile.json"
        with open(path, "w") as f:
            json.dump({"samples": [[*shape, float(LatencyModel.features(*shape) @ prices)] for shape in grid]}, f)
        llm.controller = build_controller(SpeculationConfig(latency_profile=path), llm)


def _exact_case(model, exact, case, key, **llm_kw):
    params = PARAMS[key]
    dist = exact[key]
    spec = {"method": "ngram", "num_draft_tokens": K}
    drafter = setup = None
    if case == "bad":
        drafter = ConstantDrafter()
    elif case == "oracle":
        spec, setup = {"method": "prior", "num_draft_tokens": K}, _preload_prior(dist)
    elif case == "stochastic":             # q puts mass on tokens p gives 0 (filtered) and vice versa
        drafter = RandomQDrafter(_q(1, support=torch.tensor([1, 1, 0, 1, 1, 0, 1, 1.0])))
    elif case == "chain_stochastic_prior":
        prior = PriorRolloutDrafter()
        drafter = ChainDrafter([RandomQDrafter(_q(2), only=lambda s: s.seq_id % 3 == 0), prior])
        setup = _preload_prior(dist)
    elif case == "suffix":
        spec = {"method": "suffix", "num_draft_tokens": K, "min_prob": 0.0}
    elif case.startswith("prior_suffix"):
        spec = [{"method": "prior", "num_draft_tokens": K}, {"method": "suffix", "num_draft_tokens": K}]
    if case == "prior_suffix_policies":     # draft lengths from past acceptance and per-token confidence
        setup = replay_controller
    llm, outs = sample_with(model, spec, params, drafter, setup, **llm_kw)
    if case == "prior_suffix_policies":     # the per-token trimming ran (it cut ~half the drafts here)
        assert "suffix" in llm.controller.acceptance.counts
    check_exact(llm, outs, dist, f"{case}/{key}")
    check_logprobs(model, outs, params)
    assert any(any(o.from_verify) for o in outs)


def _lenient_setup(dist, with_logprobs):
    """16 likely (not the likeliest) continuations, with the policy's own per-token logprobs (p_old =
    p_new: the lenient rule then accepts every matching draft) or without any."""
    def setup(llm):
        prior = find_drafter(llm.drafter, "prior")
        prior.observe = lambda seq: None                     # only the entries added here
        for c in sorted(dist, key=dist.get)[-40:-24]:
            with torch.inference_mode():
                logits = llm.model.logits(llm.model(torch.tensor([PROMPT + list(c)])))[0, len(PROMPT) - 1:-1]
            lps = torch.log_softmax(logits, -1).gather(-1, torch.tensor(c)[:, None])[:, 0].tolist()
            prior.add(tuple(PROMPT), list(c), lps if with_logprobs else None)
    return setup


def test_lenient_prior_is_not_exact_and_the_test_sees_it(v8, exact):
    spec = {"method": "prior", "num_draft_tokens": K, "lenience": 3.0}
    with pytest.warns(UserWarning, match="LOSSY"):
        llm, outs = sample_with(v8, spec, TEMP1, setup=_lenient_setup(exact["temp1"], True), n=N)
    assert llm.summary()["lossy"] is True
    p, tv = chi2([tuple(o.token_ids) for o in outs], exact["temp1"])
    floor, sd = tv_noise(exact["temp1"], N)
    assert p < 1e-6, f"lenient drafts passed the exactness test (p={p:.2e}, TV={tv:.4f}): the test has no power"
    assert tv > floor + 6 * sd, (tv, floor, sd)


@pytest.mark.parametrize("chained", [False, True], ids=["prior-no-logprobs", "chain-prior-then-stochastic"])
def test_lenient_rule_only_where_it_has_p_old(v8, exact, chained):
    """Lenience may only change positions that carry a p_old. prior.py: entries without logprobs are
    'verified exactly'; chain.py: rows of other members get lenient_q 1.0, 'the exact rule'. So with
    no logprobs anywhere, a lenient config must still pass the exactness test, alone or chained with a
    stochastic drafter (here the prior has nothing cached: every draft is the stochastic member's)."""
    spec = [{"method": "prior", "num_draft_tokens": K, "lenience": 3.0}]
    with pytest.warns(UserWarning, match="LOSSY"):
        if chained:
            llm, outs = sample_with(v8, spec, TEMP1, setup=_chain_with_randq)
        else:
            llm, outs = sample_with(v8, spec, TEMP1, setup=_lenient_setup(exact["temp1"], False))
    check_exact(llm, outs, exact["temp1"], f"lenient, no logprobs, chained={chained}")


def _chain_with_randq(llm):
    prior = llm.drafter
    prior.observe = lambda seq: None                      # never anything cached: never drafts
    llm.drafter = ChainDrafter([prior, RandomQDrafter(_q(3))])
