"""Suffix-tree drafter over recent rollouts of the same prompt (DAS, distribution-aware spec. decoding).

Why: the G samples of one GRPO prompt, and that prompt's responses from the last few steps, share
long spans; a policy that changes slowly keeps producing them. So per `prompt_key` we keep a trie of
every substring (up to `depth` D tokens) of the prompt and of its recent responses, with occurrence
counts. To draft, we find the longest suffix of the context present in the trie and walk down the
most frequent child while the path's empirical probability prod(count(child) / count(parent)) stays
>= min_prob; a longer match earns a longer draft (<= max(1, alpha * match_len)).

* Depth: inserting a response costs O(len * D) node visits in Python, paid on every finished
  sample whether or not its drafts are used; D = 12 (a 4-8 token match + an 8-token draft) drafted
  as well as 24 on the embedded task (0.571 vs 0.582 target forwards/token) at ~half the upkeep.
* Incremental: `observe(seq)` inserts a finished response at once, so running siblings of the same
  prompt draft from it in the same step; `next_step()` (once per GRPO step) evicts responses older
  than `window` steps; `max_nodes` caps each trie (oldest responses go first; ~150 B per node).
* Suffix links (node for s -> node for s[1:]) make matching incremental, Aho-Corasick style: each new
  context token costs O(1) amortised; a trie change only forces an O(D) rescan of the context tail.
* Confidence: each draft token's count / its parent's count, the empirical p of that continuation,
  goes out with the draft (`Proposal.confidence`); the policy calibrates it and verifies only the
  drafts that pay (policies.trim_drafts), so min_prob is just a floor.
* A response is stored as prompt[-(D-1):] + response so paths that cross from the prompt into the
  answer (the start of a response) exist; `use_global` adds one trie over all prompts' responses,
  used when the prompt's own trie matches less.
"""
from __future__ import annotations

from collections import deque

from ..sequence import Sequence
from .base import Drafter, Proposal, check_budget


class _Node:
    __slots__ = ("children", "count", "link", "depth")

    def __init__(self, depth: int, link: "_Node | None"):
        self.children: dict[int, _Node] = {}
        self.count, self.link, self.depth = 0, link, depth


class _Trie:
    """Counts of all substrings (length <= depth) of the inserted texts. Invariant: count(s + t) <=
    count(s) and count(s) <= count(s[1:]), so deleting zero-count nodes keeps links valid."""

    def __init__(self, depth: int):
        self.depth, self.root, self.size, self.version = depth, _Node(0, None), 0, 0
        self.texts: deque[tuple[int, list[int]]] = deque()   # (step observed, text), oldest first
        self.tail: list[int] = []                            # prompt[-(D-1):] (per-prompt tries)
        self.last_used = 0

    def insert(self, text: list[int], max_size: int | None = None) -> None:
        """Suffixes last-first, so the node for s[1:] (s's suffix link) exists when s is created.
        With max_size, stop before exceeding it (keeps the text's end, the part nearest the answer)."""
        self.version += 1
        D, prev = self.depth, []          # prev[d-1]: node of depth d on the previous (later) suffix
        for i in range(len(text) - 1, -1, -1):
            if max_size is not None and self.size + D > max_size:
                return
            node, path = self.root, []
            for d, t in enumerate(text[i:i + D]):
                child = node.children.get(t)
                if child is None:
                    child = node.children[t] = _Node(d + 1, prev[d - 1] if d else self.root)
                    self.size += 1
                child.count += 1
                path.append(child)
                node = child
            prev = path

    def remove(self, text: list[int]) -> None:
        self.version += 1
        for i in range(len(text)):
            node, seg = self.root, text[i:i + self.depth]
            for d, t in enumerate(seg):
                child = node.children[t]
                child.count -= 1
                if child.count == 0:   # subtree = rest of this path (other children had count 0: gone)
                    del node.children[t]
                    self.size -= len(seg) - d
                    break
                node = child

    def step(self, node: _Node, t: int) -> _Node:
        """Longest suffix in the trie of (string of node) + t; nodes at depth D have no children."""
        while t not in node.children and node is not self.root:
            node = node.link
        return node.children.get(t, node)

    def continuation(self, node: _Node) -> tuple[int, float, _Node] | None:
        """The most frequent next token after the longest suffix of node's string that has one: (token,
        its count / that suffix's count, the node of the match extended by it = step(node, token))."""
        while node is not self.root:
            if node.children:
                t, child = max(node.children.items(), key=lambda kv: kv[1].count)
                return t, child.count / node.count, child
            node = node.link
        return None

    def draft(self, node: _Node, k: int, alpha: float, min_prob: float) -> tuple[list[int], list[float]]:
        """-> (draft tokens, each one's frequency among the continuations of the path before it)."""
        while node.depth > max(self.depth - k, self.depth // 2):   # leave room below for k tokens
            node = node.link
        while node is not self.root:       # no continuation here: retry with a shorter match
            out, conf, prob, cur = [], [], 1.0, node
            cap = min(k, max(1, int(node.depth * alpha)))
            while len(out) < cap and cur.children:
                t, child = max(cur.children.items(), key=lambda kv: kv[1].count)
                prob *= child.count / cur.count
                if prob < min_prob:
                    break
                out.append(t)
                conf.append(child.count / cur.count)
                cur = child
            if out:
                return out, conf
            node = node.link
        return [], []


class SuffixDrafter(Drafter):
    name = "suffix"
    confident = True      # a draft token's confidence: its count / its parent's (the empirical p)

    def __init__(self, depth: int = 12, window: int = 2, min_prob: float = 0.1, alpha: float = 1.0,
                 max_nodes: int = 100_000, use_global: bool = False, global_max_nodes: int = 500_000):
        for field, value, ok, want in [
                ("depth", depth, depth >= 2, ">= 2"), ("window", window, window >= 1, ">= 1 (GRPO steps)"),
                ("min_prob", min_prob, 0 <= min_prob <= 1, "in [0, 1]"), ("alpha", alpha, alpha > 0, "> 0"),
                ("max_nodes", max_nodes, max_nodes >= depth, f">= depth ({depth})"),
                ("global_max_nodes", global_max_nodes, global_max_nodes >= depth, f">= depth ({depth})")]:
            if not ok:
                raise ValueError(f"SuffixDrafter: {field} must be {want}, got {value}")
        self.depth, self.window, self.min_prob, self.alpha = depth, window, min_prob, alpha
        self.max_nodes, self.global_max_nodes = max_nodes, global_max_nodes
        self.step = 0
        self._trees: dict = {}                                 # prompt_key -> _Trie
        self._global = _Trie(depth) if use_global else None
        self._match: dict[int, dict[str, tuple]] = {}          # seq_id -> slot -> (trie, version, len, node)

    def tree(self, seq: Sequence) -> _Trie:
        """The trie of seq's prompt (made from the prompt on first use)."""
        tree = self._trees.get(seq.prompt_key)
        if tree is None:
            tree = self._trees[seq.prompt_key] = _Trie(self.depth)
            prompt = seq.prompt_token_ids
            tree.insert(prompt, self.max_nodes)
            tree.tail = prompt[-(self.depth - 1):]
        tree.last_used = self.step
        return tree

    def _evict(self, trie: _Trie, max_nodes: int) -> None:
        while trie.texts and (self.step - trie.texts[0][0] >= self.window or trie.size > max_nodes):
            trie.remove(trie.texts.popleft()[1])

    def _add(self, trie: _Trie, text: list[int], max_nodes: int) -> None:
        trie.texts.append((self.step, text))
        trie.insert(text)
        self._evict(trie, max_nodes)

    def observe(self, seq: Sequence) -> None:
        tree, resp = self.tree(seq), seq.completion_token_ids
        if resp:
            self._add(tree, tree.tail + resp, self.max_nodes)
            if self._global is not None:
                self._add(self._global, resp, self.global_max_nodes)

    def next_step(self) -> None:
        """One GRPO step passed: evict responses older than `window` steps and idle prompts' tries."""
        self.step += 1
        for key, tree in list(self._trees.items()):
            self._evict(tree, self.max_nodes)
            if not tree.texts and self.step - tree.last_used >= self.window:
                del self._trees[key]
        if self._global is not None:
            self._evict(self._global, self.global_max_nodes)

    def match(self, seq: Sequence, trie: _Trie) -> _Node:
        """The node of the longest suffix of seq's tokens in its prompt's trie (walk on with trie.step)."""
        return self._match_node(seq, "prompt", trie)

    def _match_node(self, seq: Sequence, slot: str, trie: _Trie) -> _Node:
        toks, L = seq.token_ids, len(seq.token_ids)
        st = self._match.setdefault(seq.seq_id, {}).get(slot)
        if st is not None and st[0] is trie and st[1] == trie.version and 0 <= L - st[2] <= trie.depth:
            node, new = st[3], toks[st[2]:]          # same trie: advance over the new tokens only
        else:
            node, new = trie.root, toks[-trie.depth:]  # trie changed: rescan the last D tokens
        for t in new:
            node = trie.step(node, t)
        self._match[seq.seq_id][slot] = (trie, trie.version, L, node)
        return node

    def propose(self, seqs: list[Sequence], num_tokens: list[int]) -> Proposal:
        check_budget(seqs, num_tokens)
        drafts = [self._draft(s, k) if k > 0 else ([], []) for s, k in zip(seqs, num_tokens)]
        return Proposal(tokens=[t for t, _ in drafts], sources=[self.name if t else "" for t, _ in drafts],
                        confidence=[c for _, c in drafts])

    def _draft(self, seq: Sequence, k: int) -> tuple[list[int], list[float]]:
        tree = self.tree(seq)
        node = self._match_node(seq, "prompt", tree)
        draft = tree.draft(node, k, self.alpha, self.min_prob)
        if self._global is not None:
            g = self._match_node(seq, "global", self._global)
            if not draft[0] or g.depth > node.depth:
                other = self._global.draft(g, k, self.alpha, self.min_prob)
                draft = other if other[0] else draft
        return draft

    def free(self, seq: Sequence) -> None:
        self._match.pop(seq.seq_id, None)
