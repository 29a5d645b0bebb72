"""GraphRunner: bucket padding and static-buffer bookkeeping on CPU (emulate=True), real graphs on CUDA."""
import pytest
import torch

from nanospec.drafters.head import HeadDrafter
from nanospec.engine.cuda_graphs import GraphRunner, batch_buckets, kv_block_bytes, kv_blocks_for_memory
from nanospec.engine.llm import LLM
from nanospec.models.decoder import CausalLM, ModelArgs
from nanospec.engine.runner import Runner
from nanospec.engine.sequence import SamplingParams, Sequence

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
BS = 4


def tiny(seed=0, vocab=48, device="cpu", dtype=torch.float32):
    """Untied head, x2 on the layer matrices: a random model whose greedy output depends on the context
    (with tied N(0,1) embeddings it just repeats its last token) and that copies repeated patterns."""
    torch.manual_seed(seed)
    args = ModelArgs(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                     num_kv_heads=2, head_dim=16, max_position_embeddings=128, tie_word_embeddings=False)
    model = CausalLM(args)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.mul_(2.0) if p.dim() == 2 and "embed" not in name else None
    return model.to(device=device, dtype=dtype).eval()


def seqs_with_blocks(lengths, extra):
    """Sequences of random prompts with distinct block tables covering len + extra tokens."""
    g = torch.Generator().manual_seed(1)
    seqs, nxt = [], 0
    for n in lengths:
        s = Sequence(torch.randint(0, 48, (n,), generator=g).tolist(), SamplingParams())
        nb = -(-(n + extra) // BS)
        s.block_table, nxt = list(range(nxt, nxt + nb)), nxt + nb
        seqs.append(s)
    return seqs, nxt


def repetitive_prompts(n, vocab=48, seed=3):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (5 + i % 3,), generator=g).tolist() * 4 for i in range(n)]


# ---- CPU (emulate) ------------------------------------------------------------------------------
def test_buckets_and_padding_rows():
    assert batch_buckets(1) == [1] and batch_buckets(8) == [1, 2, 4, 8]
    assert batch_buckets(48) == [1, 2, 4, 8, 16, 32, 48]
    with pytest.raises(ValueError, match="max_num_seqs"):
        batch_buckets(0)
    r = GraphRunner(tiny(), 16, BS, 8, 30, emulate=True)
    assert r.nb == 8                                           # ceil(30 / 4) blocks: C = 32 keys
    assert [r.bucket_for(b) for b in (1, 2, 3, 5, 8, 9)] == [1, 2, 4, 8, 8, None]
    seqs, _ = seqs_with_blocks([3, 6, 2], 2)
    tokens = [[1, 2], [3], [4, 5]]
    h = r.forward(seqs, tokens, [len(s) for s in seqs])
    assert h.shape == (3, 2, 64) and r.num_replays == 1 and r.num_captures == 4   # Q=2, buckets 8..1
    inp = r.bufs[2][0]
    null = r.null_block
    assert inp[3].tolist() == r.pad_row(2)                     # bucket 4: row 3 is padding
    assert r.pad_row(2) == [0, 0, 0, 0, null * BS, null * BS] + [null] * 8
    # seq 1: one real token at position 6 (slot block[1]*4+2), one padded query -> null slot
    assert inp[1].tolist()[:6] == [3, 0, 6, 0, seqs[1].block_table[1] * BS + 2, null * BS]
    assert inp[1, 6:].tolist() == seqs[1].block_table + [null] * (8 - len(seqs[1].block_table))


@pytest.mark.parametrize("Q", [1, 3, 6])
@pytest.mark.parametrize("lengths", [[5, 11, 2], [7, 3, 9, 1, 4]])
def test_emulated_replay_equals_eager(Q, lengths):
    model = tiny()
    seqs, nblocks = seqs_with_blocks(lengths, Q)
    eager = Runner(model, nblocks, BS)       # max_model_len: the longest row reaches the last key slot
    graph = GraphRunner(model, nblocks, BS, 8, max(lengths) + Q, max_q=6, emulate=True)
    prompts = [s.token_ids for s in seqs]
    for r in (eager, graph):                    # prefill: Q = 11 > max_q -> eager in both
        r.forward(seqs, prompts, [0] * len(seqs))
    assert graph.num_eager == 1 and graph.num_replays == 0
    g = torch.Generator().manual_seed(2)
    tokens = [torch.randint(0, 48, (max(1, Q - i % 3),), generator=g).tolist() for i in range(len(seqs))]
    starts = [len(s) for s in seqs]
    he, hg = eager.forward(seqs, tokens, starts), graph.forward(seqs, tokens, starts)
    assert graph.num_replays == 1 and hg.shape[0] == len(seqs)
    for b, t in enumerate(tokens):
        torch.testing.assert_close(hg[b, :len(t)], he[b, :len(t)], rtol=1e-5, atol=1e-5)
    real = slice(0, nblocks * BS)                               # KV written to the same real slots
    torch.testing.assert_close(graph.cache[:, :, real], eager.cache[:, :, real], rtol=1e-5, atol=1e-5)


def emulated_llm(model, **kw):
    """The engine with emulated graphs, as LLM(use_cuda_graphs=True) builds it on CUDA: a draft head too."""
    llm = cpu_llm(model, **kw)
    llm.runner = GraphRunner(llm.model, llm.blocks.num_blocks, BS, 8, llm.max_model_len, emulate=True)
    if isinstance(llm.drafter, HeadDrafter):
        llm.drafter.runner = GraphRunner(llm.drafter.model, llm.blocks.num_blocks, BS, 8, llm.max_model_len,
                                         emulate=True, features=True)
    return llm


def cpu_llm(model, **kw):
    return LLM(model, dtype="float32", device="cpu", max_num_seqs=8, block_size=BS, max_model_len=96, **kw)


def greedy(llm, prompts, n=24):
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True), use_tqdm=False)
    return [o.token_ids for o in outs]


def test_llm_emulated_graphs_match_ar_and_speculative():
    model, prompts = tiny(seed=5), repetitive_prompts(5)
    ar = greedy(cpu_llm(model), prompts)
    g_ar = emulated_llm(model)
    assert greedy(g_ar, prompts) == ar
    assert g_ar.runner.num_replays > 0 and set(q for _, q in g_ar.runner.graphs) == {1}
    g_spec = emulated_llm(model, controller=None, speculative={"method": "ngram", "num_draft_tokens": 4})
    assert greedy(g_spec, prompts) == ar
    assert g_spec.stats["accepted_tokens"] > 0                  # verify windows Q > 1 went through graphs
    assert max(q for _, q in g_spec.runner.graphs) > 1 and g_spec.runner.num_replays > 0


def drafts_of(llm, prompts):
    """Greedy tokens and every draft the head proposed. Most rows draft one call in three: the hidden states
    a decode step handed over must outlive the next decode, a replay into the same output buffer; row 2
    drafts every call, so a catch-up mixes rows 1 and 3 positions behind (ragged, padded in a graph)."""
    drafts, calls, propose = [], [0], llm.drafter.propose

    def recorded(seqs, num_tokens):
        calls[0] += 1
        p = propose(seqs, [k if calls[0] * (i + 1) % 3 == 0 else 0 for i, k in enumerate(num_tokens)])
        drafts.append(p.tokens)
        return p
    llm.drafter.propose = recorded
    return greedy(llm, prompts), drafts


def test_head_through_emulated_graphs_drafts_as_eager():
    model, prompts = tiny(seed=5), repetitive_prompts(5)
    spec = dict(controller=None, speculative={"method": "head", "num_draft_tokens": 3})
    with pytest.warns(UserWarning, match="freshly initialised"):
        eager, graphs = cpu_llm(model, **spec), emulated_llm(model, **spec)
    tokens, drafts = drafts_of(eager, prompts)
    assert drafts_of(graphs, prompts) == (tokens, drafts) and tokens == greedy(cpu_llm(model), prompts)
    assert graphs.runner.num_replays > 0 and sum(len(d) for ds in drafts for d in ds) >= 60
    head = graphs.drafter.runner     # the head's one-token drafting steps and its catch-ups replayed too
    assert head.num_replays > 0 and {q for _, q in head.graphs} > {1} and head.num_eager > 0   # prompts: eager


def test_llm_with_graphs_captures_the_heads_forwards_too(monkeypatch):
    """LLM(use_cuda_graphs=True)'s wiring, with emulated graphs: the target's runner and the head's
    (features) capture every width 1 .. 1 + k at start-up, and greedy tokens are AR's."""
    class Emulated(GraphRunner):
        def __init__(self, *args, **kw):
            super().__init__(*args, emulate=True, **kw)
    monkeypatch.setattr("nanospec.engine.cuda_graphs.GraphRunner", Emulated)
    model, prompts = tiny(seed=5), repetitive_prompts(5)
    with pytest.warns(UserWarning, match="freshly initialised"):
        llm = cpu_llm(model, use_cuda_graphs=True, controller=None,
                      speculative={"method": "head", "num_draft_tokens": 3})
    target, head = llm.runner, llm.drafter.runner
    assert isinstance(head, Emulated) and head.features and not target.features
    assert sorted(head.bufs) == sorted(target.bufs) == [1, 2, 3, 4]
    assert greedy(llm, prompts) == greedy(cpu_llm(model), prompts) and head.num_replays > 0


def test_sleep_drops_graphs_captured_against_the_freed_cache():
    llm, prompts = emulated_llm(tiny(seed=5)), repetitive_prompts(3)
    before = greedy(llm, prompts)
    captured = set(llm.runner.graphs)
    assert captured
    llm.sleep()
    assert llm.runner.cache is None and not llm.runner.graphs
    llm.wake_up()                       # recaptured on the new cache now, not inside the next steps
    assert set(llm.runner.graphs) == captured
    n = llm.runner.num_captures
    assert greedy(llm, prompts) == before and llm.runner.num_captures == n


def test_load_weights_in_place_keeps_graphs():
    # prefix_caching off: LLM.load_weights keeps prefix-cache hits whose KV came from the old weights
    llm, prompts = emulated_llm(tiny(seed=6), prefix_caching=False), repetitive_prompts(3)
    greedy(llm, prompts)
    r = llm.runner
    ptrs = {n: p.data_ptr() for n, p in llm.model.state_dict().items()}
    bufs = {q: (i.data_ptr(), o.data_ptr()) for q, (i, o) in r.bufs.items()}
    graphs, captures, cache = dict(r.graphs), r.num_captures, r.cache.data_ptr()
    new = tiny(seed=7).state_dict()
    llm.load_weights(new)
    after = greedy(llm, prompts)
    assert r.num_captures == captures == len(r.graphs) and all(r.graphs[k] is v for k, v in graphs.items())
    assert {n: p.data_ptr() for n, p in llm.model.state_dict().items()} == ptrs
    assert {q: (i.data_ptr(), o.data_ptr()) for q, (i, o) in r.bufs.items()} == bufs and r.cache.data_ptr() == cache
    # the graphs see the new weights
    assert after == greedy(cpu_llm(tiny(seed=7)), prompts) != greedy(cpu_llm(tiny(seed=6)), prompts)


def test_clear_error_without_cuda():
    with pytest.raises(RuntimeError, match="use_cuda_graphs=True needs CUDA"):
        GraphRunner(tiny(), 16, BS, 8, 32)
    with pytest.raises(RuntimeError, match="use_cuda_graphs=True needs CUDA"):
        LLM(tiny(), device="cpu", use_cuda_graphs=True, num_kv_blocks=16, block_size=BS)
    with pytest.raises(RuntimeError, match="needs a model on CUDA"):
        kv_blocks_for_memory(tiny(), BS, 0.5)
    with pytest.raises(ValueError, match="max_q"):
        GraphRunner(tiny(), 16, BS, 8, 32, max_q=0, emulate=True)
    assert kv_block_bytes(tiny(), BS) == 2 * 2 * BS * 2 * 16 * 4


# ---- CUDA ---------------------------------------------------------------------------------------
def cuda_llm(model, dtype, graphs, **kw):
    return LLM(model, dtype=dtype, device="cuda", max_num_seqs=8, block_size=16, max_model_len=128,
               num_kv_blocks=64, use_cuda_graphs=graphs, **kw)


@cuda
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cuda_graph_replay_equals_eager(dtype):
    model, prompts = tiny(seed=8, device="cuda"), repetitive_prompts(5)
    eager = greedy(cuda_llm(model, dtype, False), prompts, 32)
    llm = cuda_llm(model, dtype, True)
    assert isinstance(llm.runner, GraphRunner) and not llm.runner.emulate
    assert greedy(llm, prompts, 32) == eager
    r = llm.runner
    assert r.num_replays > 0 and r.num_captures == 4 and set(r.graphs) == {(8, 1), (4, 1), (2, 1), (1, 1)}
    g1 = r.graphs[1, 1]
    # again: prefix-cache hits leave a few prompt tokens to prefill, so new Q (<= max_q) may be captured
    assert greedy(llm, prompts[:1], 32) == eager[:1]
    assert r.graphs[1, 1] is g1 and r.num_captures == len(r.graphs)         # nothing captured twice


@cuda
def test_cuda_spec_with_graphs_equals_ar_and_no_recapture_after_load_weights():
    model, prompts = tiny(seed=9, device="cuda"), repetitive_prompts(6)
    ar = greedy(cuda_llm(model, "float32", False), prompts, 32)
    llm = cuda_llm(model, "float32", True, controller=None, speculative={"method": "ngram", "num_draft_tokens": 4},
                   prefix_caching=False)     # see test_load_weights_in_place_keeps_graphs
    r = llm.runner                              # decode + every verify width (k <= 4), all buckets,
    assert r.num_captures == 4 * 5              # captured by LLM before any step
    assert greedy(llm, prompts, 32) == ar and llm.stats["accepted_tokens"] > 0
    captures, ptrs = r.num_captures, [p.data_ptr() for p in llm.model.parameters()]
    llm.load_weights(tiny(seed=10).state_dict())
    after = greedy(llm, prompts, 32)
    assert r.num_captures == captures == 20 and [p.data_ptr() for p in llm.model.parameters()] == ptrs
    assert after == greedy(cuda_llm(tiny(seed=10, device="cuda"), "float32", False), prompts, 32)


@cuda
def test_cuda_head_through_graphs_drafts_as_eager():
    model, prompts = tiny(seed=5, device="cuda"), repetitive_prompts(5)
    spec = dict(controller=None, speculative={"method": "head", "num_draft_tokens": 3})
    with pytest.warns(UserWarning, match="freshly initialised"):
        eager, graphs = cuda_llm(model, "float32", False, **spec), cuda_llm(model, "float32", True, **spec)
    tokens, drafts = drafts_of(eager, prompts)
    assert drafts_of(graphs, prompts) == (tokens, drafts) and graphs.runner.num_replays > 0
    assert isinstance(graphs.drafter.runner, GraphRunner) and graphs.drafter.runner.num_replays > 0


@cuda
def test_kv_blocks_for_memory_formula():
    model = tiny(device="cuda", dtype=torch.bfloat16)
    free, total = torch.cuda.mem_get_info()
    util = min(1.0, (total - free) / total + 0.01)              # ~1% of the card beyond what is in use
    n = kv_blocks_for_memory(model, 16, util)
    assert abs(n - (util * total - (total - free)) / kv_block_bytes(model, 16)) <= 2 + 0.001 * n
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        kv_blocks_for_memory(model, 16, 1.5)
