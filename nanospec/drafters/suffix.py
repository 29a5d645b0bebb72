"""Suffix-tree drafter: a prompt's recent rollouts and each sample's own text (SuffixDecoding, DAS).

Why: the G samples of one GRPO prompt, and that prompt's responses from the last few steps, share
long spans; a policy that changes slowly keeps producing them. A sample also repeats itself: the
numbers of its prompt, a total it wrote a line earlier. So per `prompt_key` we keep a trie of every
substring (up to `depth` D tokens) of the prompt, of its recent responses and of its running samples'
text so far, with occurrence counts (SuffixDecoding, Oliaro et al. 2024, and Arctic Inference's
SuffixDecodingCache keep prompt + own response in a per-request tree beside a tree of earlier
responses; DAS keeps history per prompt). To draft, we take the longest suffix of the context that
has a continuation and walk down the most frequent child while the path's estimated probability
stays >= min_prob.

* Own text: a running sample's tokens enter its prompt's trie as they are generated (`extend`: the
  new substrings are the suffixes of the text that end at the new token, reached through suffix
  links from the previous end; O(D) per token). The node where the text ends is then the match
  itself. A sample enters with its first generated token; `observe()` turns a finished text into
  history, `free()` without `observe()` (an abort) takes it back out.
* Estimates: a token seen c times among the n occurrences of an m-token context that continue is
  estimated c / (n + shrink / m). The frequency c / n overstates when n is small and the match
  short (one earlier answer that went on with "final" after "we need to find the" is a weak hint),
  so such drafts stop early and long matches earn long drafts; this replaces most of SuffixDecoding's
  cap of max_spec_factor * match_len tokens (kept, loose: `alpha`). Counting only occurrences that
  continue (`cont`, the children's counts) keeps texts that end there (the sample itself, siblings
  in lockstep with it) from diluting the estimate. Each token's estimate goes out with the draft
  (`Proposal.confidence`); the policy calibrates it and verifies only the drafts that pay
  (controller.plan_drafts), so min_prob is just a floor.
* Depth: matches are up to D - 1 tokens; a draft that reaches depth D (no children there: the depth
  limit, not the end of a text) goes on from its suffix of D - 1 tokens, so a draft reaches k tokens
  whatever D. Inserting costs O(D) node visits per token, in Python, on every generated token.
* Each node caches its most frequent child (`best`; on ties the one counted last, the most recent),
  kept on insert and recomputed when a removal lowers it, so a draft token is one attribute read.
* History: `next_step()` (once per GRPO step) evicts responses older than `window` steps and the
  tries of prompts idle that long.
* Lazy history: a finished text that was not already growing in its trie (a sample that never
  drafted) waits in `todo`, and a new trie's prompt in `prompt`, until a draft reads that trie (the
  global trie: until one reads it). Inserting is O(D) node visits per token in Python, the cost of
  speculation on steps that do not draft (issue 49); a response that ages out unread, as most do when
  each prompt comes back only every ~20 GRPO steps, is never inserted. A read sees the counts that
  inserting at once would have left, built in the same order; two things can differ: after a text
  aged out unread, a draft may follow another of two equal-count children (an insert and a removal
  can move `best` on a tie), and under `max_total_nodes` other texts may be dropped.
* Memory: a node costs ~105 bytes (measured, CPython 3.11), so `max_total_nodes` (4M: ~420 MiB)
  caps all tries together, the global one included; `max_nodes` caps one prompt's trie and
  `global_max_nodes` the global trie. What goes when a cap is hit, first to last:
  1. a trie's responses older than `window` steps (at `next_step`);
  2. over `max_nodes` (or `global_max_nodes`): that trie's oldest responses;
  3. over `max_total_nodes`: whole prompt tries, least recently used first (used: a sample of the
     prompt drafted or finished), but never the one in use nor one that a running sample writes its
     text into (that text would go on growing, uncounted, in a dropped trie);
  4. still over it: the oldest responses of the trie in use;
  5. then a running text stops growing, and its drafts match the context afresh, through suffix
     links, Aho-Corasick style.
* A response is stored as prompt[-(D-1):] + response so paths that cross from the prompt into the
  answer (the start of a response) exist: a fresh sample's first draft is its siblings' opening.
* `use_global` adds one shallow trie (`global_depth`) over all prompts' finished responses (Arctic's
  global tree), for the steps where the prompt's trie drafts fewer than k tokens; the draft with
  the higher expected accepted length (the sum of its path probabilities, SuffixDecoding's score)
  wins. Shallow on purpose: other prompts' answers share short phrases, not long spans.
"""
from __future__ import annotations

from collections import deque
from operator import attrgetter

from nanospec.engine.sequence import Sequence
from nanospec.drafters.base import Drafter, Proposal, check_budget

_count = attrgetter("count")


class _Node:
    """Most nodes of a suffix trie have one child (a span seen once continues one way): that child is
    `best` and `children` stays None, a dict only from the second child on (half the allocations,
    so less memory and fewer garbage-collector passes)."""
    __slots__ = ("children", "count", "cont", "link", "depth", "tok", "best")

    def __init__(self, depth: int, link: "_Node | None", tok: int = -1):
        self.children: dict[int, _Node] | None = None   # all children, once there are two
        self.count, self.link, self.depth, self.tok = 0, link, depth, tok
        self.cont = 0                      # occurrences followed by a token: the children's counts
        self.best: _Node | None = None     # the child with the highest count, latest on ties

    def child(self, t: int) -> "_Node | None":
        b = self.best
        if b is not None and b.tok == t:
            return b
        return self.children.get(t) if self.children is not None else None

    def add(self, t: int, child: "_Node") -> None:
        """A new child t (its count is still 0: `best` is updated by the caller's count)."""
        if self.children is not None:
            self.children[t] = child
        elif self.best is not None:
            self.children = {self.best.tok: self.best, t: child}


class _Trie:
    """Counts of all substrings (length <= depth) of the inserted texts. Invariant: count(s + t) <=
    count(s) and count(s) <= count(s[1:]), so deleting zero-count nodes keeps links valid.
    The root's `best` is not kept exact on removals (no draft starts from an empty match)."""

    def __init__(self, depth: int):
        self.depth, self.root, self.size, self.version = depth, _Node(0, None), 0, 0
        self.root.children = {}
        self.texts: deque[tuple[int, list[int]]] = deque()   # (step observed, text), oldest first
        self.tail: list[int] = []                            # prompt[-(D-1):] (per-prompt tries)
        self.last_used = 0
        self.live = 0                                        # running texts being extended in it
        self.prompt: list[int] | None = None                 # a new trie's prompt, not inserted yet
        self.todo: deque[tuple[int, list[int]]] = deque()    # observed texts not inserted yet: newer than texts

    def __setstate__(self, state: dict) -> None:    # pickled before the lazy history: nothing held back
        self.__dict__.update(dict(prompt=None, todo=deque()), **state)

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
                node = self._count(node, t, prev[d - 1] if d else self.root)
                path.append(node)
            prev = path

    def _count(self, node: _Node, t: int, link: _Node) -> _Node:
        """One more occurrence of (node's string) + t: its child, made with suffix link `link` if new."""
        best = node.best
        child = best if best is not None and best.tok == t else node.child(t)
        if child is None:
            child = _Node(node.depth + 1, link, t)
            node.add(t, child)
            self.size += 1
        child.count += 1
        node.cont += 1
        if best is None or child.count >= best.count:
            node.best = child
        return child

    def extend(self, end: _Node, t: int) -> _Node:
        """Append t to an inserted text whose last min(len, D) tokens lead to `end`: counts the
        substrings that end at t (one per suffix of the text, the chain of `end`'s suffix links),
        shortest first so that each new node's link exists. -> the new end."""
        chain, node = [], end if end.depth < self.depth else end.link
        while node is not None:
            chain.append(node)
            node = node.link
        new = self.root                   # the link of a depth-1 node
        for node in reversed(chain):
            new = self._count(node, t, new)
        return new

    def remove(self, text: list[int]) -> None:
        """Undo insert(text), or the extends that built text."""
        self.version += 1
        root = self.root
        for i in range(len(text)):
            node, seg = root, text[i:i + self.depth]
            for d, t in enumerate(seg):
                child = node.child(t)
                child.count -= 1
                node.cont -= 1
                if child.count == 0:   # subtree = rest of this path (other children had count 0: gone)
                    if node.children is not None:
                        del node.children[t]
                    self.size -= len(seg) - d
                if node.best is child and (child.count == 0 or node.children is not None):
                    kids = node.children
                    node.best = max(reversed(kids.values()), key=_count) if kids and node is not root else None
                if child.count == 0:
                    break
                node = child

    def step(self, node: _Node, t: int) -> _Node:
        """Longest suffix in the trie of (string of node) + t; nodes at depth D have no children."""
        while True:
            child = node.child(t)
            if child is not None:
                return child
            if node is self.root:
                return node
            node = node.link

    def continuation(self, node: _Node) -> tuple[int, float, _Node] | None:
        """The most frequent next token after the longest suffix of node's string that has one: (token,
        its frequency among that suffix's continuations, the node of the match extended by it =
        step(node, token))."""
        while node is not self.root:
            child = node.best
            if child is not None:
                return child.tok, child.count / node.cont, child
            node = node.link
        return None

    def draft(self, node: _Node, k: int, alpha: float, min_prob: float, shrink: float = 0.0
              ) -> tuple[list[int], list[float], float]:
        """-> (draft tokens, each one's estimated probability given the path before it, their
        expected accepted length: the sum of the path probabilities, SuffixDecoding's score).
        The walk, the estimate c / (n + shrink / m) and the depth rule: the module docstring."""
        D = self.depth
        while node is not self.root:       # no continuation here: retry with a shorter match
            cur = node.best
            if cur is not None:
                out, conf, parent, prob, score = [], [], node, 1.0, 0.0
                cap = min(k, max(1, int(node.depth * alpha)))
                while True:
                    p = cur.count / (parent.cont + shrink / parent.depth)
                    prob *= p
                    if prob < min_prob:
                        break
                    out.append(cur.tok)
                    conf.append(p)
                    score += prob
                    if len(out) >= cap:
                        break
                    parent = cur if cur.depth < D else cur.link
                    cur = parent.best
                    if cur is None:
                        break
                if out:
                    return out, conf, score
            node = node.link
        return [], [], 0.0


class _Live:
    """A running sequence's text in its prompt's trie: tail + the response tokens inserted so far."""
    __slots__ = ("trie", "text", "end", "n")

    def __init__(self, trie: _Trie, n: int):
        self.trie, self.text, self.n = trie, [], n
        self.end: _Node | None = trie.root    # node of the text's last min(len, D) tokens; None: frozen


class SuffixDrafter(Drafter):
    name = "suffix"
    confident = True      # a draft token's confidence: its estimated probability after the path before it
    # class defaults for a drafter unpickled from before the total cap (suffix_mlp's is pickled whole)
    max_total_nodes, _nodes, _held = 4_000_000, 0, 0

    def __init__(self, depth: int = 12, window: int = 2, min_prob: float = 0.1, alpha: float = 4.0,
                 max_nodes: int = 100_000, use_global: bool = True, global_max_nodes: int = 500_000,
                 global_depth: int = 4, own_prefix: bool = True, shrink: float = 5.0,
                 max_total_nodes: int = 4_000_000):
        least = max_nodes + (global_max_nodes if use_global else 0)
        for field, value, ok, want in [
                ("depth", depth, depth >= 2, ">= 2"), ("window", window, window >= 1, ">= 1 (GRPO steps)"),
                ("min_prob", min_prob, 0 <= min_prob <= 1, "in [0, 1]"), ("alpha", alpha, alpha > 0, "> 0"),
                ("shrink", shrink, shrink >= 0, ">= 0"),
                ("max_nodes", max_nodes, max_nodes >= depth, f">= depth ({depth})"),
                ("global_depth", global_depth, global_depth >= 2, ">= 2"),
                ("global_max_nodes", global_max_nodes, global_max_nodes >= global_depth,
                 f">= global_depth ({global_depth})"),
                ("max_total_nodes", max_total_nodes, max_total_nodes >= least,
                 f">= max_nodes + global_max_nodes ({least})")]:
            if not ok:
                raise ValueError(f"SuffixDrafter: {field} must be {want}, got {value}")
        self.depth, self.window, self.min_prob, self.alpha = depth, window, min_prob, alpha
        self.max_nodes, self.global_max_nodes, self.own_prefix = max_nodes, global_max_nodes, own_prefix
        self.shrink, self.max_total_nodes = shrink, max_total_nodes
        self.step = 0
        self._nodes = 0                                        # in all tries: the global one too
        self._held = 0                                         # tokens held back (todo, prompt): at most
        self._trees: dict = {}                                 # prompt_key -> _Trie, least recently used first
        self._global = _Trie(global_depth) if use_global else None
        self._live: dict[int, _Live] = {}                      # seq_id -> its text in its prompt's trie
        self._match: dict[int, dict[str, tuple]] = {}          # seq_id -> slot -> (trie, version, len, node)

    def tree(self, seq: Sequence) -> _Trie:
        """`_touch`, then what observe() left in todo inserted: the trie is ready to read."""
        tree = self._touch(seq)
        self._flush(tree)
        return tree

    def _touch(self, seq: Sequence) -> _Trie:
        """The trie of seq's prompt (new: empty, its prompt still to insert), now the most recently used."""
        tree = self._trees.pop(seq.prompt_key, None)    # re-inserted last: _trees stays in LRU order
        if tree is None:
            tree = _Trie(self.depth)
            tree.prompt, tree.tail = seq.prompt_token_ids, seq.prompt_token_ids[-(self.depth - 1):]
            self._hold(len(tree.prompt))
        self._trees[seq.prompt_key] = tree
        tree.last_used = self.step
        return tree

    def _flush(self, trie: _Trie) -> None:
        """Insert what a prompt trie holds back (the docstring's lazy history), in the order it came."""
        if trie.prompt is not None:
            prompt, trie.prompt = trie.prompt, None
            self._shrink(min(self.max_nodes, len(prompt) * self.depth), trie)   # room for its substrings
            size = trie.size
            trie.insert(prompt, min(self.max_nodes, self.max_total_nodes - self._nodes))
            self._nodes += trie.size - size
        while trie.todo:
            self._add(trie, *trie.todo.popleft(), self.max_nodes)
            self._room(trie, 0)

    def _read_global(self, tree: _Trie | None) -> _Trie:
        """The global trie, ready to read, for a draft in `tree` (which the total cap keeps)."""
        while self._global.todo:
            self._add(self._global, *self._global.todo.popleft(), self.global_max_nodes)
            if tree is not None:
                self._room(tree, 0)
            else:
                self._shrink(0)
        return self._global

    def _hold(self, n: int) -> None:
        """n more tokens held back. Past max_total_nodes / depth of them (a flood no draft reads, and no
        next_step to age it out) they are all inserted, so that the caps bound memory as they did."""
        self._held += n
        if self._held * self.depth <= self.max_total_nodes:
            return
        tries = list(self._trees.values()) + ([self._global] if self._global is not None else [])
        self._held = sum(len(t) for trie in tries for _, t in trie.todo) + \
            sum(len(trie.prompt) for trie in tries if trie.prompt is not None)   # the exact count
        if self._held * self.depth > self.max_total_nodes:
            for key, trie in list(self._trees.items()):
                if self._trees.get(key) is trie:       # (a flush may drop other tries: the total cap)
                    self._flush(trie)
            if self._global is not None:
                self._read_global(None)
            self._held = 0

    def _shrink(self, need: int, keep: _Trie | None = None) -> None:
        """Room for `need` more nodes under max_total_nodes: drop whole prompt tries, least recently
        used first, but not `keep` nor a trie that running texts grow in (their nodes would escape
        the count)."""
        over = self._nodes + need - self.max_total_nodes
        if over <= 0:
            return
        drop = []
        for key, t in self._trees.items():      # least recently used first
            if over <= 0:
                break
            if t is not keep and not t.live:
                drop.append(key)
                over -= t.size
        for key in drop:
            self._nodes -= self._trees.pop(key).size

    def _room(self, trie: _Trie, need: int) -> bool:
        """Make room for `need` more nodes in a prompt's trie (eviction steps 2-4 of the docstring)."""
        while trie.texts and trie.size + need > self.max_nodes:
            self._pop(trie)
        self._shrink(need, trie)
        while trie.texts and self._nodes + need > self.max_total_nodes:
            self._pop(trie)
        return trie.size + need <= self.max_nodes and self._nodes + need <= self.max_total_nodes

    def _pop(self, trie: _Trie) -> None:
        """Remove trie's oldest response."""
        size = trie.size
        trie.remove(trie.texts.popleft()[1])
        self._nodes += trie.size - size

    def _evict(self, trie: _Trie, max_nodes: int) -> None:
        while trie.texts and (self.step - trie.texts[0][0] >= self.window or trie.size > max_nodes):
            self._pop(trie)
        while trie.todo and not trie.texts and self.step - trie.todo[0][0] >= self.window:
            trie.todo.popleft()             # aged out unread: never inserted

    def _add(self, trie: _Trie, step: int, text: list[int], max_nodes: int) -> None:
        trie.texts.append((step, text))
        size = trie.size
        trie.insert(text)
        self._nodes += trie.size - size
        self._evict(trie, max_nodes)

    def _grow(self, st: _Live, tokens: list[int], capped: bool = True) -> None:
        """Extend a running text by `tokens`; at a cap, older history makes room, and with none left
        the text stops growing (frozen: drafts then match the context afresh)."""
        trie, text = st.trie, st.text
        for t in tokens:
            if capped and not self._room(trie, trie.depth):
                st.end = None
                return
            size = trie.size
            st.end = trie.extend(st.end, t)
            text.append(t)
            self._nodes += trie.size - size

    def context(self, seq: Sequence) -> tuple[_Trie, _Node]:
        """(seq's prompt trie, the node of the longest suffix of seq's tokens in it), after adding
        seq's new tokens to its own text there (the end of that text is the node)."""
        tree, toks = self.tree(seq), seq.token_ids
        if not self.own_prefix or len(toks) == seq.num_prompt_tokens:
            return tree, self._match_node(seq, "prompt", tree)
        st = self._live.get(seq.seq_id)
        if st is None:
            st = self._live[seq.seq_id] = _Live(tree, seq.num_prompt_tokens)
            tree.live += 1
            self._grow(st, tree.tail)
        if st.end is not None and st.n < len(toks):
            self._grow(st, toks[st.n:])
            st.n = len(toks)
        if st.end is None:
            return tree, self._match_node(seq, "prompt", tree)
        return tree, st.end

    def observe(self, seq: Sequence) -> None:
        tree, resp = self._touch(seq), seq.completion_token_ids
        st = self._live.pop(seq.seq_id, None)
        if st is not None:              # already in the trie: catch up, then it is history
            self._flush(tree)           # (after the texts observed before it)
            if st.end is not None:
                self._grow(st, seq.token_ids[st.n:], capped=False)
            tree.live -= 1
            tree.texts.append((self.step, st.text))
            self._evict(tree, self.max_nodes)
            self._room(tree, 0)
        elif resp:                      # inserted when a draft next reads this trie, if one does
            tree.todo.append((self.step, tree.tail + resp))
            self._hold(len(tree.tail) + len(resp))
        if self._global is not None and resp:
            self._global.todo.append((self.step, resp))
            self._hold(len(resp))

    def next_step(self) -> None:
        """One GRPO step passed: evict responses older than `window` steps and idle prompts' tries."""
        self.step += 1
        for key, tree in list(self._trees.items()):
            self._evict(tree, self.max_nodes)
            if not tree.texts and not tree.todo and not tree.live and self.step - tree.last_used >= self.window:
                del self._trees[key]
        if self._global is not None:
            self._evict(self._global, self.global_max_nodes)
        # recount (a checkpoint from before max_total_nodes has no count), then fit the total cap
        self._nodes = sum(t.size for t in self._trees.values()) + (self._global.size if self._global else 0)
        self._shrink(0)

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
        tree, node = self.context(seq)
        out, conf, score = tree.draft(node, k, self.alpha, self.min_prob, self.shrink)
        if self._global is not None and len(out) < k:
            glob = self._read_global(tree)
            g_out, g_conf, g_score = glob.draft(self._match_node(seq, "global", glob), k, self.alpha,
                                                self.min_prob, self.shrink)
            if g_score > score:
                return g_out, g_conf
        return out, conf

    def free(self, seq: Sequence) -> None:
        st = self._live.pop(seq.seq_id, None)
        if st is not None:             # left without observe (aborted): its text leaves the trie
            self._flush(st.trie)       # (after the texts observed before its removal, as eagerly)
            size = st.trie.size
            st.trie.remove(st.text)
            st.trie.live -= 1
            self._nodes += st.trie.size - size
        self._match.pop(seq.seq_id, None)
