"""History/context drafters (n-gram, suffix tree, prior rollout) and the chain/factory, on bare Sequences."""
import math
import random

import pytest
import torch

from nanospec.drafters.base import Drafter, Proposal
from nanospec.drafters import registry
from nanospec.drafters.chain import ChainDrafter, find_drafter
from nanospec.drafters.ngram import NgramDrafter
from nanospec.drafters.prior import PriorRolloutDrafter
from nanospec.drafters.suffix import SuffixDrafter, _Trie
from nanospec.engine.sequence import SamplingParams, Sequence


def mkseq(prompt, completion=(), key=None, idx=0, logprobs=None):
    s = Sequence(list(prompt), SamplingParams(max_tokens=64), prompt_key=key, sample_index=idx)
    s.token_ids += list(completion)
    s.logprobs += list(logprobs) if logprobs is not None else [-0.5] * len(completion)
    return s


def grow(s, toks):
    s.token_ids += toks
    s.logprobs += [-0.5] * len(toks)


# ---- n-gram ---------------------------------------------------------------------------------------
def ngram_reference(toks, k, n_max, n_min):
    """Brute force: most recent earlier occurrence of the longest matching suffix, periodic past the end."""
    L = len(toks)
    for n in range(min(n_max, L - 1), n_min - 1, -1):
        for j in range(L - 1, n - 1, -1):
            if toks[j - n:j] == toks[L - n:]:
                ext = list(toks)
                for i in range(k):
                    ext.append(ext[j + i])
                return ext[L:]
    return []


def test_ngram_repeated_pattern_longest_and_most_recent():
    d = NgramDrafter(n_max=3)
    s = mkseq([1, 2, 3, 4, 5, 1, 2, 3])
    p = d.propose([s], [4])
    assert p.tokens == [[4, 5, 1, 2]] and p.sources == ["ngram"]
    # (5,1,2) occurred once, followed by 9; the more recent (1,2) was followed by 7: longest n wins
    assert d.propose([mkseq([5, 1, 2, 9, 3, 1, 2, 7, 5, 1, 2])], [2]).tokens == [[9, 3]]
    assert d.propose([mkseq([1, 2, 1, 2])], [5]).tokens == [[1, 2, 1, 2, 1]]   # periodic continuation
    assert d.propose([mkseq([1, 2, 3])], [3]).tokens == [[]]                    # nothing repeats


def test_ngram_incremental_matches_brute_force():
    rng = random.Random(0)
    d = NgramDrafter(n_max=4, n_min=2)
    seqs = [mkseq([rng.randrange(5) for _ in range(rng.randrange(1, 8))]) for _ in range(4)]
    for _ in range(40):
        for s in seqs:
            grow(s, [rng.randrange(5) for _ in range(rng.randrange(1, 4))])
        ks = [rng.randrange(0, 6) for _ in seqs]
        p = d.propose(seqs, ks)
        assert p.tokens == [ngram_reference(s.token_ids, k, 4, 2) if k else [] for s, k in zip(seqs, ks)]
    d.free(seqs[0])
    assert seqs[0].seq_id not in d._state


# ---- suffix tree ----------------------------------------------------------------------------------
def kids(node):
    """A trie node's children: a dict from the second child on, before that only `best`."""
    if node.children is not None:
        return node.children
    return {node.best.tok: node.best} if node.best is not None else {}


def trie_paths(trie):
    """{path: node} for every node; also checks the structural invariants."""
    out, stack = {}, [((), trie.root)]
    while stack:
        path, node = stack.pop()
        assert node.cont == sum(c.count for c in kids(node).values())
        for t, c in kids(node).items():
            assert c.tok == t
            assert 0 < c.count <= (node.count if node is not trie.root else c.count) and c.depth == len(path) + 1
            out[path + (t,)] = c
            stack.append((path + (t,), c))
    for path, node in out.items():
        assert node.link is (out[path[1:]] if len(path) > 1 else trie.root)
        assert node.count <= (out[path[1:]].count if len(path) > 1 else node.count)
    assert trie.size == len(out)
    return out


def test_suffix_sibling_continuation_after_observe():
    d = SuffixDrafter(depth=8, use_global=False)
    prompt = [10, 11, 12]
    running = mkseq(prompt, [1, 2], key="q")
    assert d.propose([running], [3]).tokens == [[]]          # only the prompt is known
    d.observe(mkseq(prompt, [1, 2, 3, 4, 5, 6], key="q", idx=1))
    p = d.propose([running], [3])
    assert p.tokens == [[3, 4, 5]] and p.sources == ["suffix"]
    fresh = mkseq(prompt, [], key="q", idx=2)                # prompt->response boundary is in the tree
    assert d.propose([fresh], [2]).tokens == [[1, 2]]
    grow(running, [3, 4])                                    # incremental advance, same tree version
    assert d.propose([running], [4]).tokens == [[5, 6]]
    assert d.propose([mkseq(prompt, [1, 2], key="other")], [3]).tokens == [[]]   # per-prompt trees


def test_suffix_min_prob_and_match_length_bound():
    prompt = [10, 11, 12]
    for min_prob, want in [(0.6, [3]), (0.4, [3, 7, 8])]:
        d = SuffixDrafter(depth=8, min_prob=min_prob, alpha=1.0, shrink=0.0, use_global=False)
        d.observe(mkseq(prompt, [1, 2, 3, 4, 5], key="q"))
        d.observe(mkseq(prompt, [1, 2, 3, 7, 8], key="q"))
        # after (.., 3): children 4 and 7 each 1/2 (a tie goes to the latest) -> path prob 0.5
        p = d.propose([mkseq(prompt, [1, 2], key="q")], [3])
        assert p.tokens == [want] and p.confidence == [[1.0, 0.5, 1.0][:len(want)]]   # shrink 0: frequencies
    # a diverged sample matches only the 1-token suffix (3): draft <= max(1, alpha * 1) = 1 token
    assert d.propose([mkseq(prompt, [9, 3], key="q")], [4]).tokens == [[7]]
    d2 = SuffixDrafter(depth=8, alpha=2.0, shrink=0.0, use_global=False)
    d2.observe(mkseq(prompt, [1, 2, 3, 4, 5], key="q"))
    assert d2.propose([mkseq(prompt, [9, 3], key="q")], [4]).tokens == [[4, 5]]


def test_suffix_window_eviction():
    d = SuffixDrafter(depth=8, window=2, use_global=False)
    prompt = [10, 11, 12]

    def draft(completion):          # a sample that leaves the engine at once (free: its text goes)
        s = mkseq(prompt, completion, key="q")
        tokens = d.propose([s], [2]).tokens
        d.free(s)
        return tokens

    d.observe(mkseq(prompt, [1, 2, 3, 4], key="q"))
    d.next_step()
    d.observe(mkseq(prompt, [5, 6, 7, 8], key="q"))
    assert draft([1, 2]) == [[3, 4]]                            # 1 step old: kept
    d.next_step()
    assert draft([1, 2]) == [[]]                                # 2 steps old: gone
    assert draft([5, 6]) == [[7, 8]]
    d.next_step()
    d.next_step()
    assert "q" not in d._trees                                  # idle prompt's trie dropped
    tree = d.tree(mkseq(prompt, key="q"))
    assert not tree.texts and set(trie_paths(tree)) == set(trie_paths(_fresh(8, [prompt])))


def _fresh(depth, texts):
    t = _Trie(depth)
    for x in texts:
        t.insert(list(x))
    return t


def test_suffix_memory_bound_and_removal_exact():
    rng = random.Random(1)
    d = SuffixDrafter(depth=5, max_nodes=120, window=1000)
    prompt = [20, 21, 22, 23]
    running = mkseq(prompt, [], key="q")
    for _ in range(30):
        d.observe(mkseq(prompt, [rng.randrange(6) for _ in range(rng.randrange(3, 15))], key="q"))
        tree = d.tree(running)                                # (inserts what observe() held back)
        assert tree.size <= 120
        got = {p: n.count for p, n in trie_paths(tree).items()}
        want = {p: n.count for p, n in trie_paths(_fresh(5, [prompt] + [t for _, t in tree.texts])).items()}
        assert got == want                                   # eviction leaves exactly the kept texts
        # incremental match == brute-force longest suffix of the context present in the trie
        for _ in range(2):                                   # after a change: rescan; then: advance
            node = d._match_node(running, "prompt", tree)
            ctx = running.token_ids
            assert node.depth == max(m for m in range(min(6, len(ctx) + 1)) if m == 0 or tuple(ctx[-m:]) in got)
            grow(running, [rng.randrange(6) for _ in range(rng.randrange(1, 4))])
    assert len(tree.texts) < 30                                # something was evicted
    big = SuffixDrafter(depth=4, max_nodes=20)                 # a prompt larger than the bound
    assert big.tree(mkseq(list(range(50)), key="p")).size <= 20


def test_suffix_global_fallback():
    for use_global, want in [(True, [4, 5, 6]), (False, [])]:
        d = SuffixDrafter(depth=8, use_global=use_global, shrink=0.0)
        d.observe(mkseq([30, 31], [1, 2, 3, 4, 5, 6], key="a"))
        assert d.propose([mkseq([40, 41], [1, 2, 3], key="b")], [3]).tokens == [want]


# ---- prior rollout --------------------------------------------------------------------------------
def test_prior_exact_match_and_mismatch():
    d = PriorRolloutDrafter()
    prompt = [7, 8]
    d.observe(mkseq(prompt, [5, 6, 7, 8], key="q"))
    d.observe(mkseq(prompt, [5, 9, 1, 2], key="q"))
    s = mkseq(prompt, [5, 6], key="q", idx=1)
    p = d.propose([s], [3])
    assert p.tokens == [[7, 8]] and p.sources == ["prior"] and p.lenient_q is None and not d.lossy
    assert d.propose([mkseq(prompt, [5, 9], key="q")], [3]).tokens == [[1, 2]]
    assert d.propose([mkseq(prompt, [5, 3], key="q")], [3]).tokens == [[]]      # mismatch: no draft
    grow(s, [7])
    assert d.propose([s], [3]).tokens == [[8]]
    grow(s, [4])                                              # diverged now
    assert d.propose([s], [3]).tokens == [[]]
    assert d.propose([mkseq(prompt, [5], key="z")], [3]).tokens == [[]]         # unknown prompt


def test_prior_siblings_spread_cache_bound_and_bubble_source():
    d = PriorRolloutDrafter(max_per_prompt=2)
    d.add("q", [1, 2], [-0.1, -0.2])
    d.add("q", [3, 4], [-0.1, -0.2])
    sibs = [mkseq([9], [], key="q", idx=i) for i in range(2)]
    assert d.propose(sibs, [2, 2]).tokens == [[3, 4], [1, 2]]    # tie: newest first, spread by index
    follower = mkseq([9], [1], key="q")
    assert d.propose([follower], [1]).tokens == [[2]]
    d.add("q", [5, 6, 6], None, source="bubble")                  # evicts [1, 2] from the cache ...
    p = d.propose([mkseq([9], [], key="q", idx=0), follower], [3, 1])
    assert p.tokens == [[5, 6, 6], [2]] and p.sources == ["bubble", "prior"]   # ... not from its follower
    assert d.propose([mkseq([9], [1], key="q")], [2]).tokens == [[]]            # new seqs: gone
    d.add("q", [1, 7, 8], source="bubble")                        # added mid-flight: the follower sees it
    grow(follower, [7])
    p = d.propose([follower], [2])
    assert p.tokens == [[8]] and p.sources == ["bubble"]
    with pytest.raises(ValueError, match="logprobs"):
        d.add("q", [1, 2], [0.0])


def test_prior_lenient_q_and_lossy_warning():
    with pytest.warns(UserWarning, match="LOSSY"):
        d = PriorRolloutDrafter(lenience=2.0)
    assert d.lossy
    d.observe(mkseq([9], [1, 2, 3], key="q", logprobs=[-0.1, -0.7, -1.3]))
    d.add("q", [4, 4], None, source="bubble")
    p = d.propose([mkseq([9], [1], key="q"), mkseq([9], [8], key="q"), mkseq([9], [4], key="q")], [3, 3, 3])
    assert p.tokens == [[2, 3], [], [4]]
    assert p.lenient_q.shape == (3, 2)
    torch.testing.assert_close(p.lenient_q, torch.tensor([[math.exp(-0.7) / 2, math.exp(-1.3) / 2],
                                                          [1.0, 1.0], [1.0, 1.0]]))
    with pytest.raises(ValueError, match="lenience"):
        PriorRolloutDrafter(lenience=0.5)


# ---- chain + factory ------------------------------------------------------------------------------
class FakeStochastic(Drafter):
    """Always drafts [1, 2, ...] with a random q, like a model drafter would."""
    name, stochastic, needs_kv = "fake", True, True

    def __init__(self, V=16):
        self.V, self.calls, self.prefilled = V, [], []

    def propose(self, seqs, num_tokens):
        self.calls.append([s.seq_id for s in seqs])
        k_max = max(num_tokens)
        q = torch.softmax(torch.randn(len(seqs), k_max, self.V), -1)
        return Proposal(tokens=[list(range(1, k + 1)) for k in num_tokens], q=q, sources=["fake"] * len(seqs))

    def prefill(self, seqs, tokens, starts):
        self.prefilled.append(len(seqs))


def test_chain_order_and_one_hot_q():
    prior, fake = PriorRolloutDrafter(), FakeStochastic()
    prior.add("q", [5, 6, 7], [-0.1] * 3, source="bubble")
    chain = ChainDrafter([prior, NgramDrafter(), fake])
    assert chain.stochastic and chain.needs_kv and not chain.lossy
    seqs = [mkseq([9], [5], key="q"), mkseq([1, 2, 3, 1, 2], key="x"), mkseq([4], key="y"), mkseq([9], key="q")]
    p = chain.propose(seqs, [3, 3, 3, 0])
    assert p.tokens == [[6, 7], [3, 1, 2], [1, 2, 3], []]
    assert p.sources == ["bubble", "ngram", "fake", ""]
    assert fake.calls == [[seqs[2].seq_id]]                  # later members only see leftovers
    assert p.q.shape == (4, 3, 16)
    assert torch.equal(p.q[0, :2], torch.nn.functional.one_hot(torch.tensor([6, 7]), 16).float())
    assert torch.equal(p.q[1], torch.nn.functional.one_hot(torch.tensor([3, 1, 2]), 16).float())
    assert torch.allclose(p.q[2].sum(-1), torch.ones(3)) and p.q[2, 0, 1] < 1
    assert p.q[3].abs().sum() == 0 and p.lenient_q is None
    chain.prefill(seqs, None, None)
    assert fake.prefilled == [4]


def test_chain_lenient_merge_and_hooks():
    with pytest.warns(UserWarning):
        prior = PriorRolloutDrafter(lenience=4.0)
    suffix = SuffixDrafter(depth=8, shrink=0.0)
    chain = ChainDrafter([prior, suffix])
    assert chain.lossy and not chain.stochastic and not chain.needs_kv
    chain.observe(mkseq([9], [1, 2, 3, 4], key="q", logprobs=[-1.0] * 4))   # both learn it
    suffix.observe(mkseq([9], [7, 1, 2, 3], key="q"))
    s1, s2 = mkseq([9], [1], key="q"), mkseq([9], [7, 1], key="q")
    p = chain.propose([s1, s2], [2, 2])
    assert p.tokens == [[2, 3], [2, 3]] and p.sources == ["prior", "suffix"] and p.q is None
    torch.testing.assert_close(p.lenient_q, torch.tensor([[math.exp(-1) / 4] * 2, [1.0, 1.0]]))
    assert p.confidence == [[math.exp(-1)] * 2, [1.0, 1.0]]     # prior: p_old; suffix: frequencies
    chain.free(s1)
    assert s1.seq_id not in prior._state and s1.seq_id not in suffix._match
    chain.next_step()
    assert suffix.step == 1
    assert find_drafter(chain, "prior") is prior and find_drafter(prior, "suffix") is None


def test_registry_builds_and_validates():
    d = registry.build({"method": "ngram", "num_draft_tokens": 4, "n_max": 3})
    assert isinstance(d, NgramDrafter) and d.n_max == 3
    c = registry.build([{"method": "prior", "num_draft_tokens": 4}, {"method": "suffix", "depth": 16}])
    assert isinstance(c, ChainDrafter) and [m.name for m in c.drafters] == ["prior", "suffix"]
    assert c.drafters[1].depth == 16
    assert registry.build(None) is None
    assert isinstance(registry.build([{"method": "suffix"}]), SuffixDrafter)
    assert registry.canonical("self") == "self_nf4"          # the old name stays accepted
    for spec, msg in [({"method": "medusa"}, "medusa"), ({"method": "ngram", "depth": 3}, "depth"),
                      ({"method": "draft_model", "model": "x"}, "needs the engine's target"),
                      ({"method": "ngram", "num_draft_tokens": 0}, "num_draft_tokens"), ([], "list"),
                      ({"num_draft_tokens": 2}, "method")]:
        with pytest.raises(ValueError, match=msg):
            registry.build(spec)


# ---- budgets --------------------------------------------------------------------------------------
@pytest.mark.parametrize("which", ["ngram", "suffix", "prior", "chain"])
def test_every_draft_respects_budget(which):
    prompt = [1, 2, 3, 4, 5, 6, 7, 8, 1, 2, 3, 4, 5, 6, 7, 8, 1, 2]
    with pytest.warns(UserWarning):
        prior = PriorRolloutDrafter(lenience=2.0)
    d = {"ngram": NgramDrafter(), "suffix": SuffixDrafter(depth=32, shrink=0.0), "prior": prior,
         "chain": ChainDrafter([PriorRolloutDrafter(), SuffixDrafter(), NgramDrafter(), FakeStochastic()])}[which]
    d.observe(mkseq(prompt, list(range(30, 60)), key="q"))
    head = list(range(30, 60)) if which == "ngram" else []   # n-gram only reads its own context
    seqs = [mkseq(prompt, head + [30, 31], key="q", idx=i) for i in range(8)]
    budgets = [0, 1, 2, 3, 5, 8, 13, 0]
    p = d.propose(seqs, budgets)
    assert [len(t) for t in p.tokens] == [min(k, 28) for k in budgets]
    assert all(t == list(range(32, 32 + len(t))) for t in p.tokens)
    assert [bool(s) for s in p.sources] == [k > 0 for k in budgets]
    for extra in (p.q, p.lenient_q):
        if extra is not None:
            assert extra.shape[:2] == (8, max(budgets))
    with pytest.raises(ValueError, match="num_tokens"):
        d.propose(seqs, [1])
    with pytest.raises(ValueError, match="num_tokens"):
        d.propose(seqs[:1], [-1])


def test_constructor_validation():
    for kwargs, field in [({"depth": 1}, "depth"), ({"window": 0}, "window"), ({"min_prob": 1.5}, "min_prob"),
                          ({"alpha": 0}, "alpha"), ({"depth": 8, "max_nodes": 4}, "max_nodes")]:
        with pytest.raises(ValueError, match=field):
            SuffixDrafter(**kwargs)
    with pytest.raises(ValueError, match="n_min"):
        NgramDrafter(n_max=2, n_min=3)
    with pytest.raises(ValueError, match="max_per_prompt"):
        PriorRolloutDrafter(max_per_prompt=0)


def test_a_chain_member_drafts_at_most_its_own_num_draft_tokens():
    """[{prior, 2}, {suffix, 8}]: the engine asks the chain for up to 8, the prior member for 2 (its
    spec's num_draft_tokens), and the controller prices and budgets each source at its own cap."""
    from nanospec.drafters import registry
    from nanospec.engine.controller import DraftController
    from nanospec.engine.latency import LatencyModel
    chain = registry.build([{"method": "prior", "num_draft_tokens": 2}, {"method": "suffix", "num_draft_tokens": 8}])
    resp = list(range(10, 40))
    chain.observe(mkseq([1, 2, 3], resp, key="k"))          # a prior rollout of prompt "k"
    p = chain.propose([mkseq([1, 2, 3], resp[:5], key="k", idx=1)], [8])
    assert p.sources == ["prior"] and p.tokens == [resp[5:7]]
    cheap = LatencyModel([1e-3, 1e-4, 1e-7, 0.0, 0.0, 0.0])    # a verified token costs next to nothing
    rows = [mkseq([1, 2, 3], resp[:5], idx=i) for i in range(4)]
    free = DraftController(cheap, sources=["suffix"]).budgets(rows, 8)
    capped = DraftController(cheap, sources=["suffix"], source_caps={"suffix": 2}).budgets(rows, 8)
    assert max(free) > 2 and capped == [2] * 4, (free, capped)
