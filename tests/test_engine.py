"""Engine correctness against transformers and against itself.

Reference points: transformers' forward and `generate` (HF families), the model's own dense path
(kv=None) for paged attention, k+1 single-token decodes for a (k+1)-token verify window, a large KV
pool for preemption, n=1 for prefix sharing, transformers' top-k/top-p warpers for the sampler.
"""
import json
import random
import shutil

import numpy as np
import pytest
import torch

from conftest import ARCHS
from nanospec.engine import sampler
from nanospec.engine.llm import LLM
from nanospec.engine import cpu_linear
from nanospec.models.loader import load_model, save_model
from nanospec.engine.runner import Runner
from nanospec.engine.sampler import SamplingTensors
from nanospec.engine.sequence import SamplingParams, Sequence

ATOL = 1e-4
GREEDY = SamplingParams(temperature=0.0, max_tokens=12)


def ragged_prompts(n, vocab=64, seed=0, lo=1, hi=15):
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def run_requests(llm, reqs):
    """Add (prompt, params) requests one by one (own params each), step until done -> outputs."""
    seqs = [s for i, (p, sp) in enumerate(reqs) for s in llm.add_request(p, sp, i)]
    while llm.scheduler.has_work():
        llm.step()
    return [llm.output(s) for s in seqs]


def dense_logits(model, ids):
    with torch.inference_mode():
        return model.logits(model(torch.tensor([ids])))[0]                  # [T, V]


@pytest.fixture(scope="module")
def models(tiny_models):
    return {a: load_model(tiny_models[a][0]) for a in ARCHS}


@pytest.fixture(scope="module")
def hf_greedy(tiny_models):
    """{arch: [completion]} from transformers' generate, one prompt at a time (no padding)."""
    prompts = ragged_prompts(16)
    out = {}
    for a in ARCHS:
        hf = tiny_models[a][1]
        with torch.no_grad():
            out[a] = [hf.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                                  max_new_tokens=GREEDY.max_tokens, do_sample=False, pad_token_id=0
                                  )[0, len(p):].tolist() for p in prompts]
    return prompts, out


# ---- model vs transformers -------------------------------------------------------------------------
@pytest.mark.parametrize("arch", ARCHS)
def test_logits_match_transformers(tiny_models, models, arch):
    hf, model = tiny_models[arch][1], models[arch]
    assert model.args.arch == arch
    ids = torch.randint(0, 64, (3, 23), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf(ids).logits
        ours = model.logits(model(ids))
    assert ours.dtype == torch.float32
    torch.testing.assert_close(ours, ref, atol=ATOL, rtol=0)
    assert ref.std() > 0.3          # sharpened weights: a 1e-4 match is not a match of near-zeros


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_matches_transformers_generate(hf_greedy, models, arch):
    prompts, ref = hf_greedy
    for B in (1, 5, 16):           # ragged batches, block_size 4: prompts of 1..15 cross block edges
        llm = LLM(models[arch], block_size=4, max_num_seqs=16, max_model_len=64)
        outs = llm.generate(prompts[:B], GREEDY, use_tqdm=False)
        assert [o.token_ids for o in outs] == ref[arch][:B], f"{arch} batch {B}"
        assert all(o.finish_reason == "length" for o in outs)
        assert llm.num_free_blocks == llm.blocks.num_blocks


# ---- paged attention vs the dense path -------------------------------------------------------------
def _seqs_with_tables(lengths, runner, seed):
    """Sequences whose block tables are scattered, non-contiguous blocks of the pool."""
    rng = random.Random(seed)
    free = list(range(runner.null_block))
    rng.shuffle(free)
    seqs = []
    for L in lengths:
        s = Sequence([0] * L, SamplingParams())
        nb = -(-L // runner.block_size)
        s.block_table, free = free[:nb], free[nb:]
        seqs.append(s)
    return seqs


@pytest.mark.parametrize("arch", ARCHS)
@torch.inference_mode()
def test_paged_attention_equals_dense(models, arch):
    model = models[arch]
    rng = random.Random(3)
    full = [[rng.randrange(64) for _ in range(L)] for L in (9, 17, 4, 26, 13)]
    # chunks: prefill [0, a), a second prefill chunk [a, c), then a verify window [c, c+k+1)
    cuts = [(3, 5, 3), (8, 12, 4), (1, 2, 1), (13, 20, 5), (4, 12, 0)]
    runner = Runner(model, num_blocks=48, block_size=4)
    # the pool is uninitialised: poison it, so that a block read before it is zeroed or written shows
    # (a masked key still enters attention's sum with weight 0, and 0 x NaN = NaN)
    runner.cache[:, :, :48 * 4] = float("nan")
    seqs = _seqs_with_tables([len(t) for t in full], runner, seed=0)
    dense = [dense_logits(model, t) for t in full]

    def check(spans, what):
        toks = [t[a:b] for t, (a, b) in zip(full, spans)]
        logits = model.logits(runner.forward(seqs, toks, [a for a, _ in spans]))
        for i, (t, (a, b)) in enumerate(zip(full, spans)):
            torch.testing.assert_close(logits[i, :b - a], dense[i][a:b], atol=ATOL, rtol=0,
                                       msg=lambda m: f"{arch} {what} seq {i}: {m}")

    check([(0, a) for a, _, _ in cuts], "prefill chunk 1")
    check([(a, c) for a, c, _ in cuts], "prefill chunk 2")
    # a rejected draft window first writes garbage K/V at [c, c+k+1): a shorter window then leaves
    # stale keys beyond its queries (they must be masked), the full one overwrites them
    garbage = [[(x * 7 + 1) % 64 for x in t[c:c + k + 1]] for t, (_, c, k) in zip(full, cuts)]
    runner.forward(seqs, garbage, [c for _, c, _ in cuts])
    check([(c, c + 1) for _, c, _ in cuts], "decode over stale draft K/V")
    check([(c, c + k + 1) for _, c, k in cuts], "verify window at an offset")
    # and the null block absorbed the padding rows: the pool's real blocks outside the tables are as
    # they were, zeroed below the highest block held, untouched above it
    used = {b for s in seqs for b in s.block_table}
    assert runner.zeroed == 1 + max(used)
    for blk in set(range(runner.null_block)) - used:
        kv = runner.cache[:, :, blk * 4:(blk + 1) * 4]
        assert (kv == 0).all() if blk < runner.zeroed else kv.isnan().all()


@pytest.mark.parametrize("arch", ARCHS)
@torch.inference_mode()
def test_verify_window_equals_successive_decodes(models, arch):
    """Logits of one (k+1)-token verify == k+1 one-token decodes, ragged, any batch mix."""
    model = models[arch]
    rng = random.Random(5)
    prompts = [[rng.randrange(64) for _ in range(L)] for L in (5, 11, 3, 16, 8, 1)]
    windows = [[rng.randrange(64) for _ in range(k + 1)] for k in (4, 0, 2, 5, 1, 3)]
    lengths = [len(p) + len(w) for p, w in zip(prompts, windows)]
    out = {}
    for mode in ("verify", "decode"):
        runner = Runner(model, num_blocks=40, block_size=4)
        seqs = _seqs_with_tables(lengths, runner, seed=1 if mode == "verify" else 2)
        # prefill all but the last prompt token; the window starts with that last token (decode invariant)
        pre = [(i, p[:-1]) for i, p in enumerate(prompts) if len(p) > 1]
        runner.forward([seqs[i] for i, _ in pre], [t for _, t in pre], [0] * len(pre))
        feeds = [[p[-1]] + w[:-1] for p, w in zip(prompts, windows)]   # last token + k drafts
        starts = [len(p) - 1 for p in prompts]
        if mode == "verify":
            logits = model.logits(runner.forward(seqs, feeds, starts))
            out[mode] = [logits[i, :len(f)] for i, f in enumerate(feeds)]
        else:
            rows = [[] for _ in seqs]
            for j in range(max(len(f) for f in feeds)):
                live = [i for i, f in enumerate(feeds) if j < len(f)]
                logits = model.logits(runner.forward([seqs[i] for i in live], [[feeds[i][j]] for i in live],
                                                     [starts[i] + j for i in live]))
                for r, i in enumerate(live):
                    rows[i].append(logits[r, 0])
            out[mode] = [torch.stack(r) for r in rows]
    for i, (v, d) in enumerate(zip(out["verify"], out["decode"])):
        torch.testing.assert_close(v, d, atol=ATOL, rtol=0, msg=lambda m: f"{arch} seq {i}: {m}")
        ref = dense_logits(model, prompts[i] + windows[i][:-1])[len(prompts[i]) - 1:]
        torch.testing.assert_close(v, ref, atol=ATOL, rtol=0)


# ---- scheduler: preemption, prefix sharing ---------------------------------------------------------
def _mixed_requests(n=12, max_tokens=20):
    prompts = ragged_prompts(n, seed=7, lo=3, hi=10)
    kinds = [SamplingParams(temperature=0.0, max_tokens=max_tokens),
             SamplingParams(temperature=1.0, seed=11, max_tokens=max_tokens),
             SamplingParams(temperature=0.8, top_k=10, top_p=0.9, seed=12, max_tokens=max_tokens)]
    return [(p, SamplingParams(**{**kinds[i % 3].__dict__, "seed": None if i % 3 == 0 else 100 + i}))
            for i, p in enumerate(prompts)]


def test_a_rolled_back_draft_block_goes_back_to_its_sequence():
    """Drafts take a block ahead (`ensure`) that a rejection frees again (`truncate`). The row's next
    `ensure` takes that same block back, so its KV stays where it would have been without drafts;
    without this the freed block went to another row and every row's KV spread over the pool. A block
    someone else took meanwhile is left alone."""
    from nanospec.engine.block_manager import BlockManager
    bm = BlockManager(16, 4)
    a, b = Sequence([1, 2, 3], GREEDY), Sequence([4, 5, 6], GREEDY)
    assert bm.allocate_prefill(a, 3) and bm.allocate_prefill(b, 3)
    assert bm.ensure(a, 3 + 4)                       # 4 drafts past the first block
    ahead = a.block_table[1]
    bm.truncate(a, 4)                                # all rejected: 4 tokens fit the first block
    assert a.block_table == [a.block_table[0]] and ahead in bm.free_blocks
    assert bm.ensure(b, 3 + 4) and b.block_table[1] != ahead     # b takes the oldest free block
    assert bm.ensure(a, 5) and a.block_table[1] == ahead          # a grows into its own block again
    bm.truncate(a, 4)
    c = Sequence([7], GREEDY)
    c.block_table.append(bm._take(ahead))                         # meanwhile another row took it
    assert bm.ensure(a, 5) and a.block_table[1] != ahead
    assert all(bm.ref_count[x] == 1 for x in a.block_table + b.block_table + c.block_table)


def test_frozen_heap_keeps_collections_off_the_startup_heap_for_one_run():
    """Inside `frozen_heap` a full collection walks only what was made since it began (the suffix
    trie's nodes), not the model and everything else alive at the start; afterwards, and after an
    error, the heap is unfrozen, so a cycle among those objects that died meanwhile is freed."""
    import gc
    import weakref
    from nanospec.engine.llm import frozen_heap

    class Cycle:
        def __init__(self):
            self.me = self

    old = Cycle()
    gone = weakref.ref(old)
    with frozen_heap():
        assert gc.get_freeze_count() > 1000
        del old                              # garbage, but frozen with the heap: not walked
        gc.collect()
        assert gone() is not None
        new = Cycle()
        new_gone = weakref.ref(new)
        del new                              # made during the run: collected as usual
        gc.collect()
        assert new_gone() is None
    assert gc.get_freeze_count() == 0
    gc.collect()
    assert gone() is None                    # unfrozen: now it is found
    with pytest.raises(RuntimeError), frozen_heap():
        raise RuntimeError("a failed run")
    assert gc.get_freeze_count() == 0
    with frozen_heap():
        with frozen_heap(collect=False):     # `generate` inside the trainer's run: leaves its heap frozen
            pass
        assert gc.get_freeze_count() > 1000
    assert gc.get_freeze_count() == 0


def test_generate_steps_on_a_frozen_heap(models):
    """`LLM.generate` steps inside `frozen_heap` (a suffix trie's nodes set off no full pass over the
    process's heap), and leaves the heap unfrozen."""
    import gc
    llm = LLM(models["llama"], block_size=4, max_model_len=64)
    frozen, step = [], llm.step
    llm.step = lambda: frozen.append(gc.get_freeze_count()) or step()
    llm.generate([[1, 2, 3]], GREEDY, use_tqdm=False)
    assert frozen and min(frozen) > 1000 and gc.get_freeze_count() == 0


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_preemption_leaves_outputs_unchanged(models, arch):
    reqs = _mixed_requests()
    big = LLM(models[arch], block_size=4, max_num_seqs=12, max_model_len=64)
    ref = run_requests(big, reqs)
    assert big.scheduler.num_preemptions == 0
    small = LLM(models[arch], block_size=4, max_num_seqs=12, num_kv_blocks=20, max_model_len=64)
    outs = run_requests(small, reqs)
    assert small.scheduler.num_preemptions > 0
    for r, o in zip(ref, outs):
        assert o.token_ids == r.token_ids and o.finish_reason == r.finish_reason
        np.testing.assert_allclose(o.logprobs, r.logprobs, atol=ATOL)
    assert small.num_free_blocks == 20
    # seeded sampled requests do not depend on the batch they ran in either
    alone = run_requests(LLM(models[arch], block_size=4, max_model_len=64), reqs[1:2])
    assert alone[0].token_ids == ref[1].token_ids


def test_preemption_with_shared_prefix_blocks(models):
    """n=4 groups share prompt blocks; preempting one sibling must not free or corrupt the others'."""
    prompts = ragged_prompts(3, seed=21, lo=9, hi=13)
    params = SamplingParams(temperature=0.0, max_tokens=16, n=4)
    ref = LLM(models["qwen2"], block_size=4, max_model_len=64).generate(prompts, params, use_tqdm=False)
    llm = LLM(models["qwen2"], block_size=4, max_model_len=64, num_kv_blocks=24)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert llm.scheduler.num_preemptions > 0
    assert [o.token_ids for o in outs] == [o.token_ids for o in ref]
    assert llm.num_free_blocks == 24 and all(c == 0 for c in llm.blocks.ref_count)


def test_requests_arriving_mid_rollout(models):
    """Continuous batching: a request added while others decode gets the same tokens as alone."""
    model = models["llama"]
    prompts = ragged_prompts(4, seed=13, lo=2, hi=12)
    alone = [LLM(model, block_size=4, max_model_len=64).generate([p], GREEDY, use_tqdm=False)[0].token_ids
             for p in prompts]
    llm = LLM(model, block_size=4, max_model_len=64)
    seqs = []
    for p in prompts:
        seqs += llm.add_request(p, GREEDY, len(seqs))
        for _ in range(3):
            llm.step()
    while llm.scheduler.has_work():
        llm.step()
    assert [s.completion_token_ids for s in seqs] == alone


def test_load_weights_in_place_and_no_stale_prefix_cache(models, tiny_models):
    """After a weight sync, a prompt seen before must not reuse KV computed with the old weights."""
    model = load_model(tiny_models["llama"][0])
    new = {k: v + 0.05 * torch.randn(v.shape, generator=torch.Generator().manual_seed(1))
           for k, v in model.state_dict().items()}
    prompt = ragged_prompts(1, seed=4, lo=13, hi=13)[0]
    llm = LLM(model, block_size=4, max_model_len=64)
    before = llm.generate([prompt], GREEDY, use_tqdm=False)[0].token_ids
    ptr = model.model.layers[0].self_attn.o_proj.weight.data_ptr()
    llm.load_weights(new)
    assert model.model.layers[0].self_attn.o_proj.weight.data_ptr() == ptr
    after = llm.generate([prompt], GREEDY, use_tqdm=False)[0].token_ids
    fresh = load_model(tiny_models["llama"][0])
    fresh.load_state_dict(new)
    want = LLM(fresh, block_size=4, max_model_len=64).generate([prompt], GREEDY, use_tqdm=False)[0].token_ids
    assert after == want and want != before
    with pytest.raises(ValueError, match="unexpected tensor 'nope'"):
        llm.load_weights({"nope": torch.zeros(1)})
    with pytest.raises(ValueError, match=r"model\.norm\.weight.*shape"):
        llm.load_weights({"model.norm.weight": torch.zeros(3)})


def test_kv_pool_too_small_for_one_sequence_is_a_clear_error(models):
    llm = LLM(models["llama"], block_size=4, num_kv_blocks=2, max_model_len=64)
    with pytest.raises(ValueError, match=r"request 0: prompt \(12 tokens\) \+ max_tokens \(12\) needs 24 KV slots, "
                                         r"the pool holds 8"):
        llm.generate([[1] * 12], GREEDY, use_tqdm=False)
    assert not llm.scheduler.has_work()      # refused up front: nothing queued, nothing half-generated


def test_time_forward_times_a_ragged_prefill_on_scratch_blocks(models):
    """LLM.time_forward with a query length per row (tools.simulate's prefill fit): its scratch blocks all
    come back, and a batch the pool cannot hold is an error, not a partial forward."""
    llm = LLM(models["llama"], block_size=4, num_kv_blocks=16, max_model_len=64)
    free = llm.num_free_blocks
    assert llm.time_forward(3, 0, [5, 17, 9]) > 0 and llm.num_free_blocks == free
    with pytest.raises(RuntimeError, match="not enough free KV blocks"):
        llm.time_forward(3, 0, [40, 40, 40])
    assert llm.num_free_blocks == free


def test_cpu_kv_pool_comes_from_a_byte_budget(models):
    from nanospec.engine.cuda_graphs import kv_block_bytes
    big = LLM(models["llama"], block_size=16, max_num_seqs=64)          # max_model_len 256: 64 x 16 blocks
    assert big.blocks.num_blocks == 64 * 16                              # the budget is not the limit here
    small = LLM(models["llama"], block_size=16, max_num_seqs=64, kv_cache_gib=0.001)
    assert small.blocks.num_blocks == int(0.001 * 2**30 // kv_block_bytes(small.model, 16)) < 64 * 16
    with pytest.raises(ValueError, match="kv_cache_gib must be a number > 0"):
        LLM(models["llama"], kv_cache_gib=-1)


@pytest.mark.parametrize("P", [8, 11])
def test_prefix_sharing_n4(models, P):
    model, bs = models["qwen2"], 4
    prompt = ragged_prompts(1, seed=P, lo=P, hi=P)[0]
    one = LLM(model, block_size=bs, max_model_len=64).generate([prompt], GREEDY, use_tqdm=False)
    llm = LLM(model, block_size=bs, max_model_len=64)
    seqs = llm.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=12, n=4))
    llm.step()                                                   # the prefill step
    full = P // bs                                               # full blocks shared
    tables = [s.block_table for s in seqs]
    assert all(t[:full] == tables[0][:full] for t in tables)
    assert len({b for t in tables for b in t[full:]}) == 4 * (len(tables[0]) - full)   # the rest private
    assert all(llm.blocks.ref_count[b] == 4 for b in tables[0][:full])
    assert llm.stats["prefill_tokens"] == P + 3 * max(P - full * bs, 1)   # all shared: the last token
    while llm.scheduler.has_work():
        llm.step()
    assert [llm.output(s).token_ids for s in seqs] == [one[0].token_ids] * 4
    assert llm.num_free_blocks == llm.blocks.num_blocks
    # off: every sample computes the whole prompt, same outputs
    off = LLM(model, block_size=bs, max_model_len=64, prefix_caching=False)
    outs = off.generate([prompt], SamplingParams(temperature=0.0, max_tokens=12, n=4), use_tqdm=False)
    assert [o.token_ids for o in outs] == [one[0].token_ids] * 4 and off.stats["prefill_tokens"] == 4 * P
    # sampled siblings share the prompt's KV but not their randomness
    outs = llm.generate([prompt], SamplingParams(temperature=1.0, max_tokens=12, n=4, seed=3), use_tqdm=False)
    assert len({tuple(o.token_ids) for o in outs}) > 1
    assert [(o.request_id, o.sample_index) for o in outs] == [(0, j) for j in range(4)]


# ---- loader ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("arch", ARCHS)
def test_save_then_transformers_load_round_trip(tiny_models, models, tmp_path, arch):
    from transformers import AutoModelForCausalLM
    save_model(models[arch], tmp_path)
    hf = AutoModelForCausalLM.from_pretrained(str(tmp_path)).eval()
    assert type(hf).__name__ == type(tiny_models[arch][1]).__name__
    ids = torch.randint(0, 64, (2, 19), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits, tiny_models[arch][1](ids).logits, atol=ATOL, rtol=0)
    again = load_model(tmp_path)
    for k, v in models[arch].state_dict().items():
        assert torch.equal(again.state_dict()[k], v), k


def _copy(src, dst):
    shutil.copytree(src, dst)
    return dst


def _edit_config(d, **kw):
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(kw)
    (d / "config.json").write_text(json.dumps(cfg))


def test_loader_errors_name_file_and_key(tiny_models, tmp_path):
    src = tiny_models["llama"][0]
    d = _copy(src, tmp_path / "gpt2")
    _edit_config(d, model_type="gpt2")
    with pytest.raises(ValueError, match=r"config\.json.*'gpt2'.*not supported"):
        load_model(d)
    d = _copy(src, tmp_path / "noweights")
    (d / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match=r"noweights.*model\.safetensors"):
        load_model(d)
    d = _copy(src, tmp_path / "noconfig")
    (d / "config.json").unlink()
    with pytest.raises(FileNotFoundError, match=r"noconfig.*config\.json"):
        load_model(d)
    d = _copy(src, tmp_path / "shape")
    _edit_config(d, intermediate_size=96)
    with pytest.raises(ValueError, match=r"shape.*'model\.layers\.0\.mlp\.\w+_proj\.weight'.*\(96"):
        load_model(d)
    d = _copy(src, tmp_path / "badjson")
    (d / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"badjson.*config\.json.*invalid JSON"):
        load_model(d)


def test_loader_sharded_checkpoint(tiny_models, models, tmp_path):
    hf = tiny_models["qwen3"][1]
    hf.save_pretrained(tmp_path, max_shard_size="60KB")
    shards = sorted(tmp_path.glob("model-*.safetensors"))
    assert len(shards) > 1
    m = load_model(tmp_path)
    ids = torch.randint(0, 64, (1, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(m.logits(m(ids)), hf(ids).logits, atol=ATOL, rtol=0)
    shards[-1].unlink()
    with pytest.raises(FileNotFoundError, match=shards[-1].name):
        load_model(tmp_path)


# ---- bad input ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("prompts, params, pattern", [
    ([[1, 2], []], GREEDY, r"request 1: prompt is empty"),
    ([[1] * 64], GREEDY, r"request 0: prompt has 64 tokens, max_model_len is 64"),
    ([[1, 2], [3, 64]], GREEDY, r"request 1: prompt token ids .*\[0, 64\)"),
    ([[-1, 2]], GREEDY, r"request 0: prompt token ids"),
    ([[1, 2.0]], GREEDY, r"request 0: prompt token ids"),
    ([[1, 2]], SamplingParams(max_tokens=0), r"SamplingParams: .*max_tokens must be > 0"),
    ([[1, 2]], SamplingParams(max_tokens=-3), r"SamplingParams: .*max_tokens"),
    ([[1, 2]], SamplingParams(top_p=0.0), r"SamplingParams: .*top_p must be in \(0, 1\]"),
    ([[1, 2]], SamplingParams(top_p=1.5), r"SamplingParams: .*top_p"),
    ([[1, 2]], SamplingParams(top_k=0), r"SamplingParams: .*top_k"),
    ([[1, 2]], SamplingParams(temperature=-1.0), r"SamplingParams: .*temperature"),
    ([[1, 2]], SamplingParams(n=0), r"SamplingParams: .*n must be >= 1"),
    (["a string"], GREEDY, r"request 0: prompt is a string but the LLM has no tokenizer"),
])
def test_bad_input_raises_clear_value_error(models, prompts, params, pattern):
    llm = LLM(models["llama"], block_size=4, max_model_len=64)
    with pytest.raises(ValueError, match=pattern):
        llm.generate(prompts, params, use_tqdm=False)
    # a rejected call leaves nothing behind: no queued request, no KV held
    assert not llm.scheduler.has_work(), "a failed generate() left earlier requests queued"
    assert llm.num_free_blocks == llm.blocks.num_blocks


def test_prompt_at_length_limit(models):
    llm = LLM(models["llama"], block_size=4, max_model_len=16)
    out = llm.generate([[1] * 15], GREEDY, use_tqdm=False)[0]
    assert len(out.token_ids) == 1 and out.finish_reason == "length"
    out = llm.generate([[1] * 10], GREEDY, use_tqdm=False)[0]
    assert len(out.token_ids) == 6 and out.finish_reason == "length"


# ---- sampler -----------------------------------------------------------------------------------------
def _reference_probs(logits, T, top_k, top_p):
    """transformers' warpers in generate's order: temperature, top-k, then top-p on what is left."""
    from transformers.generation.logits_process import TopKLogitsWarper, TopPLogitsWarper
    x = logits.double() / (T if T > 0 else 1.0)
    if top_k > 0:
        x = TopKLogitsWarper(top_k)(None, x)
    if top_p < 1.0:
        x = TopPLogitsWarper(top_p)(None, x)
    return x.softmax(-1)


def _hand_probs(logits, T, top_k, top_p):
    """The same by hand: keep the k largest, then the smallest head whose (renormalised) mass >= p."""
    p = torch.softmax(logits.double() / (T if T > 0 else 1.0), -1)
    out = torch.zeros_like(p)
    for r in range(p.shape[0]):
        order = p[r].argsort(descending=True)[: top_k if top_k > 0 else None]
        kept = p[r, order] / p[r, order].sum()
        head = int((kept.cumsum(0) - kept < top_p).sum())
        out[r, order[:head]] = kept[:head] / kept[:head].sum()
    return out


SAMPLER_CASES = [(1.0, -1, 1.0), (0.7, -1, 1.0), (1.3, 5, 1.0), (1.0, -1, 0.8), (0.9, -1, 0.5),
                 (1.0, 20, 0.9), (0.6, 8, 0.7), (0.0, -1, 1.0)]


@pytest.mark.parametrize("T, top_k, top_p", SAMPLER_CASES)
def test_sampler_probs_match_reference(T, top_k, top_p):
    logits = torch.randn(6, 3, 64, generator=torch.Generator().manual_seed(0)) * 3
    st = SamplingTensors.from_params([SamplingParams(temperature=T, top_k=top_k, top_p=top_p)] * 6, 64, "cpu")
    ours = sampler.probs(logits, st)
    flat = logits.view(-1, 64)
    hand, ref = _hand_probs(flat, T, top_k, top_p), _reference_probs(flat, T, top_k, top_p)
    torch.testing.assert_close(hand, ref, atol=1e-9, rtol=0)     # the hand version is transformers'
    torch.testing.assert_close(ours.view(-1, 64).double(), ref, atol=1e-5, rtol=0)


def test_sampler_rows_do_not_leak_filters():
    """A row with top_p=1/top_k off keeps its full support even when batched with a filtered row."""
    logits = torch.tensor([[20.0, 0.0, -1.0, 0.5], [1.0, 2.0, 3.0, 4.0]]).unsqueeze(1)
    st = SamplingTensors.from_params([SamplingParams(), SamplingParams(top_k=2)], 4, "cpu")
    p = sampler.probs(logits, st)[:, 0]
    torch.testing.assert_close(p[0], logits[0, 0].softmax(-1), atol=0, rtol=1e-5)
    assert (p[0] > 0).all()
    torch.testing.assert_close(p[1], torch.tensor([0, 0, 1, np.e]) / (1 + np.e), atol=1e-6, rtol=0)


def test_sampler_sample_inverse_cdf_and_batch_rows():
    p = torch.tensor([[0.0, 0.5, 0.0, 0.5], [0.2, 0.0, 0.8, 0.0]])
    u = torch.tensor([1e-9, 1e-9])
    assert sampler.sample(p, u).tolist() == [1, 0]
    assert sampler.sample(p, torch.tensor([1.0, 1.0])).tolist() == [3, 2]   # never a zero-mass token
    assert sampler.sample(p, torch.tensor([0.5, 0.21])).tolist() == [1, 2]
    u = torch.rand(20000, generator=torch.Generator().manual_seed(0)).clamp_min(1e-12)
    counts = torch.bincount(sampler.sample(p[1:].expand(20000, 4), u), minlength=4).double() / 20000
    torch.testing.assert_close(counts, torch.tensor([0.2, 0, 0.8, 0], dtype=torch.double), atol=0.015, rtol=0)


def test_sampler_sample_never_picks_zero_mass_with_non_monotone_cumsum(monkeypatch):
    """A parallel scan (CUDA) may round a zero-mass position's prefix sum above its predecessor's;
    simulate that on CPU: the zero-mass token must still get an empty interval of the CDF."""
    p = torch.tensor([[0.5, 0.0, 0.5]])
    monkeypatch.setattr(sampler, "SERIAL_SCAN_DEVICES", set())    # as on CUDA
    real = torch.Tensor.cumsum
    monkeypatch.setattr(torch.Tensor, "cumsum", lambda x, dim: real(x, dim) + torch.tensor([0.0, 1e-3, 0.0]))
    assert sampler.sample(p, torch.tensor([0.5005])).tolist() == [2]
    assert sampler.sample(p, torch.tensor([0.4995])).tolist() == [0]


def test_seeded_requests_reproducible_and_logprobs_match_full_forward(models):
    model = models["qwen3"]
    prompts = ragged_prompts(6, seed=9, lo=2, hi=9)
    params = [SamplingParams(temperature=T, top_k=k, top_p=p, seed=5, max_tokens=15)
              for T, k, p in [(1.0, -1, 1.0), (0.7, 10, 0.9), (1.5, -1, 0.8), (0.0, -1, 1.0), (0.5, 3, 1.0),
                              (1.0, -1, 1.0)]]
    a = run_requests(LLM(model, block_size=4, max_model_len=64, seed=1), list(zip(prompts, params)))
    b = run_requests(LLM(model, block_size=4, max_model_len=64, seed=2), list(zip(prompts, params))[::-1])[::-1]
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    assert len({tuple(o.token_ids) for o in a}) == 6
    for o, sp in zip(a, params):
        T = sp.temperature if sp.temperature > 0 else 1.0
        logits = dense_logits(model, o.prompt_token_ids + o.token_ids)[len(o.prompt_token_ids) - 1:-1]
        ref = torch.log_softmax(logits / T, -1).gather(-1, torch.tensor(o.token_ids)[:, None])[:, 0]
        np.testing.assert_allclose(o.logprobs, ref.numpy(), atol=ATOL)
        assert o.from_verify == [False] * len(o.token_ids)
    # unseeded: the engine RNG (LLM seed) decides
    sp = SamplingParams(temperature=1.0, max_tokens=15)
    x = LLM(model, block_size=4, max_model_len=64, seed=1).generate(prompts, sp, use_tqdm=False)
    y = LLM(model, block_size=4, max_model_len=64, seed=1).generate(prompts, sp, use_tqdm=False)
    z = LLM(model, block_size=4, max_model_len=64, seed=2).generate(prompts, sp, use_tqdm=False)
    assert [o.token_ids for o in x] == [o.token_ids for o in y] != [o.token_ids for o in z]


def test_sampled_distribution_of_first_token(models):
    """Engine sampling (prefill path, top-k + top-p) matches the reference distribution: chi-square."""
    from scipy.stats import chisquare
    model, prompt = models["llama"], [5, 9, 2]
    T, k, p = 0.8, 6, 0.9
    probs = _reference_probs(dense_logits(model, prompt)[-1:], T, k, p)[0].numpy()
    llm = LLM(model, block_size=4, max_model_len=16, max_num_seqs=1024)
    outs = llm.generate([prompt], SamplingParams(temperature=T, top_k=k, top_p=p, max_tokens=1, n=4000),
                        use_tqdm=False)
    counts = np.bincount([o.token_ids[0] for o in outs], minlength=64)
    support = probs > 0
    assert counts[~support].sum() == 0
    assert chisquare(counts[support], probs[support] / probs[support].sum() * 4000).pvalue > 1e-3


def test_stop_tokens_and_max_tokens(models):
    model = models["llama"]
    prompts = ragged_prompts(4, seed=2, lo=2, hi=9)
    llm = LLM(model, block_size=4, max_model_len=64)
    ref = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=20), use_tqdm=False)
    for o, p in zip(ref, prompts):
        stop = o.token_ids[5]
        cut = o.token_ids.index(stop) + 1
        got = llm.generate([p], SamplingParams(temperature=0.0, max_tokens=20, stop_token_ids=[stop]),
                           use_tqdm=False)[0]
        assert got.token_ids == o.token_ids[:cut] and got.finish_reason == "stop"
        got = llm.generate([p], SamplingParams(temperature=0.0, max_tokens=20, stop_token_ids=[stop],
                                               ignore_eos=True), use_tqdm=False)[0]
        assert got.token_ids == o.token_ids and got.finish_reason == "length"
        got = llm.generate([p], SamplingParams(temperature=0.0, max_tokens=7), use_tqdm=False)[0]
        assert got.token_ids == o.token_ids[:7] and got.finish_reason == "length"
        got = llm.generate([p], SamplingParams(temperature=0.0, stop_token_ids=[o.token_ids[0]]),
                           use_tqdm=False)[0]                    # the very first (prefill) token stops
        assert got.token_ids == o.token_ids[:1] and got.finish_reason == "stop"
    # the model's eos (config) stops too
    eos = ref[0].token_ids[3]
    model.args.eos_token_id = eos
    try:
        got = LLM(model, block_size=4, max_model_len=64).generate(prompts[:1], SamplingParams(
            temperature=0.0, max_tokens=20), use_tqdm=False)[0]
    finally:
        model.args.eos_token_id = None
    assert got.token_ids == ref[0].token_ids[:ref[0].token_ids.index(eos) + 1] and got.finish_reason == "stop"


def test_stop_inside_an_accepted_run_counts_only_the_drafts_before_it(models):
    """Drafts after a stop token are verified but never emitted: they count neither as proposed nor as
    accepted, so each verify step emits accepted + 1 tokens and the policy sees what was used."""
    model, p = models["llama"], ragged_prompts(1, seed=5, lo=3, hi=6)[0]
    ref = LLM(model, block_size=4).generate([p], SamplingParams(temperature=0.0, max_tokens=12), use_tqdm=False)[0]
    i = next(i for i in range(2, 9) if ref.token_ids[i] not in ref.token_ids[:i])   # a stop first seen at i
    llm = LLM(model, block_size=4, controller=None, speculative={"method": "prior", "num_draft_tokens": 8})
    llm.drafter.add(tuple(p), ref.token_ids)               # the greedy answer itself: every draft is right
    out = llm.generate([p], SamplingParams(temperature=0.0, max_tokens=12, stop_token_ids=[ref.token_ids[i]]),
                       use_tqdm=False)[0]
    assert out.token_ids == ref.token_ids[:i + 1] and out.finish_reason == "stop"
    # the prefill alone (speculative prefill) drafts tokens 0..7, keeps 0..i and stops on token i
    st = llm.stats
    assert (st["verify_steps"], st["proposed_tokens"], st["accepted_tokens"]) == (1, i, i)
    assert st["target_forwards"] == 1
    assert llm.summary()["mean_accepted_len"] == i + 1 == len(out.token_ids)   # every token from that one step
    assert llm.summary()["draft_len_mean"] == i and llm.summary()["spec_on_frac"] == 1.0   # 1 step, it drafted


def test_generate_without_speculation_drafts_and_learns_nothing(models):
    """generate(..., speculate=False), as evaluation asks: plain AR on the same engine, and its outputs
    do not enter the history drafters; the next call speculates again."""
    model, p = models["llama"], ragged_prompts(1, seed=5, lo=3, hi=6)[0]
    llm = LLM(model, block_size=4, controller=None, speculative={"method": "prior", "num_draft_tokens": 8})
    params = SamplingParams(temperature=0.0, max_tokens=12)
    plain = llm.generate([p], params, use_tqdm=False, speculate=False)[0]
    assert llm.stats["proposed_tokens"] == 0 and not llm.drafter._cache and llm.speculate
    llm.generate([p], params, use_tqdm=False)                      # learns its response as the prior
    again = llm.generate([p], params, use_tqdm=False)[0]
    assert again.token_ids == plain.token_ids and llm.stats["accepted_tokens"] > 0


# ---- abort -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("spec", [None, {"method": "ngram", "num_draft_tokens": 3}])
def test_abort_frees_blocks_and_leaves_others_unchanged(models, spec):
    model = models["qwen2"]
    reqs = _mixed_requests(n=6, max_tokens=16)
    ref = run_requests(LLM(model, block_size=4, max_model_len=64), reqs)
    llm = LLM(model, block_size=4, max_model_len=64, num_kv_blocks=24, controller=None, speculative=spec)
    start = llm.num_free_blocks
    seqs = [s for i, (p, sp) in enumerate(reqs) for s in llm.add_request(p, sp, i)]
    waiting_victim = llm.add_request([1, 2, 3, 4, 5], SamplingParams(max_tokens=16), 99)[0]
    llm.abort(waiting_victim)                                 # aborted before it ever ran
    for _ in range(4):
        llm.step()
    victim = seqs[2]
    assert victim.block_table and not victim.is_finished
    before = llm.num_free_blocks
    held = len(set(victim.block_table))
    llm.abort(victim)
    assert victim.is_finished and victim.finish_reason == "abort" and victim.block_table == []
    assert llm.num_free_blocks == before + held
    llm.abort(victim)                                         # twice is harmless
    while llm.scheduler.has_work():
        llm.step()
    assert llm.num_free_blocks == start
    # with drafts, seeded rows consume uniforms per verify window, so compare the greedy rows there
    check = [i for i in range(len(seqs)) if i != 2 and (spec is None or reqs[i][1].temperature == 0)]
    for i in check:
        assert llm.output(seqs[i]).token_ids == ref[i].token_ids, i
    out = llm.output(victim)
    assert out.finish_reason == "abort" and 0 < len(out.token_ids) < 16
    if spec is None:
        assert out.token_ids == ref[2].token_ids[:len(out.token_ids)]
    assert llm.output(waiting_victim).token_ids == []


def test_sleep_frees_the_kv_pool_and_wake_up_restores_it(models):
    """A colocated trainer frees the pool and the CPU linears' prepacked weights for its backward
    (LLM.sleep); outputs do not change. The new pool is uninitialised (poisoned here), and blocks are
    handed out from id 0 again, so the engine zeroes the same few blocks it used before."""
    prompts = ragged_prompts(3, seed=5)
    llm = LLM(models["llama"], block_size=4, max_model_len=64)
    before = llm.generate(prompts, GREEDY, use_tqdm=False)
    zeroed = llm.runner.zeroed
    assert 0 < zeroed < llm.blocks.num_blocks // 4
    packed = lambda: sum("_pack" in m.__dict__ for m in llm.model.modules())
    assert packed() > 0 or not cpu_linear.PACK
    llm.sleep()
    assert llm.runner.cache is None and not llm.blocks.hash_to_block and packed() == 0
    with pytest.raises(RuntimeError, match="asleep"):
        llm.generate(prompts, GREEDY, use_tqdm=False)
    llm.wake_up()
    llm.runner.cache[:, :, :llm.blocks.num_blocks * 4] = float("nan")
    after = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.token_ids for o in after] == [o.token_ids for o in before]
    assert llm.runner.zeroed == zeroed
    llm.add_request(prompts[0], GREEDY)
    with pytest.raises(RuntimeError, match="still running"):
        llm.sleep()


def test_prefix_cache_recomputes_only_the_last_token(models):
    """8 requests with one 96-token prompt (6 full blocks of 16): the first computes 96 tokens, each later
    one only the last (vLLM's rule), 103 in all; outputs equal those without prefix caching."""
    model, prompt = models["llama"], ragged_prompts(1, seed=96, lo=96, hi=96)[0]
    sp = SamplingParams(temperature=1.0, max_tokens=8)      # the engine's generator: same draws in both
    on, off = (LLM(model, block_size=16, max_model_len=128, prefix_caching=c) for c in (True, False))
    outs = [llm.generate([prompt] * 8, sp, use_tqdm=False) for llm in (on, off)]
    assert on.stats["prefill_tokens"] == 96 + 7 and off.stats["prefill_tokens"] == 8 * 96
    assert [o.token_ids for o in outs[0]] == [o.token_ids for o in outs[1]]
    assert [x for o in outs[0] for x in o.logprobs] == pytest.approx([x for o in outs[1] for x in o.logprobs], abs=1e-5)


def test_every_counter_is_reported_before_it_counts(models):
    """A speculative engine that never verified a draft still reports its counters (as 0): the rollout
    worker and the benches sum them over ranks and passes by name."""
    from nanospec.engine.llm import COUNTERS
    llm = LLM(models["llama"], max_model_len=64, speculative={"method": "ngram", "num_draft_tokens": 2})
    s = llm.summary()
    assert all(s[k] == 0 for k in COUNTERS)
