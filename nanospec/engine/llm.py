"""`LLM`: the vLLM-shaped front door. Requests in, one engine step at a time, outputs out.

    llm = LLM("path/to/hf_dir", speculative={"method": "suffix", "num_draft_tokens": 5})
    outs = llm.generate(prompts, SamplingParams(temperature=1.0, max_tokens=128, n=8))

One engine step = one target forward over the scheduled batch:
    prefill : each sequence feeds its uncomputed prompt tokens; fresh ones also feed drafts of their
              opening and verify them (speculative prefill), then sample
    decode  : each sequence feeds [last token] + its drafts (k_i >= 0, from the drafter), then
              verify.verify keeps the accepted prefix and samples one more token
Rejected drafts are rolled back by shortening: num_computed = len - 1 and surplus blocks are freed.
"""
from __future__ import annotations

import contextlib
import copy
import functools
import gc
import itertools
import os
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm

from nanospec.engine.block_manager import BlockManager
from nanospec.drafters import registry
from nanospec.drafters.base import Drafter, DraftTarget, Proposal
from nanospec.drafters.chain import members
from nanospec.models.hub import resolve_model
from nanospec.models.loader import chat_prompt_ids, load_model, resolve_dtype
from nanospec.models.decoder import CausalLM
from nanospec.engine.cpu_linear import PackedLinear, drop_packed_weights
from nanospec.engine.runner import Runner
from nanospec.engine.sampler import SamplingTensors
from nanospec.engine.scheduler import Scheduler
from nanospec.engine.sequence import SamplingParams, Sequence
from nanospec.engine.verify import verify

DEFAULT_CPU_KV_GIB = 2.0    # CPU KV pool when neither num_kv_blocks nor kv_cache_gib is given


def load_target(model, tokenizer, dtype, device) -> tuple[CausalLM, object]:
    """A model path (an HF dir, a .gguf file converted once, a hub id) or a CausalLM -> the model in
    `dtype` on `device` (never converting the caller's module in place), and its tokenizer."""
    if isinstance(model, (str, bytes)) or hasattr(model, "__fspath__"):
        model = resolve_model(model)
        if tokenizer is None and any((Path(model) / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json")):
            from transformers import AutoTokenizer
            tokenizer = AutoTokenizer.from_pretrained(str(model))
        model = load_model(model, dtype=dtype, device=device)
    if dtype and model.model.embed_tokens.weight.dtype != resolve_dtype(dtype):
        model = copy.deepcopy(model).to(resolve_dtype(dtype))
    return model.eval(), tokenizer


def kv_pool_blocks(model: CausalLM, block_size: int, most_useful: int, gpu_memory_utilization: float,
                   kv_cache_gib: float | None, drafter_cache: bool = False) -> int:
    """KV blocks from memory (GPU: a utilization share; CPU: a byte budget, as vLLM's
    VLLM_CPU_KVCACHE_SPACE), never from max_num_seqs x max_model_len alone: for a real model with an
    8k context that product is tens of GiB. More than that product (`most_useful`) is never useful.
    drafter_cache: a model drafter keeps a second cache over the same block ids, so half as many."""
    if model.model.embed_tokens.weight.is_cuda:
        from nanospec.engine.cuda_graphs import kv_blocks_for_memory
        blocks = kv_blocks_for_memory(model, block_size, gpu_memory_utilization)
    else:
        blocks = kv_blocks_for_budget(model, block_size, kv_cache_gib)
    return max(1, min(blocks // (2 if drafter_cache else 1), most_useful))


def kv_blocks_for_budget(model: CausalLM, block_size: int, gib: float | None = None) -> int:
    """How many KV blocks fit in `gib` GiB of host memory (None: `DEFAULT_CPU_KV_GIB`, at most a quarter
    of the memory available now, so that two ranks and their trainers still fit beside it)."""
    from nanospec.engine.cuda_graphs import kv_block_bytes
    if gib is None:
        available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        budget = min(DEFAULT_CPU_KV_GIB * 2**30, available / 4)
    elif isinstance(gib, (int, float)) and gib > 0:
        budget = gib * 2**30
    else:
        raise ValueError(f"kv_cache_gib must be a number > 0 or None, got {gib!r}")
    return int(budget // kv_block_bytes(model, block_size))


@dataclass
class RequestOutput:
    request_id: int
    sample_index: int
    prompt_token_ids: list[int]
    token_ids: list[int]
    logprobs: list[float]       # log_softmax(logits / T)[token], target model, full vocab (sampler.py)
    from_verify: list[bool]     # token emitted by a verify step that had drafts
    text: str | None
    finish_reason: str


@contextlib.contextmanager
def frozen_heap(collect: bool = True):
    """Keep the garbage collector off every object alive when a run starts (gc.freeze; vLLM freezes
    its heap once warmed up), until it ends. Why: a full collection walks every tracked object (the
    model's modules, the tokenizer, torch: hundreds of thousands), and the suffix trie's new nodes set
    one off every few rollouts, as a pause of a fifth of a second inside whichever engine step
    allocated last. Frozen, it walks only what the run made since (docs/notebook.md). Unfrozen at the
    end, so a process that makes many runs (the tests) frees the old ones' reference cycles as before.
    Inside a frozen run (`generate` in the trainer's) it does nothing. collect=False (each `generate`
    call) skips the full pass before freezing: it costs one of the pauses it avoids."""
    if gc.get_freeze_count():
        yield
        return
    if collect:
        gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


class LLM:
    def __init__(self, model: str | CausalLM, tokenizer=None, *, dtype="float32", device="cpu",
                 max_num_seqs: int = 64, block_size: int = 16, num_kv_blocks: int | None = None,
                 max_model_len: int | None = None, max_num_batched_tokens: int | None = None,
                 speculative: dict | list | None = None, prefix_caching: bool = True, seed: int = 0,
                 controller="auto", use_cuda_graphs: bool = False, gpu_memory_utilization: float = 0.5,
                 kv_cache_gib: float | None = None):
        """`controller` decides how much to draft each step (controller.py): "auto" (the default with a
        drafter) profiles this model on this machine and turns drafting off where it would not pay, with
        the draft length chosen from measured acceptance; a `SpeculationConfig` builds one from that config
        (the trainer's); a `DraftController` is used as given; None drafts `num_draft_tokens` on every
        step (fixed-k experiments)."""
        if str(device).startswith("cuda") and not torch.cuda.is_available():
            raise RuntimeError(f"device={device!r} requested but torch.cuda.is_available() is False")
        self.model_path = None if isinstance(model, CausalLM) else str(model)
        self.model, self.tokenizer = load_target(model, tokenizer, dtype, device)
        self._asleep = []     # level-2 sleep: (storage, bytes) of the weights it freed
        a = self.model.args
        self.vocab_size = a.vocab_size
        self.max_model_len = min(max_model_len or a.max_position_embeddings, a.max_position_embeddings)
        if block_size < 1 or block_size & (block_size - 1):
            raise ValueError(f"block_size must be a power of 2, got {block_size}")
        speculative = speculative or None    # [] / {}: plain decoding, as None
        registry.check(speculative)          # a bad spec fails here, before any memory is allocated
        specs = [] if speculative is None else speculative if isinstance(speculative, list) else [speculative]
        if num_kv_blocks is None:
            second = any(registry.METHODS[registry.canonical(s["method"])].own_kv for s in specs)
            num_kv_blocks = kv_pool_blocks(self.model, block_size, max_num_seqs * -(-self.max_model_len // block_size),
                                           gpu_memory_utilization, kv_cache_gib, second)
        self.blocks = BlockManager(num_kv_blocks, block_size, prefix_caching)
        self.scheduler = Scheduler(self.blocks, max_num_seqs, max_num_batched_tokens or
                                   max(self.max_model_len, 4096))
        # the most drafts a sequence gets per step (the controller chooses below it)
        self.num_draft_tokens = max((s.get("num_draft_tokens", registry.DEFAULT_DRAFT_TOKENS) for s in specs), default=0)
        graph_runner = None
        if use_cuda_graphs:   # GPU: decode/verify steps replay captured graphs (cuda_graphs.py), all of
            from nanospec.engine.cuda_graphs import captured_runner   # them: Q = 1 + drafts, captured now
            graph_runner = functools.partial(captured_runner, num_blocks=num_kv_blocks, block_size=block_size,
                                             max_num_seqs=max_num_seqs, max_model_len=self.max_model_len,
                                             max_q=1 + self.num_draft_tokens)
        self.runner = graph_runner(self.model) if graph_runner else Runner(self.model, num_kv_blocks, block_size)
        self.device = self.runner.device
        eos = a.eos_token_id if self.tokenizer is None else self.tokenizer.eos_token_id
        self.eos_ids = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
        self.generator = torch.Generator().manual_seed(seed)
        self._st_key = self._st = None   # SamplingTensors of the last step's batch, reused while it repeats
        target = DraftTarget(self.model, self.vocab_size, num_kv_blocks, block_size, self.device, self.tokenizer,
                             self.model_path or getattr(self.tokenizer, "name_or_path", None) or "the target",
                             graph_runner)
        self.drafter: Drafter | None = registry.build(speculative, target)
        self.controller = self._build_controller(controller)
        # a drafter with its own KV prefills every prompt, unless it could never pay on this machine;
        # decided once, so a cached prompt block holds drafter KV for all sequences sharing it or none
        # (a drafter without it catches up from position 0 if it ever drafts)
        self.prefills_draft_kv = self.drafter is not None and self.drafter.needs_kv and (
            self.controller is None or self.controller.keeps_draft_kv(min(64, self.max_model_len // 2),
                                                                      self.num_draft_tokens))
        self.speculate = True      # False inside generate(..., speculate=False): no drafting, no learning
        # a LOSSY drafter (lenience) warned when it was built; summary()["lossy"] labels every stat
        self.reset_stats()

    def _build_controller(self, controller):
        from nanospec.config import SpeculationConfig
        from nanospec.engine.controller import DraftController, build_controller
        if controller is None or isinstance(controller, DraftController):
            return controller
        if controller == "auto":
            controller = SpeculationConfig()     # the trainer's rule and threshold; no length classes
        if not isinstance(controller, SpeculationConfig):
            raise ValueError(f"controller: expected 'auto', None, a SpeculationConfig or a DraftController, "
                             f"got {controller!r}")
        return build_controller(controller, self) if self.drafter is not None else None

    # ---- requests -------------------------------------------------------------------------------
    def _tokenize(self, prompt, i: int) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError(f"request {i}: prompt is a string but the LLM has no tokenizer")
            ids = self.tokenizer.encode(prompt, add_special_tokens=False)
        else:
            ids = list(prompt)
        if not ids:
            raise ValueError(f"request {i}: prompt is empty")
        if any(not isinstance(t, int) or not 0 <= t < self.vocab_size for t in ids):
            raise ValueError(f"request {i}: prompt token ids must be ints in [0, {self.vocab_size})")
        if len(ids) >= self.max_model_len:
            raise ValueError(f"request {i}: prompt has {len(ids)} tokens, max_model_len is {self.max_model_len}")
        return ids

    def _check_fits(self, ids: list[int], params: SamplingParams, i: int) -> None:
        """A request that could never fit the KV pool alone is refused up front, not mid-generation."""
        need = min(len(ids) + params.max_tokens, self.max_model_len)
        have = self.blocks.num_blocks * self.blocks.block_size
        if need > have:
            raise ValueError(f"request {i}: prompt ({len(ids)} tokens) + max_tokens ({params.max_tokens}) needs "
                             f"{need} KV slots, the pool holds {have}: raise kv_cache_gib / num_kv_blocks or "
                             f"lower max_tokens")

    def add_request(self, prompt, params: SamplingParams, request_id: int = 0, prompt_key=None) -> list[Sequence]:
        if self.runner.cache is None:
            raise RuntimeError("the engine is asleep (LLM.sleep freed its KV pool): call wake_up() first")
        params.validate(f"request {request_id}: SamplingParams")
        ids = self._tokenize(prompt, request_id)
        self._check_fits(ids, params, request_id)
        seqs = []
        for j in range(params.n):
            gen = None if params.seed is None else torch.Generator().manual_seed(params.seed * 1_000_003 + j)
            seq = Sequence(ids, params, request_id=request_id, sample_index=j, prompt_key=prompt_key,
                           generator=gen)
            self.scheduler.add(seq)
            seqs.append(seq)
        return seqs

    def abort(self, seq: Sequence) -> None:
        """Drop a request mid-flight: frees its KV blocks and its drafter state."""
        if not seq.is_finished:
            self.scheduler.finish(seq, "abort")
            if self.drafter:
                self.drafter.free(seq)

    def generate(self, prompts, sampling_params: SamplingParams | None = None, use_tqdm: bool = True,
                 prompt_keys=None, speculate: bool = True) -> list[RequestOutput]:
        """Outputs are flat and group-major: prompt 0's n samples, then prompt 1's, ...
        speculate=False: plain AR for this call (evaluation), and history drafters do not learn from it."""
        params = sampling_params or SamplingParams()
        if isinstance(prompts, (str,)) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params.validate("SamplingParams")
        ids = [self._tokenize(p, i) for i, p in enumerate(prompts)]   # every request valid before any is queued
        for i, p in enumerate(ids):
            self._check_fits(p, params, i)
        seqs = []
        for i, p in enumerate(ids):
            seqs += self.add_request(p, params, i, None if prompt_keys is None else prompt_keys[i])
        bar = tqdm(total=len(seqs), disable=not use_tqdm, desc="generate", leave=False)
        self.speculate, speculate = speculate, self.speculate
        try:
            with frozen_heap(collect=False):
                while self.scheduler.has_work():
                    bar.update(len(self.step()))
        finally:
            self.speculate = speculate
            bar.close()
        return [self.output(s) for s in seqs]

    def chat(self, conversations, sampling_params: SamplingParams | None = None, use_tqdm: bool = True,
             **template_kwargs) -> list[RequestOutput]:
        """vLLM's `LLM.chat`: one conversation (a list of {"role", "content"} dicts) or a list of them,
        rendered by the tokenizer's chat template with the generation prompt, then `generate`."""
        if self.tokenizer is None or not getattr(self.tokenizer, "chat_template", None):
            raise ValueError("chat: the LLM's tokenizer has no chat template (pass token ids to generate)")
        if conversations and isinstance(conversations[0], dict):
            conversations = [conversations]
        prompts = [chat_prompt_ids(self.tokenizer, c, **template_kwargs) for c in conversations]
        return self.generate(prompts, sampling_params, use_tqdm)

    def output(self, seq: Sequence) -> RequestOutput:
        text = self.tokenizer.decode(seq.completion_token_ids, skip_special_tokens=True) if self.tokenizer else None
        return RequestOutput(seq.request_id, seq.sample_index, seq.prompt_token_ids, seq.completion_token_ids,
                             seq.logprobs, seq.from_verify, text, seq.finish_reason)

    # ---- one engine step ------------------------------------------------------------------------
    @torch.inference_mode()
    def step(self) -> list[Sequence]:
        """Run one forward; returns the sequences that finished in this step."""
        seqs, is_prefill = self.scheduler.schedule()
        if not seqs:
            return []
        if is_prefill:
            return self._prefill(seqs)
        return self._decode(seqs)

    def _prefill(self, seqs: list[Sequence]) -> list[Sequence]:
        starts = [s.num_computed for s in seqs]
        ends = [Scheduler.prefill_end(s) for s in seqs]
        fresh = [i for i, s in enumerate(seqs) if len(s) == s.num_prompt_tokens]   # they sample now
        # Speculative prefill: a fresh prompt's first drafts (the prior rollout's opening, the suffix
        # tree's prompt -> answer paths) ride in its prefill and are verified by the same forward, so
        # the first decode step is not spent on one token. Drafters with their own KV (self_nf4, draft
        # model) have not seen the prompt yet: they draft from the first decode step on.
        drafts = {}
        proposal = Proposal([[] for _ in fresh])
        if fresh and self.drafter is not None and not self.drafter.needs_kv:
            proposal = self._propose([seqs[i] for i in fresh])
            drafts = dict(zip(fresh, proposal.tokens))
        tokens = [s.token_ids[a:b] + drafts.get(i, []) for i, (s, a, b) in enumerate(zip(seqs, starts, ends))]
        t0 = time.perf_counter()
        hidden = self.runner.forward(seqs, tokens, starts)
        self.stats["target_forwards"] += 1
        self.stats["prefill_tokens"] += sum(b - a for a, b in zip(starts, ends))
        if self.prefills_draft_kv:
            self.drafter.prefill(seqs, tokens, starts, hidden if self.drafter.wants_hidden else None)
        for s, b in zip(seqs, ends):
            s.num_computed = b
        finished = []
        if fresh:    # logits at each fresh row's last prompt token and at its drafts
            logits, index = self._logits_at(hidden, [(i, ends[i] - starts[i] - 1, len(d) + 1)
                                                     for i, d in zip(fresh, proposal.tokens)])
            finished = self._verify_and_append([seqs[i] for i in fresh], logits, proposal, index)
        self.seconds["prefill"] += time.perf_counter() - t0
        if self.controller is not None:     # a step like any other: it closes what budgets() opened
            self.controller.observe_forward(seqs, tokens, time.perf_counter() - t0, prefill=True)
        return finished

    def _decode(self, seqs: list[Sequence]) -> list[Sequence]:
        proposal = self._propose(seqs)
        tokens = [[s.last_token] + d for s, d in zip(seqs, proposal.tokens)]
        t0 = time.perf_counter()
        hidden = self.runner.forward(seqs, tokens, [len(s) - 1 for s in seqs])   # [B, K+1, D]
        logits, index = self._logits_at(hidden, [(b, 0, len(t)) for b, t in enumerate(tokens)])
        self.stats["target_forwards"] += 1
        starts = [len(s) - 1 for s in seqs]
        finished = self._verify_and_append(seqs, logits, proposal, index)
        t1 = time.perf_counter()
        self.seconds["decode"] += t1 - t0
        if self.speculate and self.drafter is not None and self.drafter.wants_hidden:   # a draft head's inputs:
            self.drafter.observe_hidden(seqs, starts, [s.num_computed - a for s, a in zip(seqs, starts)], hidden)
            self.seconds["propose"] += time.perf_counter() - t1
        if self.controller is not None:
            self.controller.observe_forward(seqs, tokens, time.perf_counter() - t0)
        return finished

    def _logits_at(self, hidden: torch.Tensor, spans: list[tuple[int, int, int]]):
        """The LM head at the real positions only: span (b, a, n) is row b's positions a .. a+n-1 of hidden
        [B, Q, D]. A ragged verify (a few rows with drafts) then costs its real tokens, not B * (K+1), as
        the latency model prices it. -> logits [N, V] and index [spans, K+1] naming span i's j-th logits
        row (its last repeated), as verify.verify takes them."""
        Q, K1, flat, index = hidden.shape[1], max(n for *_, n in spans), [], []
        for b, a, n in spans:
            index.append([len(flat) + min(j, n - 1) for j in range(K1)])
            flat.extend(range(b * Q + a, b * Q + a + n))
        flat = torch.tensor(flat, device=self.device)
        return self.model.logits(hidden.flatten(0, 1).index_select(0, flat)), torch.tensor(index, device=self.device)

    def _propose(self, seqs: list[Sequence]) -> Proposal:
        empty = Proposal([[] for _ in seqs])
        if self.drafter is None or not self.speculate:
            return empty
        budgets = (self.controller.budgets(seqs, self.num_draft_tokens, draining=not self.scheduler.waiting)
                   if self.controller is not None
                   else [self.num_draft_tokens] * len(seqs))
        if not any(budgets):       # the toggle's common "off" answer: skip the per-sequence work below
            return empty
        self.stats["asked_rows"] += len(seqs)       # the per-row work below, drafts found or not (tools.simulate)
        # never draft past max_tokens, the model's length, or the KV blocks we can get
        budgets = [max(0, min(k, s.params.max_tokens - s.num_completion_tokens - 1,
                              self.max_model_len - len(s) - 1)) for s, k in zip(seqs, budgets)]
        for s, k in zip(seqs, budgets):
            if k:   # best effort: drafts are optional, so a short pool only clips them
                self.blocks.ensure(s, len(s) + k)
        budgets = [min(k, len(s.block_table) * self.blocks.block_size - len(s)) for s, k in zip(seqs, budgets)]
        if not any(budgets):
            return empty
        drafting = [s for s, k in zip(seqs, budgets) if k]
        lag = (sum(len(s) - s.num_draft_computed for s in drafting) / len(drafting)   # a model drafter's
               if self.drafter.needs_kv else 1.0)                                     # catch-up, tokens a row
        t0 = time.perf_counter()
        proposal = self.drafter.propose(seqs, budgets)
        seconds = time.perf_counter() - t0
        self.seconds["propose"] += seconds
        for name in set(proposal.sources) - {""}:   # a model drafter runs one forward per draft position
            per = self.stats["per_drafter"][name]
            per["propose_steps"] += 1
            per["depth"] += max(len(t) for t, n in zip(proposal.tokens, proposal.sources) if n == name)
        if self.controller is not None:
            proposal = self.controller.clip(proposal, budgets, seqs)
            self.controller.observe_draft_time(seconds, len(drafting), sum(map(len, drafting)) / len(drafting),
                                               max(budgets) if self.drafter.needs_kv else 0, lag)
        for i, k in enumerate(budgets):
            assert len(proposal.tokens[i]) <= k, f"drafter {proposal.sources[i]} proposed past its budget"
        return proposal

    def _verify_and_append(self, seqs, logits, proposal: Proposal, index) -> list[Sequence]:
        """Verify every row's drafts in one call, append the emitted tokens, finish the sequences that
        stopped. logits: packed [N, V] with index [B, K+1] (`_logits_at`, verify.verify)."""
        dev, drafts, V = self.device, proposal.tokens, logits.shape[-1]
        B, K = len(seqs), max(map(len, drafts))
        key = (V, *((s.params.temperature, s.params.top_k, s.params.top_p) for s in seqs))
        if self._st_key != key:   # decode steps repeat the same batch: build it once
            self._st_key, self._st = key, SamplingTensors.from_params([s.params for s in seqs], V, dev)
        draft = torch.tensor([d + [0] * (K - len(d)) for d in drafts], dtype=torch.long, device=dev).view(B, K)
        num_draft = torch.tensor([len(d) for d in drafts], device=dev)
        u = self._uniforms(seqs, drafts, K, self._st.all_greedy)                       # [B, K+1]
        q = proposal.q[:, :K].to(dev) if proposal.q is not None else None
        lq = proposal.lenient_q[:, :K].to(dev) if proposal.lenient_q is not None else None
        n, toks, lps = verify(logits, index, draft, num_draft, self._st, u[:, :K], u[:, K], q, lq)
        host = torch.cat([n.unsqueeze(1).double(), toks.double(), lps.double()], 1).tolist()  # one sync
        finished = []
        for i, (s, row) in enumerate(zip(seqs, host)):
            n_acc = int(row[0])
            kept, reason = self._append(s, row[1:2 + n_acc], row[2 + K:3 + K + n_acc], bool(drafts[i]))
            # a stop on an accepted draft drops the drafts after it: count only those before the stop,
            # so every verify step emits accepted + 1 tokens (mean_accepted_len), here and in the policy
            used = kept - 1 if kept <= n_acc else len(drafts[i])
            s.num_forwards, s.num_drafted = s.num_forwards + 1, s.num_drafted + len(drafts[i])
            self._count(proposal.sources[i], used, min(n_acc, used),
                        proposal.confidence[i] if proposal.confidence else None)
            if not reason:
                s.num_computed = len(s) - 1
                s.num_draft_computed = min(s.num_draft_computed, s.num_computed)
                self.blocks.truncate(s, len(s))
            else:
                self.scheduler.finish(s, reason)
                if self.drafter is not None:
                    if self.speculate:
                        self.drafter.observe(s)
                    self.drafter.free(s)
                finished.append(s)
        self.stats["seq_forwards"] += B
        self.stats["drafting_steps"] += K > 0       # steps that verified drafts (spec_on_frac)
        return finished

    def _uniforms(self, seqs, drafts, K: int, all_greedy: bool) -> torch.Tensor:
        """[B, K+1] uniforms in (0, 1]: row i's drafts use [:len(drafts[i])], its final token [K].
        Each row draws exactly len(drafts[i]) + 1 from its generator, so a seeded request's stream does
        not depend on the draft lengths of its batch-mates. Rows sharing a generator draw in one call
        (the CPU generator is serial: one call of n == n calls in row order, bit for bit). All-greedy
        batches draw them too (the streams advance the same way) but need no tensor of them."""
        B, K1 = len(seqs), K + 1
        groups = {}
        for i, s in enumerate(seqs):
            g = s.generator or self.generator
            groups.setdefault(id(g), (g, []))[1].append(i)
        u = None if all_greedy else torch.ones(B * K1)
        for g, rows in groups.values():
            idx = [i * K1 + j for i in rows for j in (*range(len(drafts[i])), K)]
            r = torch.rand(len(idx), generator=g)
            if u is not None:
                u[idx] = 1.0 - r
        return torch.ones(B, K1, device=self.device) if u is None else u.view(B, K1).to(self.device)

    def _append(self, s: Sequence, tokens, logprobs, from_verify: bool) -> tuple[int, str | None]:
        """Append the emitted tokens up to a stop -> (tokens kept, finish reason or None)."""
        kept, reason = 0, None
        for t, lp in zip(tokens, logprobs):
            s.token_ids.append(int(t))
            s.logprobs.append(lp)
            s.from_verify.append(from_verify)
            kept += 1
            reason = self._finish_reason(s, int(t))
            if reason:
                break
        self.stats["generated_tokens"] += kept
        return kept, reason

    def _finish_reason(self, s: Sequence, token: int) -> str | None:
        if not s.params.ignore_eos and (token in self.eos_ids or token in s.params.stop_token_ids):
            return "stop"
        if s.num_completion_tokens >= s.params.max_tokens or len(s) >= self.max_model_len:
            return "length"
        return None

    # ---- memory between rollouts -----------------------------------------------------------------
    def sleep(self, level: int = 1) -> None:
        """Free the KV pool and the CPU linears' prepacked weights while the engine is idle (vLLM's sleep
        mode, for the cache): a trainer on the same machine gets that memory for its backward, and an
        update makes the packed copies stale anyway. `wake_up()` before the next request.
        Level 2 (vLLM's too) also frees the target model's weights, for an engine with its own copy (a
        sharded trainer then never holds the engine's weights and its gradients at once): each
        storage shrinks to 0 bytes, the tensors stay (so drafters' and modules' references hold), and
        `wake_up` re-allocates them uninitialised; `load_weights` must fill them before any request. From
        then on (CPU fp32) a layer keeps only its prepacked copy (`cpu_linear.PackedLinear.keep_weight`)."""
        if self.scheduler.has_work():
            raise RuntimeError("sleep: requests are still running; finish or abort them first")
        self.blocks.reset_prefix_cache()     # the cached prompt KV goes with the pool
        self.blocks.rewind()
        for r in self._runners():
            r.sleep()
        drop_packed_weights(self.model)
        if level == 2 and not self._asleep:
            for m in self.model.model.layers.modules():
                if isinstance(m, PackedLinear):
                    m.keep_weight = False
            storages = {t.untyped_storage().data_ptr(): t.untyped_storage() for t in self.model.state_dict().values()}
            self._asleep = [(st, st.nbytes()) for st in storages.values()]
            for st, _ in self._asleep:
                st.resize_(0)

    def wake_up(self) -> None:
        for st, nbytes in self._asleep:
            st.resize_(nbytes)
        self._asleep = []
        for r in self._runners():
            r.wake_up()

    def _runners(self) -> list:
        return [self.runner] + [d.runner for d in members(self.drafter) if d.needs_kv]

    # ---- stats and weights ----------------------------------------------------------------------
    def _count(self, source: str, proposed: int, accepted: int, confidence=None) -> None:
        if not proposed:
            return
        st = self.stats
        st["verify_steps"] += 1
        st["proposed_tokens"] += proposed
        st["accepted_tokens"] += accepted
        per = st["per_drafter"][source]
        per["verify_steps"] += 1
        per["proposed"] += proposed
        per["accepted"] += accepted
        for j in range(1, min(proposed, accepted + 1) + 1):    # draft j was tried (d_1..d_{j-1} accepted)
            per[f"tried_{j}"] += 1
            per[f"accepted_{j}"] += j <= accepted
        if self.controller is not None:
            self.controller.observe_acceptance(source, proposed, accepted, confidence)

    def reset_stats(self) -> None:
        self.stats = defaultdict(int, dict.fromkeys(COUNTERS, 0))   # every counter present, 0 until counted
        self.stats["per_drafter"] = defaultdict(lambda: defaultdict(int))
        self.seconds = dict(prefill=0.0, decode=0.0, propose=0.0)  # where a rollout's time went (tools.simulate)

    def summary(self) -> dict:
        """Flat derived stats of this engine (see `summarize`)."""
        return summarize(self.stats, lossy=bool(self.drafter is not None and self.drafter.lossy))

    @torch.no_grad()
    def load_weights(self, state_dict: dict) -> None:
        """In-place copy (tensor identity preserved for graphs/drafters), then refresh drafters."""
        params = self.model.state_dict()
        for name, t in state_dict.items():
            if name not in params:
                raise ValueError(f"load_weights: unexpected tensor {name!r}")
            if params[name].shape != t.shape:
                raise ValueError(f"load_weights: {name!r} has shape {tuple(t.shape)}, expected {tuple(params[name].shape)}")
            if params[name].data_ptr() != t.data_ptr():    # a trainer sharing our tensors has nothing to copy
                p = params[name]
                if p.untyped_storage().nbytes() < p.nbytes:     # freed once packed (sleep level 2)
                    p.untyped_storage().resize_(p.nbytes)
                p.copy_(t)
        self.blocks.reset_prefix_cache()    # cached prompt KV was computed with the old weights
        if self.drafter is not None:
            self.drafter.refresh(self.model)

    @torch.inference_mode()
    def time_forward(self, batch_size: int, ctx_len: int, num_query: int | list[int], drafter=None) -> float:
        """Seconds of one target forward at (B, C, Q) on scratch blocks: the latency model's profile.
        num_query as a list: row b's new tokens, a ragged prefill, sampled at each row's last one only.
        With a model drafter: one forward of its model instead (it shares the target's block tables)."""
        model, runner = (self.model, self.runner) if drafter is None else (drafter.model, drafter.runner)
        ragged = isinstance(num_query, list)
        qs = num_query if ragged else [num_query] * batch_size
        seqs = [Sequence([0] * (ctx_len + q), SamplingParams()) for q in qs]
        try:
            if not all(self.blocks.ensure(s, len(s)) for s in seqs):
                raise RuntimeError(f"time_forward: not enough free KV blocks for B={batch_size}, C={ctx_len}")
            tokens = [[1] * q for q in qs]
            runner.zero_new_blocks(seqs)         # a one-off cost, not the forward's
            if self.device.type == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            hidden = runner.forward(seqs, tokens, [ctx_len] * batch_size)
            model.logits(hidden[torch.arange(batch_size), torch.tensor(qs) - 1] if ragged else hidden)
            if self.device.type == "cuda":
                torch.cuda.synchronize()
            return time.perf_counter() - t0
        finally:
            for s in seqs:
                self.blocks.free(s)

    @property
    def num_free_blocks(self) -> int:
        return self.blocks.num_free


# the engine's counters (`LLM.stats`): summed over ranks by the rollout worker, derived by `summarize`
COUNTERS = ("target_forwards", "seq_forwards", "generated_tokens", "prefill_tokens", "verify_steps",
            "proposed_tokens", "accepted_tokens", "drafting_steps", "asked_rows")


def summarize(stats: dict, lossy: bool) -> dict:
    """Raw counters (`LLM.stats`, or their sum over ranks) -> flat derived stats: target forwards per
    token, mean accepted length (accepted + 1 per verify step), draft length (drafts per verify row),
    the share of steps that verified drafts, per-drafter `drafter/<name>/...`."""
    out = {k: v for k, v in stats.items() if k != "per_drafter"}
    tokens = max(stats["generated_tokens"], 1)
    out["target_forwards_per_token"] = stats["seq_forwards"] / tokens
    out["mean_accepted_len"] = (stats["accepted_tokens"] + stats["verify_steps"]) / max(stats["verify_steps"], 1)
    out["draft_len_mean"] = stats["proposed_tokens"] / max(stats["verify_steps"], 1)
    out["spec_on_frac"] = stats["drafting_steps"] / max(stats["target_forwards"], 1)
    out["acceptance_rate"] = stats["accepted_tokens"] / max(stats["proposed_tokens"], 1)
    out["lossy"] = lossy
    for name, d in stats["per_drafter"].items():
        pre = f"drafter/{name}/"
        out[pre + "propose_steps"], out[pre + "depth"] = d.get("propose_steps", 0), d.get("depth", 0)
        if not d.get("verify_steps"):     # every draft it made was cut before the verify (controller.clip)
            continue
        out[pre + "proposed"], out[pre + "accepted"] = d["proposed"], d["accepted"]
        out[pre + "verify_steps"] = d["verify_steps"]
        out[pre + "acceptance_rate"] = d["accepted"] / max(d["proposed"], 1)
        out[pre + "mean_accepted_len"] = (d["accepted"] + d["verify_steps"]) / max(d["verify_steps"], 1)
        out[pre + "draft_len"] = d["proposed"] / max(d["verify_steps"], 1)
        for j in itertools.count(1):     # acceptance by draft position: P(d_j accepted | d_1..d_{j-1} were)
            if not d.get(f"tried_{j}"):
                break
            out[pre + f"accept_pos{j}"] = d[f"accepted_{j}"] / d[f"tried_{j}"]
    return out
