"""Flood: 1,000 requests through a KV pool that holds only three of the longest sequences.

Random prompt lengths and max_tokens (long tailed), prompts revisited (prefix cache hits, history
drafts), greedy / seeded / unseeded sampled rows, n > 1 groups, stop tokens, a few requests that run
into max_model_len, arrivals over time (continuous batching), speculation on (a prior -> suffix ->
ngram chain), random aborts of running, preempted and never-run sequences.

Every step: the block manager's ref counts equal the block tables of the running sequences, the
free list is exactly the unreferenced blocks, shared blocks hold the same prompt tokens. At the end:
every sequence finished or was aborted (and only those we aborted), no block and no drafter state
leaked, greedy rows equal plain AR on a large pool (aborted ones: a prefix of it), and sampled rows
are exact where they can be checked row by row -- each token inside its top-k / top-p support and
its logprob that of a fresh dense forward. (Seeded rows are not compared token for token: their
drafts depend on the drafters' history and on the blocks free, so they draw their uniforms
differently from a run on another pool.)
"""
import random
from collections import Counter

import numpy as np
import pytest
import torch

from nanospec.drafters.chain import members
from nanospec.engine.llm import LLM
from nanospec.engine.sequence import SamplingParams, Status
from nanospec.models.loader import load_model

ATOL = 1e-4
N_REQUESTS, SEED = 1000, 0
VOCAB, BS, MAX_LEN = 64, 4, 160
NUM_BLOCKS = 3 * MAX_LEN // BS               # three sequences of max_model_len, no more
SPEC = [{"method": "prior", "num_draft_tokens": 4},
        {"method": "suffix", "num_draft_tokens": 4, "min_prob": 0.3},
        {"method": "ngram", "num_draft_tokens": 4}]


@pytest.fixture(scope="module")
def model(tiny_models):
    return load_model(tiny_models["llama"][0])


def flood_requests(n, seed):
    """n (prompt, SamplingParams) requests over 300 distinct prompts (popular ones come back often)."""
    rng = random.Random(seed)
    prompts = []
    for _ in range(300):
        L = min(int(rng.paretovariate(1.3) * 4), 100)                  # 4 .. 100 tokens, long tail
        if rng.random() < 0.5:                                          # repetitive: ngram / suffix food
            motif = [rng.randrange(VOCAB) for _ in range(rng.randint(1, 5))]
            prompts.append((motif * L)[:L])
        else:
            prompts.append([rng.randrange(VOCAB) for _ in range(L)])
    reqs = []
    for _ in range(n):
        prompt = prompts[min(int(rng.expovariate(1 / 60)), len(prompts) - 1)]
        kw = dict(max_tokens=min(int(rng.paretovariate(1.1) * 6), 200),   # some past max_model_len
                  n=1 if rng.random() < 0.85 else rng.choice([2, 3, 4]),
                  stop_token_ids=[rng.randrange(VOCAB)] if rng.random() < 0.3 else [])
        r = rng.random()
        if r < 0.45:
            kw["temperature"] = 0.0
        else:
            kw.update(temperature=rng.choice([0.6, 1.0, 1.3]), top_k=rng.choice([-1, -1, 8]),
                      top_p=rng.choice([1.0, 1.0, 0.9]), seed=rng.randrange(10**6) if r < 0.9 else None)
        reqs.append((prompt, SamplingParams(**kw)))
    return reqs


def check_blocks(llm):
    """The block manager agrees with the sequences: ref counts = block-table references of the running
    sequences, free list = unreferenced blocks, the prefix cache points at blocks carrying its hash,
    a block shared by several sequences holds the same full prompt block in each."""
    bm, sch = llm.blocks, llm.scheduler
    assert all(s.status == Status.WAITING and not s.block_table for s in sch.waiting)
    assert all(s.status == Status.RUNNING for s in sch.running)
    held, content = Counter(), {}
    for s in sch.running:
        L, nb = len(s), len(s.block_table)
        assert s.num_computed == L - 1 and -(-(L - 1) // BS) <= nb <= -(-L // BS), s
        for i, b in enumerate(s.block_table):
            held[b] += 1
            if held[b] > 1:
                assert (i + 1) * BS <= s.num_prompt_tokens, f"block {b} shared past the prompt of {s}"
                assert content[b] == (i, s.token_ids[i * BS:(i + 1) * BS]), f"block {b} shared, contents differ"
            content[b] = (i, s.token_ids[i * BS:(i + 1) * BS])
    assert bm.ref_count == [held[b] for b in range(bm.num_blocks)]
    assert set(bm.free_blocks) == {b for b in range(bm.num_blocks) if not held[b]}
    assert all(bm.block_hash[b] == h for h, b in bm.hash_to_block.items())
    return sum(c > 1 for c in held.values())


def flood(llm, reqs, seed):
    """Requests arrive in bursts between engine steps; random aborts hit running and waiting sequences.
    -> (all sequences in request order, {seq_id: where it was aborted}, {seq_id: sequence} of those
    that finished in a step, steps that ran with blocks shared between sequences)."""
    rng = random.Random(seed)
    seqs, by_request, aborted, done = [], [], {}, {}
    sch, nxt, steps, sharing = llm.scheduler, 0, 0, 0
    while nxt < len(reqs) or sch.has_work():
        for _ in range(rng.choice([0, 0, 1, 1, 2, 3, 8])):
            if nxt < len(reqs):
                group = llm.add_request(*reqs[nxt], nxt)
                seqs += group
                by_request.append(group)
                nxt += 1
        if rng.random() < 0.08 and sch.has_work():
            preempted = [s for s in sch.waiting if s.num_completion_tokens]   # rarely waiting for long
            pool = (preempted if preempted and rng.random() < 0.3 else
                    sch.running if sch.running and (not sch.waiting or rng.random() < 0.5) else list(sch.waiting))
            victim = rng.choice(pool)
            group = by_request[victim.request_id] if rng.random() < 0.3 else [victim]
            for s in group:
                if s.is_finished:
                    continue
                where = ("running" if s.status == Status.RUNNING else
                         "preempted" if s.num_completion_tokens else "never ran")
                held, free = len(set(s.block_table)), llm.num_free_blocks
                shared = sum(llm.blocks.ref_count[b] > 1 for b in set(s.block_table))
                llm.abort(s)
                aborted[s.seq_id] = where
                assert s.is_finished and s.finish_reason == "abort" and not s.block_table
                assert llm.num_free_blocks == free + held - shared
        if rng.random() < 0.02 and done:                    # aborting a finished request changes nothing
            s = rng.choice(list(done.values()))
            reason = s.finish_reason
            llm.abort(s)
            assert s.finish_reason == reason
        for s in llm.step():
            assert s.seq_id not in done and s.seq_id not in aborted and s.is_finished
            done[s.seq_id] = s
        sharing += check_blocks(llm) > 0
        steps += 1
        if steps % 200 == 0:
            llm.drafter.next_step()                          # an RL step boundary: history windows age
    return seqs, aborted, done, sharing


def dense_logits(model, outs):
    """Logits of each output's completion positions from one dense forward (right-padded batches)."""
    res = []
    with torch.inference_mode():
        for c in range(0, len(outs), 64):
            chunk = outs[c:c + 64]
            ids = [o.prompt_token_ids + o.token_ids for o in chunk]
            T = max(map(len, ids))
            logits = model.logits(model(torch.tensor([x + [0] * (T - len(x)) for x in ids])))
            res += [lg[len(o.prompt_token_ids) - 1:len(x) - 1] for lg, o, x in zip(logits, chunk, ids)]
    return res


@pytest.mark.parametrize("controller", [None, "auto"])
def test_flood_of_requests_through_a_tiny_kv_pool(model, controller, tmp_path, monkeypatch):
    """controller=None drafts the cap every step; "auto" is the default adaptive controller, profiled at
    start-up on this tiny pool (tmp cache: really profiled) and deciding from the clock each step."""
    monkeypatch.setenv("NANOSPEC_CACHE", str(tmp_path))
    reqs = flood_requests(N_REQUESTS, SEED)
    llm = LLM(model, block_size=BS, max_model_len=MAX_LEN, max_num_seqs=32, num_kv_blocks=NUM_BLOCKS,
              max_num_batched_tokens=2 * MAX_LEN, controller=controller, speculative=SPEC)
    assert llm.num_free_blocks == NUM_BLOCKS              # the start-up profile gave every block back
    seqs, aborted, done, sharing = flood(llm, reqs, SEED + 1)
    params = [reqs[s.request_id][1] for s in seqs]
    outs = [llm.output(s) for s in seqs]

    # every sequence finished or was aborted, and only the ones aborted say "abort"
    assert len(seqs) == sum(sp.n for _, sp in reqs) and not llm.scheduler.has_work()
    assert set(done) | set(aborted) == {s.seq_id for s in seqs}
    assert {s.seq_id for s in seqs if s.finish_reason == "abort"} == set(aborted)
    for s, sp in zip(seqs, params):
        n = s.num_completion_tokens
        assert n <= sp.max_tokens and len(s) <= MAX_LEN
        assert not set(s.completion_token_ids[:-1]) & set(sp.stop_token_ids), s
        if s.finish_reason == "stop":
            assert s.completion_token_ids[-1] in sp.stop_token_ids
        elif s.finish_reason == "length":
            assert n == sp.max_tokens or len(s) == MAX_LEN
        else:
            assert s.finish_reason == "abort", s
    # no leak: every block back, ref counts zero, no per-sequence drafter state left
    assert llm.num_free_blocks == NUM_BLOCKS and not any(llm.blocks.ref_count)
    check_blocks(llm)
    for d in members(llm.drafter):
        for attr in ("_state", "_live", "_match"):
            assert not getattr(d, attr, {}), f"{d.name}.{attr} keeps state of sequences that left"
        assert all(t.live == 0 for t in getattr(d, "_trees", {}).values())
    # the flood really flooded: preemption, aborts in every state, drafts from every member accepted
    assert llm.scheduler.num_preemptions > 100 and sharing > 100
    wheres = Counter(aborted.values())
    assert len(aborted) > 100 and all(wheres[w] > 5 for w in ("running", "preempted", "never ran")), wheres
    assert sum(o.finish_reason == "stop" for o in outs) > N_REQUESTS // 40
    assert sum(len(s) == MAX_LEN for s in seqs) > 3
    per = llm.stats["per_drafter"]
    if controller is None:      # drafting the cap: every member drafts. The adaptive controller may
        assert all(per[d]["accepted"] > 0 for d in ("prior", "suffix", "ngram")), dict(per)
    assert llm.stats["accepted_tokens"] > 0, dict(per)    # switch a member off, never all of speculation

    # greedy rows: plain AR on a pool that never preempts; aborted rows stop on a prefix of it
    greedy = [i for i, (_, sp) in enumerate(reqs) if sp.temperature == 0]
    big = LLM(model, block_size=BS, max_model_len=MAX_LEN, max_num_seqs=64)
    ref_seqs = [s for i in greedy for s in big.add_request(*reqs[i], i)]
    while big.scheduler.has_work():
        big.step()
    assert big.scheduler.num_preemptions == 0
    ref = {(s.request_id, s.sample_index): big.output(s) for s in ref_seqs}
    checked = 0
    for s, o, sp in zip(seqs, outs, params):
        if sp.temperature > 0:
            continue
        r = ref[s.request_id, s.sample_index]
        if s.seq_id in aborted:
            assert o.token_ids == r.token_ids[:len(o.token_ids)], (s, aborted[s.seq_id])
        else:
            assert o.token_ids == r.token_ids and o.finish_reason == r.finish_reason, s
            checked += 1
        np.testing.assert_allclose(o.logprobs, r.logprobs[:len(o.logprobs)], atol=ATOL)
    assert checked > N_REQUESTS // 4

    # sampled rows: every token inside its top-k / top-p support, logprobs = a fresh dense forward
    sampled = [(o, sp) for o, sp in zip(outs, params) if sp.temperature > 0 and o.token_ids]
    assert sum(sp.seed is not None for _, sp in sampled) > N_REQUESTS // 4
    for (o, sp), logits in zip(sampled, dense_logits(model, [o for o, _ in sampled])):
        x = logits / sp.temperature                                         # [n, V]
        tok = torch.tensor(o.token_ids)[:, None]
        np.testing.assert_allclose(o.logprobs, torch.log_softmax(x, -1).gather(-1, tok)[:, 0].numpy(), atol=ATOL)
        x_tok = x.gather(-1, tok)
        if sp.top_k > 0:
            assert ((x > x_tok).sum(-1) < sp.top_k).all(), "a token outside top-k"
            x = x.masked_fill(x < x.topk(sp.top_k, -1).values[:, -1:], float("-inf"))
        if sp.top_p < 1:
            p = torch.softmax(x, -1)
            head = (p * (p > p.gather(-1, tok))).sum(-1)                  # mass ranked above the token
            assert (head < sp.top_p + 1e-5).all(), "a token outside top-p"


DRAFTERS = ["ngram", "suffix", "prior", "suffix_mlp", "self_nf4", "draft_model"]


def pool_draws(n, seed):
    """n engine shapes from a seeded grid, from one max-length sequence's worth of KV blocks upwards."""
    rng = random.Random(seed)
    for _ in range(n):
        bs, L = rng.choice([1, 2, 4, 16]), rng.choice([24, 40, 64, 128, 256])
        one = -(-L // bs)                                         # blocks of one max-length sequence
        yield dict(block_size=bs, max_model_len=L, max_num_seqs=rng.choice([1, 2, 5, 8, 32, 64]),
                   num_kv_blocks=one + rng.choice([0, 0, 1, one // 2, 2 * one, 10 * one]))


@pytest.mark.parametrize("shape", list(pool_draws(8, 29)), ids=lambda d: "-".join(map(str, d.values())))
def test_any_pool_that_decodes_also_speculates(tiny_models, shape, tmp_path, monkeypatch):
    """Property: every (num_kv_blocks, block_size, max_model_len, max_num_seqs) that generates with
    speculative=None also generates with every drafter under the default adaptive controller, greedy
    output identical to AR, and the start-up latency profile (which times batched forwards on scratch
    blocks) neither fails for lack of blocks nor keeps any. The cache is a tmp dir: each pool profiles."""
    monkeypatch.setenv("NANOSPEC_CACHE", str(tmp_path))
    target, draft = tiny_models["llama"][0], tiny_models["qwen2"][0]
    L = shape["max_model_len"]
    rng = random.Random(L)
    prompts = []
    for i in range(6):                       # repetitive prompts (n-gram / suffix food), some near L
        motif = [rng.randrange(VOCAB) for _ in range(rng.randint(1, 4))]
        prompts.append((motif * L)[:rng.randint(2, L // 2 if i else L - 2)])
    params = SamplingParams(temperature=0.0, max_tokens=L)   # most run into max_model_len
    ar = LLM(target, speculative=None, **shape).generate(prompts, params, use_tqdm=False)
    for method in DRAFTERS:
        spec = {"method": method, "num_draft_tokens": 4, **({"model": draft} if method == "draft_model" else {})}
        llm = LLM(target, speculative=spec, **shape)
        assert llm.num_free_blocks == shape["num_kv_blocks"], f"{method}: the profile kept KV blocks"
        for rnd in range(2):                 # the second round drafts from the first's history
            outs = llm.generate(prompts, params, use_tqdm=False)
            assert [o.token_ids for o in outs] == [o.token_ids for o in ar], f"{method}, round {rnd}"
        assert llm.num_free_blocks == shape["num_kv_blocks"], f"{method}: leaked KV blocks"
