"""Bounded history-drafter memory: over 25,000 observed responses (the caps bind within the first few
thousand) the suffix drafter's node count and the prior store's size stay under their caps, RSS stays
flat, and fresh history still drafts."""
import gc
import os
import random

import pytest

from nanospec.drafters.prior import PriorRolloutDrafter
from nanospec.drafters.suffix import SuffixDrafter

from test_drafters_tokens import grow, mkseq

N, VOCAB, HOT, ONCE = 25_000, 50_000, 20, 0.1


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def stream(seed=0):
    """(prompt_key, prompt, response) x N, 50-200 tokens each: a fraction ONCE for one-off prompts
    (random text, each a new trie), the rest for HOT recurring prompts whose samples vary one answer
    (GRPO siblings)."""
    rng = random.Random(seed)
    pool = [rng.randrange(VOCAB) for _ in range(1 << 18)]
    hot = [(pool[o:o + 30], pool[o + 30:o + 230]) for o in (rng.randrange(len(pool) - 230) for _ in range(HOT))]
    for i in range(N):
        L = rng.randint(50, 200)
        if rng.random() < ONCE:
            o = rng.randrange(len(pool) - 230)
            yield ("once", i), pool[o:o + 30], pool[o + 30:o + 30 + L]
        else:
            j = rng.randrange(HOT)
            resp = hot[j][1][:L]
            for _ in range(L // 40):
                resp[rng.randrange(L)] = rng.randrange(VOCAB)
            yield ("hot", j), hot[j][0], resp


@pytest.fixture
def frozen_gc():
    """The collector's full passes walk every object the session holds (torch's, pytest's): a quarter
    of this test's time. Frozen, they are left out (tries are cyclic: the collector still frees them)."""
    gc.freeze()
    yield
    gc.unfreeze()


def suffix_nodes(d):
    return sum(t.size for t in d._trees.values()) + d._global.size


@pytest.mark.slow
def test_suffix_drafter_memory_stays_under_its_cap(frozen_gc):
    cap = 40_000
    d = SuffixDrafter(depth=2, global_depth=2, max_nodes=5_000, global_max_nodes=10_000, max_total_nodes=cap,
                      shrink=0.0)   # shrink 0: a once-seen span drafts in full (the check at the end)
    base, peak = rss(), 0
    for i, (key, prompt, resp) in enumerate(stream()):
        s = mkseq(prompt, key=key, idx=i)
        if i % 50 == 0:                  # a running sample: its text grows in the trie as it decodes
            for n in range(0, len(resp), 8):
                d.propose([s], [4])
                s.token_ids += resp[n:n + 8]
                s.logprobs += [-0.5] * len(resp[n:n + 8])
        else:
            s.token_ids += resp
        if i % 100 != 50:                # every 100th: aborted, its text leaves the trie
            d.observe(s)
        d.free(s)
        assert d._nodes <= cap
        if i % 1000 == 0:
            assert d._nodes == suffix_nodes(d) and d._global.size <= d.global_max_nodes
            assert all(t.size <= d.max_nodes for t in d._trees.values())
            peak = max(peak, rss() - base)
        if i % 5_000 == 4_999:           # a few GRPO steps: the window alone would let 5k responses pile up
            d.next_step()
    assert not d._live and not d._match and not any(t.live for t in d._trees.values())
    # ~105 B a node (suffix.py); 4x that for allocator slack, plus 32 MiB for everything else
    assert peak < cap * 420 + 32 * 2**20, peak
    # a response observed just now drafts for its sibling, once-seen prompt or recurring one
    for key in [("once", -1), ("hot", 0)]:
        resp = [VOCAB + t for t in range(60)]
        d.observe(mkseq([1, 2, 3], resp, key=key))
        sib = mkseq([1, 2, 3], resp[:20], key=key, idx=1)
        assert d.propose([sib], [4]).tokens == [resp[20:24]]
        d.free(sib)


def test_prior_store_stays_under_its_cap():
    d = PriorRolloutDrafter(max_per_prompt=4, max_prompts=64)
    base, peak = rss(), 0
    for i, (key, prompt, resp) in enumerate(stream(seed=1)):
        s = mkseq(prompt, resp, key=key, idx=i)
        if i % 10 == 0:
            running = mkseq(prompt, resp[:10], key=key, idx=i)
            d.propose([running], [4])
            d.free(running)
        d.observe(s)
        assert len(d._cache) <= 64 and all(len(e) <= 4 for e in d._cache.values())
        if i % 1000 == 0:
            peak = max(peak, rss() - base)
    assert not d._state
    # 64 * 4 responses of <= 200 tokens at ~85 B a token (prior.py), 4x slack, plus 16 MiB
    assert peak < 64 * 4 * 200 * 85 * 4 + 16 * 2**20, peak
    resp = [VOCAB + t for t in range(60)]
    d.observe(mkseq([1, 2, 3], resp, key="last"))
    assert d.propose([mkseq([1, 2, 3], resp[:20], key="last")], [4]).tokens == [resp[20:24]]


def test_suffix_total_cap_drops_least_recently_used_idle_tries():
    d = SuffixDrafter(depth=4, use_global=False, max_nodes=400, max_total_nodes=1000)

    def observe_and_read(key, resp):                   # a sibling's draft inserts what observe() held back
        d.observe(mkseq([1, 2], resp, key=key))
        d.tree(mkseq([1, 2], key=key))

    for key in "abc":
        observe_and_read(key, [ord(key) * 1000 + t for t in range(80)])
    running = mkseq([1, 2], [5, 6], key="a", idx=1)
    d.propose([running], [2])                          # a is in use: the least recently used is b
    observe_and_read("d", list(range(80)))
    assert "b" not in d._trees and {"a", "d"} <= set(d._trees)
    assert d._nodes == sum(t.size for t in d._trees.values()) <= 1000
    for key in "efgh":                                 # a text grows in a: never dropped while it does
        observe_and_read(key, [ord(key) * 1000 + t for t in range(80)])
        assert d._trees["a"].live == 1 and d._nodes <= 1000
    d.free(running)
    assert d._nodes == sum(t.size for t in d._trees.values())


def test_suffix_history_nobody_reads_is_not_inserted_and_stays_bounded():
    """A finished text waits until a draft reads its trie: one that ages out unread costs no insertion
    (the idle cost of speculation, issue 49). A flood with no reads and no next_step is inserted once
    it passes max_total_nodes / depth tokens, so the caps still bound memory."""
    d = SuffixDrafter(depth=4, max_nodes=400, global_max_nodes=400, max_total_nodes=1000, window=1)
    d.observe(mkseq([1, 2], list(range(3, 40)), key="a"))
    assert d._nodes == 0 and d._trees["a"].todo and d._global.todo
    d.next_step()                                      # aged out unread: gone, never inserted
    assert "a" not in d._trees and not d._global.todo and d._nodes == 0
    for i in range(100):                               # 100 x 80 tokens, nobody reads
        d.observe(mkseq([1, 2], [1000 * i + t for t in range(80)], key=i))
        held = sum(len(t) for tr in [*d._trees.values(), d._global] for _, t in tr.todo)
        assert d._nodes <= 1000 and held * d.depth <= 2 * 1000
    assert d._nodes == sum(t.size for t in d._trees.values()) + d._global.size


def test_suffix_running_texts_stop_growing_at_the_total_cap():
    d = SuffixDrafter(depth=4, use_global=False, max_nodes=800, max_total_nodes=1000)
    runs = [mkseq([1, 2], [j * 1000], key=j) for j in range(2)]
    for n in range(1, 300, 10):
        for j, s in enumerate(runs):
            grow(s, [j * 1000 + t for t in range(n, n + 10)])
        d.propose(runs, [2, 2])
        assert d._nodes == sum(t.size for t in d._trees.values()) <= 1000
    assert all(st.end is None for st in d._live.values()) and len(d._trees) == 2   # frozen, not dropped
    assert d.propose(runs, [2, 2]).tokens == [[], []]     # frozen: a fresh match of the context (none repeats)


def test_prior_cap_drops_least_recently_used_prompt():
    d = PriorRolloutDrafter(max_prompts=2)
    d.add("a", [1, 2, 3])
    d.add("b", [4, 5, 6])
    d.propose([mkseq([0], [1], key="a")], [2])         # drafting from a uses it: b goes first
    d.add("c", [7, 8, 9])
    assert list(d._cache) == ["a", "c"]


@pytest.mark.parametrize("make, field", [
    (lambda: SuffixDrafter(max_nodes=100, global_max_nodes=100, max_total_nodes=199), "max_total_nodes"),
    (lambda: PriorRolloutDrafter(max_prompts=0), "max_prompts")])
def test_cap_validation(make, field):
    with pytest.raises(ValueError, match=field):
        make()
