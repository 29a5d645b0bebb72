"""The suffix drafter's own-text trie, long drafts and per-sequence state, on bare Sequences."""
import random

import pytest

from nanospec.drafters.suffix import SuffixDrafter, _Trie

from test_drafters_tokens import _fresh, grow, kids, mkseq, trie_paths


def counts(trie):
    return {p: n.count for p, n in trie_paths(trie).items()}


def test_own_prefix_drafts_a_span_repeated_in_the_sequences_own_output():
    prompt = [1, 2, 3]
    own = [50, 51, 52, 53, 54, 9, 50, 51, 52]   # 50 51 52 came before: 53 54 9 followed it
    for own_prefix, want in [(True, [53, 54, 9]), (False, [])]:
        d = SuffixDrafter(depth=8, use_global=False, own_prefix=own_prefix, shrink=0.0)
        p = d.propose([mkseq(prompt, own, key="q")], [3])
        assert p.tokens == [want]
        # the own occurrence of (50 51 52) at the end has no continuation: not counted in the frequency
        assert p.confidence == [[1.0] * len(want)]
    d = SuffixDrafter(depth=8, use_global=False, shrink=0.0)
    s = mkseq(prompt, [7, 8], key="q")       # new tokens are added as they come, span by span
    assert d.propose([s], [2]).tokens == [[]]
    grow(s, [9, 7, 8])
    assert d.propose([s], [2]).tokens == [[9, 7]]


def test_a_draft_reaches_the_budget_past_the_trie_depth():
    resp = list(range(100, 130))
    d = SuffixDrafter(depth=12, use_global=False, shrink=0.0)    # an 11-token match, then on past depth 12
    d.observe(mkseq([1, 2], resp, key="q"))
    running = mkseq([1, 2], resp[:10], key="q", idx=1)
    p = d.propose([running], [8])
    assert p.tokens == [resp[10:18]] and p.confidence == [[1.0] * 8]
    # alpha bounds a draft by the match length: a 2-token match drafts <= 2 (alpha 1) or <= 8 (alpha 4)
    for alpha, n in [(1.0, 2), (4.0, 8)]:
        d = SuffixDrafter(depth=12, alpha=alpha, use_global=False, shrink=0.0)
        d.observe(mkseq([1, 2], resp, key="q"))
        assert d.propose([mkseq([1, 2], [7, 100, 101], key="q")], [8]).tokens == [resp[2:2 + n]]


def test_own_text_in_the_trie_equals_inserting_it_and_free_takes_it_back():
    rng = random.Random(0)
    D, prompt = 5, [20, 21, 22, 23, 24, 25]
    d = SuffixDrafter(depth=D, use_global=False, window=1000)
    history = [rng.choices(range(4), k=rng.randrange(3, 12)) for _ in range(3)]
    for h in history:
        d.observe(mkseq(prompt, h, key="q"))
    tree = d._trees["q"]
    before = counts(tree)
    seqs = [mkseq(prompt, [], key="q", idx=i) for i in range(3)]
    for _ in range(6):                          # three running samples grow in interleaved spans
        for s in seqs:
            grow(s, rng.choices(range(4), k=rng.randrange(1, 4)))
            d.propose([s], [3])
            texts = [prompt] + [prompt[-(D - 1):] + h for h in history] + \
                    [prompt[-(D - 1):] + x.completion_token_ids for x in seqs if x.seq_id in d._live]
            assert counts(tree) == counts(_fresh(D, texts))
    d.observe(seqs[0])                          # finished: its text stays, as history
    d.free(seqs[0])
    d.free(seqs[1])                             # aborted: its text leaves
    d.free(seqs[2])
    assert not d._live and not d._match and tree.live == 0
    assert counts(tree) == counts(_fresh(D, [prompt] + [prompt[-(D - 1):] + h for h in history]
                                         + [prompt[-(D - 1):] + seqs[0].completion_token_ids]))
    assert tree.texts[-1][1] == prompt[-(D - 1):] + seqs[0].completion_token_ids
    d.free(seqs[0])                             # idempotent
    d.next_step()
    assert before != counts(tree)


def test_best_child_cache_follows_inserts_and_removals():
    rng = random.Random(2)
    t = _Trie(4)
    texts = [rng.choices(range(5), k=rng.randrange(2, 20)) for _ in range(40)]
    for i, x in enumerate(texts):
        t.insert(x)
        if i % 3 == 2:
            t.remove(texts[i - 1])
        for node in trie_paths(t).values():
            if kids(node):
                assert node.best.count == max(c.count for c in kids(node).values())
            else:
                assert node.best is None and node.children in (None, {})


def test_node_cap_evicts_history_then_freezes_the_running_text():
    d = SuffixDrafter(depth=4, max_nodes=60, use_global=False, window=1000)
    d.observe(mkseq([1], list(range(100, 112)), key="q"))
    s = mkseq([1], list(range(200, 230)), key="q", idx=1)
    d.propose([s], [4])
    tree = d._trees["q"]
    assert not tree.texts and tree.size <= 60 and d._live[s.seq_id].end is None   # frozen at the cap
    grow(s, [200, 201])                                  # drafts still come, from a fresh match
    assert d.propose([s], [2]).tokens == [[202, 203]]
    d.free(s)
    assert counts(tree) == counts(_fresh(4, [[1]]))


def test_estimates_shrink_few_continuations_of_short_matches():
    """c / (n + shrink / m): one continuation after a 1-token match is a weak hint, after 6 a strong one."""
    d = SuffixDrafter(depth=8, use_global=False, shrink=5.0, min_prob=0.1)
    d.observe(mkseq([10, 11, 12], [1, 2, 3, 4, 5, 6], key="q"))
    p = d.propose([mkseq([10, 11, 12], [9, 3], key="q")], [4])       # match (3): m = 1, n = 1
    assert p.tokens == [[4]] and p.confidence == [[pytest.approx(1 / 6)]]   # then 1/6 * 1/3.5 < 0.1: stop
    p = d.propose([mkseq([10, 11, 12], [1, 2, 3], key="q", idx=1)], [4])   # (10 11 12 1 2 3): m = 6
    assert p.tokens[0][:2] == [4, 5] and p.confidence[0][0] == pytest.approx(1 / (1 + 5 / 6))
    assert SuffixDrafter(shrink=0.0, use_global=False).propose([mkseq([1], [5, 6, 5], key="r")], [1]).confidence \
        == [[1.0]]                                                  # shrink 0: the frequency itself
