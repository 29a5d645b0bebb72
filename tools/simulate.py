"""Projected GRPO step time, sync or async x AR or speculative, from a roofline of decode, verify and
train, an event-driven replay of each rank's drain, and a nanospec run's measured traces.

    python -m tools.simulate --run RUN_DIR                    # replay a run on this CPU (calibrated)
    python -m tools.simulate --run RUN_DIR --hardware cuda    # a GPU run, on this machine's GPU (calibrated)
    python -m tools.simulate --run bench_out/rollout.json --model runs/sft   # bench rows with `steps`
    python -m tools.simulate --lengths gsm8k --acceptance 0.40 --model qwen3-8b --hardware h100 --dp 8

Nothing here is a speedup: every number comes from the model's shape, the hardware and the trace.
 * Roofline (Williams, Waterman & Patterson, CACM 2009): a step costs max(FLOPs / FLOP/s, bytes /
   bandwidth) + host time (on one CPU core the two add). Decode reads every weight once for all B*Q
   query tokens: while memory-bound, verifying k drafts costs about one decode step (why speculation
   pays on a GPU); ~(k+1) once compute-bound.
 * Speculation (Leviathan et al. 2023, eq. 1): E = (1 - a^(k+1)) / (1 - a) tokens per verify of k
   drafts, a from the trace's accepted/proposed per drafter and rank, or each row replays its own rate.
 * Drain: continuous batching, B shrinks as responses finish; sync data parallel waits for the slowest
   rank: the others' wait is the bubble.
 * Async, one-step off-policy: split ranks (NeMo-RL's async GRPO; arXiv:2604.26779 projects 2.5x
   end-to-end at 235B with its own simulator) cost max(rollout, train + weight sync), not their sum; on
   the same ranks (grpo.max_staleness: 1) only the bubble goes.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import re
import statistics
import sys
import time
from collections import deque
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from nanospec.config import read_jsonl
from nanospec.drafters.registry import METHODS


# ---- hardware -------------------------------------------------------------------------------------
@dataclass
class Hardware:
    name: str
    flops: float                      # peak dense FLOP/s at the engine's dtype
    mem_bw: float                     # device memory bytes/s
    interconnect_bw: float            # bytes/s per device, both directions (a data sheet's NVLink figure)
    step_overhead_s: float = 0.0      # per engine step: scheduling, sampling, launches, host sync
    seq_overhead_s: float = 0.0       # per sequence per engine step (host work per row)
    verify_overhead_s: float = 0.0    # once per step that verifies any draft (ragged packing, rejection sampler)
    spec_step_overhead_s: float = 0.0  # per step of an engine with drafters, drafting or not: the rule's budgets
    asked_row_s: float = 0.0          # per row of a step whose drafter is asked, drafts found or not (clips, KV blocks)
    verify_token_s: float = 0.0       # per draft token a step verifies, beyond its forward
    wide_flops: float = 0.0           # FLOP/s of a padded wide step (Q > SMALL_Q: a prefill, SDPA); 0: flops
    flops_eff: float = 1.0            # achievable fraction of peak FLOP/s in decode / verify GEMMs
    bw_eff: float = 1.0               # achievable fraction of peak bandwidth
    train_mfu: float = 1.0            # achievable fraction of peak FLOP/s in the trainer's forward + backward
    train_overhead_s: float = 0.0     # per optimizer step outside the FLOPs (rewards, batching, launches)
    draft_token_s: float = 0.0        # a history drafter's host time per token its rows emit (propose())
    draft_step_overhead_s: float = 0.0  # a draft head's host time per forward (one per draft position)
    draft_row_s: float = 0.0          # ... and per row it drafts (its draw, the q handed to verify)
    draft_key_s: float = 0.0          # ... and per cached key a row reads beyond the roofline (its KV gather)
    repack_s_per_param: float = 0.0   # CPU: the first engine step after a weight update re-lays out every linear
    overlap: bool = True              # compute and memory traffic overlap (GPU); False: they add (one CPU core)
    padded: bool = True               # attention padded to a step's longest row (nanospec's engine); False: varlen


# NVIDIA's data sheets (H100 SXM5 / H200 SXM: dense BF16 989 TFLOP/s, HBM3 3.35 / HBM3e 4.8 TB/s, NVLink
# 900 GB/s). Assumed: 80% of HBM bandwidth, 60% of peak in verify GEMMs, 40% MFU in training, 1 ms host time
# per step (CUDA graphs), 10 us per emitted token for history drafters (5-16 us on the 2-core box). Measured:
# a draft head's eager forward, 1.2 ms at B=1-8 on the H200 at 0.5B (docs/results.md, "The second GPU run").
_GPU = dict(padded=False, step_overhead_s=1e-3, flops_eff=0.6, bw_eff=0.8, train_mfu=0.4, draft_token_s=1e-5,
            draft_step_overhead_s=1.2e-3)
PRESETS = {"h100": Hardware("h100", 989e12, 3.35e12, 900e9, **_GPU),
           "h200": Hardware("h200", 989e12, 4.8e12, 900e9, **_GPU)}


# ---- model shape ----------------------------------------------------------------------------------
@dataclass
class ModelShape:
    name: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    vocab: int
    tied: bool
    dtype_bytes: int = 2
    extra_params: int = 0             # matmul weights outside the layers (a draft head's fc)

    @property
    def lm_head(self) -> int:         # the LM head's weights (a draft head's: its draft vocabulary's rows)
        return self.vocab * self.hidden

    @property
    def matmul_params(self) -> int:   # per layer: q, k, v, o + SwiGLU gate, up, down; + the LM head
        return self.layers * (self.hidden * self.head_dim * 2 * (self.heads + self.kv_heads)
                               + 3 * self.hidden * self.ffn) + self.lm_head + self.extra_params

    def draft_head(self, draft_vocab: int | None = None) -> "ModelShape":
        """EAGLE's head (drafters/head.py): fc [2D -> D], one layer of this shape, the draft vocab's LM rows."""
        return replace(self, name=f"{self.name} head", layers=1, vocab=draft_vocab or self.vocab,
                       extra_params=2 * self.hidden * self.hidden)

    @property
    def params(self) -> int:          # + the input embedding when it is not the LM head
        return self.matmul_params + (0 if self.tied else self.lm_head)

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * self.dtype_bytes

    @property
    def attn_flops_per_pair(self) -> int:   # one (query, key) pair: q.k and p*v, 2 FLOPs per MAC
        return 4 * self.layers * self.heads * self.head_dim

    @classmethod
    def from_config(cls, cfg: dict, where: str, dtype: str | None = None) -> "ModelShape":
        for k in ("num_hidden_layers", "hidden_size", "num_attention_heads", "intermediate_size", "vocab_size"):
            if k not in cfg:
                raise ValueError(f"{where}: missing key {k!r}")
        H = cfg["num_attention_heads"]
        dtype = dtype or cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16"
        if dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"{where}: dtype {dtype!r}: expected float32, bfloat16 or float16")
        return cls(cfg.get("_name_or_path") or Path(where).parent.name or where, cfg["num_hidden_layers"],
                   cfg["hidden_size"], H, cfg.get("num_key_value_heads") or H,
                   cfg.get("head_dim") or cfg["hidden_size"] // H, cfg["intermediate_size"], cfg["vocab_size"],
                   cfg.get("tie_word_embeddings", cfg.get("model_type") != "llama"), 4 if dtype == "float32" else 2)


# config.json values of public checkpoints (Qwen/Qwen3-8B, meta-llama/Llama-3.1-8B)
MODELS = {"qwen3-8b": dict(model_type="qwen3", num_hidden_layers=36, hidden_size=4096, num_attention_heads=32,
                           num_key_value_heads=8, head_dim=128, intermediate_size=12288, vocab_size=151936,
                           tie_word_embeddings=False, torch_dtype="bfloat16", _name_or_path="qwen3-8b"),
          "llama3-8b": dict(model_type="llama", num_hidden_layers=32, hidden_size=4096, num_attention_heads=32,
                            num_key_value_heads=8, intermediate_size=14336, vocab_size=128256,
                            tie_word_embeddings=False, torch_dtype="bfloat16", _name_or_path="llama3-8b")}


def load_model_config(spec: str) -> tuple[dict, str]:
    """A preset, a config.json, or any model form `models.hub.resolve_model` takes -> (config, where)."""
    if spec in MODELS:
        return MODELS[spec], spec
    if Path(spec).is_file() and Path(spec).suffix == ".json":
        return json.loads(Path(spec).read_text()), spec
    from nanospec.models.hub import resolve_model
    try:
        path = resolve_model(spec) / "config.json"
    except (FileNotFoundError, ValueError) as e:
        raise ValueError(f"--model: {spec}: not a preset ({', '.join(MODELS)}) or config.json, and not a model: {e}") from None
    if not path.is_file():
        raise ValueError(f"--model: {spec}: {path} not found")
    return json.loads(path.read_text()), str(path)


@dataclass
class Layout:
    dp: int = 1                # data-parallel ranks (model replicas)
    tp: int = 1                # tensor-parallel devices per replica
    gen_dp: int | None = None  # async: ranks that generate (the rest train); None = the best split
    max_seqs: int = 256        # per engine: running sequences (vLLM's max_num_seqs)
    block_size: int = 16       # KV block: prefix caching shares a prompt's full blocks
    shared_weights: bool = False  # sync: the engine runs the policy's own tensors (rl/grpo.py: fp32, replicated)


# ---- roofline ----------------------------------------------------------------------------------------
SMALL_Q = 16      # engine/paged_attention.SMALL_Q: on CPU, steps up to this many query tokens a row skip SDPA


def step_time(hw: Hardware, m: ModelShape, tp: int, rows: float, tokens: float, kv_read: float, pairs: float,
              verify: float = 0.0, head_tokens: float | None = None) -> float:
    """Seconds of one engine forward: `rows` sequences feed `tokens` query tokens (B*Q), read `kv_read`
    cached tokens and score `pairs` (query, key) pairs; the LM head sees `head_tokens` of them (default
    all: a decode or verify step; a prefill samples only at each prompt's last token and its drafts).
        FLOPs = 2 * (matmul_params - lm_head) * tokens + 2 * lm_head * head_tokens + attn_flops_per_pair * pairs
        bytes = weights + (kv_read + tokens) * kv_bytes_per_token            (KV reads + writes)
    TP splits both over tp devices and adds 2 activation all-reduces per layer (ring: 2(tp-1)/tp).
    On one CPU core they add (docs/results.md, issue 48: SmolLM2's batch-1 step reads at ~6 GB/s)."""
    matmuls = (m.matmul_params - m.lm_head) * tokens + m.lm_head * (tokens if head_tokens is None else head_tokens)
    compute = (2 * matmuls + m.attn_flops_per_pair * pairs) / (tp * hw.flops * hw.flops_eff)
    nbytes = m.matmul_params * m.dtype_bytes + (kv_read + tokens) * m.kv_bytes_per_token
    memory = nbytes / (tp * hw.mem_bw * hw.bw_eff)
    comm = 2 * m.layers * tokens * m.hidden * m.dtype_bytes * 2 * (tp - 1) / tp / (hw.interconnect_bw / 2)
    body = max(compute, memory) if hw.overlap else compute + memory
    return body + comm + hw.step_overhead_s + hw.seq_overhead_s * rows + hw.verify_overhead_s * verify


def engine_step(hw: Hardware, m: ModelShape, tp: int, qs: list | float, ctx: list, verify: float = 0.0,
                head_tokens: float | None = None) -> float:
    """One forward: row b feeds qs[b] new tokens (a number: every row as many) after ctx[b] cached; the
    linears see only real tokens (the LM head `head_tokens` of them: step_time). nanospec's engine (hw.padded)
    gathers the longest row's keys for every row and pads a wide step (Q > SMALL_Q: a prefill) to the widest
    row; varlen kernels (vLLM's) do not."""
    B = len(ctx)
    if isinstance(qs, list):
        N, Q, C = sum(qs), max(qs), max(c + q for q, c in zip(qs, ctx))
        causal = lambda: sum(q * (c + q / 2) for q, c in zip(qs, ctx))
    else:        # the mean replay prices every draft length of every step: no loop over the rows
        N, Q, C = B * qs, qs, max(ctx) + qs
        causal = lambda: qs * (sum(ctx) + B * qs / 2)
    if not hw.padded:
        return step_time(hw, m, tp, B, N, sum(ctx), causal(), verify, head_tokens)
    if hw.wide_flops and Q > SMALL_Q:      # SDPA and wide GEMMs: their own FLOP/s (_fit_wide)
        hw = replace(hw, flops=hw.wide_flops, flops_eff=1.0)
    return step_time(hw, m, tp, B, N, B * C - N, (B * Q if Q > SMALL_Q else N) * C, verify, head_tokens)


def update_time(hw: Hardware, params: int, ranks: int) -> tuple[float, float]:
    """(ring all-reduce of `params` fp32 gradients over `ranks`: 2 (n-1)/n * 4 bytes each one way; AdamW:
    reads param, grad, m, v and writes param, m, v: 28 bytes/param)."""
    allreduce = 2 * (ranks - 1) / ranks * 4 * params / (hw.interconnect_bw / 2) if ranks > 1 else 0.0
    return allreduce, 28 * params / (hw.mem_bw * hw.bw_eff)


def train_time(hw: Hardware, m: ModelShape, seqs_per_rank: list[list[tuple[int, int]]], ref_model: bool) -> float:
    """One optimizer step: the slowest rank's forward + backward, `update_time`, the measured rest."""
    compute = max(train_compute(hw, m, seqs_per_rank, ref_model))
    allreduce, adamw = update_time(hw, m.params, len(seqs_per_rank))
    return compute + allreduce + adamw + hw.train_overhead_s


def train_compute(hw: Hardware, m: ModelShape, seqs_per_rank: list[list[tuple[int, int]]], ref_model: bool) -> list:
    """Each rank's forward + backward seconds at train_mfu over rl/grpo.micro_batches. A micro-batch of
    b sequences padded to L tokens, T of them completions (the longest response):
        body: (6 [+ 2 reference]) * body params * b * L + 1.5 * attn_flops_per_pair * b * L^2
        LM head, on completions only, checkpointed (forward, recomputed forward, backward = 2 + 2 + 4)
        [+ 2 reference]: (8 [+ 2]) * vocab * hidden * b * T"""
    from types import SimpleNamespace
    from nanospec.rl.grpo import micro_batches
    head = m.lm_head
    body = m.matmul_params - head

    def flops(seqs):
        if not seqs:                  # a rank with no sample this step
            return 0.0
        fake = [SimpleNamespace(prompt_ids=range(p), completion_ids=range(L)) for p, L in seqs]
        total = 0.0
        for idx in (i for i in micro_batches(fake, 1) if i):
            b, L, T = len(idx), max(sum(seqs[i]) for i in idx), max(seqs[i][1] for i in idx)
            total += ((6 + 2 * ref_model) * body * b * L + 1.5 * m.attn_flops_per_pair * b * L * L
                      + (8 + 2 * ref_model) * head * b * T)
        return total
    return [flops(seqs) / (hw.flops * hw.train_mfu) for seqs in seqs_per_rank]


def head_train_time(hw: Hardware, head: ModelShape, st: dict, mode: str = "step") -> float:
    """The draft head's online step (rl/grpo.train_head) on the trace's `head/positions` per rank: UNROLL
    forward + backward passes of its fc and layer over every token (prompts ride along) and of its LM rows
    over the positions, the teacher's forward over them, then `update_time` over its own weights (the LM
    rows are the policy's). "bubble": the passes ran in idle time, only the update is paid; "off": frozen, 0."""
    from nanospec.drafters.head import UNROLL
    ranks = max(len(st["measured"].get("rank_busy_time") or [1]), 1)
    body, rows = head.matmul_params - head.lm_head, head.lm_head
    update = sum(update_time(hw, body, ranks))
    if mode != "step":
        return update if mode == "bubble" else 0.0
    positions = (st["measured"].get("head/positions") or 0) / ranks
    lens = [(p, L) for p, ls in st["groups"] for L in ls]
    tokens = positions * sum(p + L for p, L in lens) / max(sum(L for _, L in lens), 1)
    flops = UNROLL * 6 * (body * tokens + rows * positions) + 2 * rows * positions
    return flops / (hw.flops * hw.train_mfu) + update


def weight_sync_time(hw: Hardware, m: ModelShape, colocated: bool, shared: bool = False) -> float:
    """Colocated: a copy in device memory (read + write), or nothing when sharing the policy's tensors.
    Disaggregated (async): a pipelined broadcast to the generation group, about one transfer one way."""
    nbytes = m.params * m.dtype_bytes
    if not colocated:
        return nbytes / (hw.interconnect_bw / 2)
    return 0.0 if shared else 2 * nbytes / (hw.mem_bw * hw.bw_eff)


# ---- memory per rank -----------------------------------------------------------------------------------
DEVICE_BYTES = {"h100": 80e9, "h200": 141e9}     # HBM per GPU (data sheets)


def memory_rows(m: ModelShape, ranks: int, kv_tokens: int, device_bytes: float) -> list[dict]:
    """GiB per rank of colocated GRPO, replicated vs FSDP (run.sharding): fp32 training state (16 B per
    parameter, over `ranks` under FSDP, plus two gathered layers), the engine's copy in its dtype and
    `kv_tokens` of KV. Gradients live only in training, the KV pool only in rollout, and sleep level 2
    frees the engine's weights in training: peak = max(training, rollout); activations (per micro-batch) left out."""
    P, G = m.params, 1024 ** 3
    layer = (m.matmul_params - m.lm_head) / m.layers * m.dtype_bytes
    engine, kv = P * m.dtype_bytes, kv_tokens * m.kv_bytes_per_token
    rows = []
    for sharding, sleep in (("none", 1), ("fsdp", 1), ("fsdp", 2)):
        n = ranks if sharding == "fsdp" else 1
        weights, grads, opt = 4 * P / n, 4 * P / n, 8 * P / n
        gathered = 2 * layer if n > 1 else 0.0
        peak = max(weights + grads + opt + gathered + (engine if sleep == 1 else 0.0),   # training
                   weights + opt + engine + kv)                                          # rolling out
        rows.append(dict(sharding=sharding, sleep_level=sleep, weights_gib=weights / G, grads_gib=grads / G,
                         optimizer_gib=opt / G, engine_gib=engine / G, kv_gib=kv / G, peak_gib=peak / G,
                         fits=peak <= device_bytes))
    return rows


# ---- speculation --------------------------------------------------------------------------------------
def leviathan(a: float | tuple, k: float) -> float:
    """Expected tokens per verify of k drafts at acceptance a (Leviathan et al., eq. 1), or at
    per-position a = (a_1, a_2, ...), each given the drafts before (accept_pos<j>; the last repeats):
    1 + sum_j prod_{i <= j} a_i."""
    if isinstance(a, tuple):
        out, reach = 1.0, 1.0
        for j in range(int(k)):
            reach *= a[min(j, len(a) - 1)]
            out += reach
        return out
    return k + 1.0 if a >= 1.0 else (1.0 - a ** (k + 1)) / (1.0 - a)


def alpha_from_rate(rate: float, k: float) -> float:
    """Bisection for the a whose accepted/proposed at draft length k, (E(a, k) - 1) / k, is `rate`."""
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if (leviathan(mid, k) - 1) / k < rate else (lo, mid)
    return lo


@dataclass
class Spec:
    """How decode rows speculate; Spec() is AR. `drafters`: [(share of row-forwards verifying with it,
    draft length k, acceptance a)], replayed; `on`: share of engine steps that verify. best_k > 0: each
    step drafts the k in 0..best_k with the most tokens per second (an adaptive controller) at
    `drafters[0]`'s a. `head`: a draft head of this shape, its forwards priced (k per drafting step, or
    the trace's `head_use` = (share of steps it drafts on, forwards on each, rows in each));
    `head_training`: step, bubble or off; `history`: history drafters run (host time per emitted token);
    `asked`: share of row-forwards on steps whose drafter was asked (the engine's `asked_rows`)."""
    drafters: tuple = ()
    on: float = 0.0
    best_k: int = 0
    head: ModelShape | None = None
    head_use: tuple = (0.0, 0.0, 0.0)
    head_training: str = "step"
    history: bool = False
    asked: float = 0.0

    @property
    def configured(self) -> bool:
        """A drafter is configured: the engine asks the rule for budgets on every step, drafting or not."""
        return bool(self.drafters) or self.history or self.head is not None

    def drafting_time(self, hw: Hardware, B: int, C: float, q: float, emitted: float) -> float:
        """One step's drafting: the history drafters' time for the emitted tokens (drafting or not), and a
        head's one-token forwards at context C at its own host time per forward: q - 1 over the B rows
        when choosing k, else the trace's expectation (`head_use`)."""
        share, k, rows = (1.0, q - 1, B) if self.best_k and self.head else self.head_use
        head = 0.0
        if self.head is not None and share and k > 0:
            eager = self._eager(hw, row_s=hw.draft_row_s + hw.draft_key_s * C)
            head = share * (k * step_time(eager, self.head, 1, rows, rows, rows * C, rows * C))
        return self.history_time(hw, emitted) + head

    def head_prefill_time(self, hw: Hardware, qs: list, ctx: list) -> float:
        """A draft head's forward over the prompt tokens a prefill computes (its KV for the prompt, no LM
        head: drafters/head.py `prefill`), in the prefill step."""
        return 0.0 if self.head is None else engine_step(self._eager(hw), self.head, 1, qs, ctx, head_tokens=0)

    @staticmethod
    def _eager(hw: Hardware, row_s: float = 0.0) -> Hardware:
        """A head's forward: its own host time per forward (`draft_step_overhead_s`), and `row_s` per row
        (where it drafts: `drafting_time`; a prompt's forward has none)."""
        return replace(hw, step_overhead_s=hw.draft_step_overhead_s, seq_overhead_s=row_s, verify_overhead_s=0.0)

    def history_time(self, hw: Hardware, emitted: float) -> float:
        """The history drafters' host time for `emitted` tokens (prefill's first tokens included)."""
        return hw.draft_token_s * emitted if self.history else 0.0

    def host_time(self, hw: Hardware, rows: float, q: float = 1.0, drafts: float = 0.0) -> float:
        """The engine's own work on the `rows` of a step whose drafter is asked, drafts found or not (the
        trace's share of them; choosing k: when it drafts), and per draft token it verifies. Host time of
        the step, not of propose()."""
        return hw.asked_row_s * rows * (float(q > 1) if self.best_k else self.asked) + hw.verify_token_s * drafts

    def replay_q(self) -> float:
        """Query tokens per row of a replayed trace (1 + drafts per row-forward); 1 when choosing k."""
        return 1.0 if self.best_k else 1.0 + sum(f * k for f, k, _ in self.drafters)

    def choose(self, cost) -> tuple[float, float, float]:
        """cost(q, tau, verify) -> seconds; returns (query tokens per row, tokens emitted per row, verify share)."""
        if self.best_k:
            a = self.drafters[0][2]
            return max(((1.0 + k, leviathan(a, k), float(k > 0)) for k in range(self.best_k + 1)),
                       key=lambda o: o[1] / cost(*o))
        return self.replay_q(), 1.0 + sum(f * (leviathan(a, k) - 1.0) for f, k, a in self.drafters), self.on


HISTORY_DRAFTERS = {name for name, m in METHODS.items() if not m.own_kv}   # their propose() is host work


def spec_from_metrics(r: dict, head_cap: int | None = None) -> Spec:
    """Per drafter d: share = verify_steps_d / seq_forwards, k = proposed_d / verify_steps_d, a from
    accepted_d / proposed_d at k. A head's forwards: its `depth` (longest draft per step), or, in an
    older trace, `head_cap` (its num_draft_tokens) on every step that drafted."""
    rows = max(r["seq_forwards"], 1)
    ds = []
    for key in sorted(k for k in r if k.startswith("drafter/") and k.endswith("/verify_steps")):
        name = key.split("/")[1]
        v, prop, acc = r[key], r.get(f"drafter/{name}/proposed", 0), r.get(f"drafter/{name}/accepted", 0)
        if v and prop:
            k = prop / v
            ds.append((v / rows, k, alpha_from_rate(acc / prop, k)))
    use, v, forwards = (0.0, 0.0, 0.0), r.get("drafter/head/verify_steps") or 0, max(r.get("target_forwards") or 1, 1)
    if v:
        steps = r.get("drafter/head/propose_steps") or r.get("drafting_steps") or forwards
        depth = r.get("drafter/head/depth") or steps * (head_cap or r["drafter/head/proposed"] / v)
        use = (min(1.0, steps / forwards), depth / steps, v / steps)
    history = any(k.split("/")[1] in HISTORY_DRAFTERS for k in r if k.startswith("drafter/"))
    asked = r.get("asked_rows", 0) / rows     # (a trace before the counter: not priced)
    return Spec(tuple(ds), r.get("spec_on_frac", 1.0 if ds else 0.0), asked=asked, head_use=use, history=history)


RANK_KEYS = ("rank_seq_forwards", "rank_verify_steps", "rank_proposed_tokens", "rank_accepted_tokens")


def rank_specs(r: dict) -> list[Spec] | None:
    """Per-rank speculation (drafters merged) where the trace counts per rank: ranks draft differently
    (a revisited prompt has a prior rollout to draft from, a new one not)."""
    if not all(isinstance(r.get(k), list) for k in RANK_KEYS):
        return None
    on = r.get("rank_spec_on_frac")            # an older trace lacks it: a rank that drafted, every step
    return [Spec(((v / max(s, 1), p / v, alpha_from_rate(a / p, p / v)),) if v and p else (),
                 on[i] if on else float(bool(v)))
            for i, (s, v, p, a) in enumerate(zip(*(r[k] for k in RANK_KEYS)))]


# ---- drain (event-driven) ---------------------------------------------------------------------------
def drain(hw: Hardware, m: ModelShape, lay: Layout, groups: list, spec: Spec,
          rates: list | None = None) -> tuple[float, list]:
    """One rank's rollout of groups [(prompt_len, [response lengths])], as engine/scheduler.py: a
    prefill whenever a waiting sequence fits (max_seqs), else a decode step over the running ones.
    Prefix caching: a group's later samples reuse the prompt's full KV blocks. Each step moves a row by
    1 (AR), `spec`'s expectation, or its own measured rate (`rates`, per group: [(tokens, query tokens)
    per forward] per sample). -> (seconds, [(start, seconds, B, "prefill" | "decode", drafting)])."""
    tp, max_seqs, bs = lay.tp, lay.max_seqs, lay.block_size
    cached = lambda p: min(bs * (p // bs), p - 1)       # prompt tokens a group's later samples reuse
    waiting = deque((p, L, j == 0, rates[g][j] if rates else None)
                    for g, (p, ls) in enumerate(groups) for j, L in enumerate(ls))
    rem, ctx, rate, t, steps = [], [], [], 0.0, []
    while waiting or rem:
        if waiting and len(rem) < max_seqs:
            new = [waiting.popleft() for _ in range(min(len(waiting), max_seqs - len(rem)))]
            # speculative prefill (engine/llm.py): a replayed row's drafts ride in its prefill too
            drafts = [(r[1] if r else spec.replay_q()) - 1.0 for *_, r in new]
            reused = [0 if first else cached(p) for p, _, first, _ in new]
            prompt = [p - c for (p, *_), c in zip(new, reused)]          # the prompt tokens it computes
            qs = [q + d for q, d in zip(prompt, drafts)]
            draft = spec.history_time(hw, sum(r[0] if r else 1.0 for *_, r in new))
            # the LM head at each prompt's last token and its drafts only (engine/llm.py `_prefill`)
            dt = (engine_step(hw, m, tp, qs, reused, sum(drafts) > 0, len(new) + sum(drafts)) + draft
                  + spec.head_prefill_time(hw, prompt, reused)
                  + spec.host_time(hw, len(new), 1, sum(drafts)))
            part = "prefill"
            rem += [L - (r[0] if r else 1.0) for _, L, _, r in new]
            ctx += [p + 1.0 for p, *_ in new]
            rate += [r for *_, r in new]
        else:
            B, C = len(rem), sum(ctx) / len(rem)
            if rates:                          # each row at its own measured rate
                qs, taus, v = [q for _, q in rate], [tau for tau, _ in rate], spec.on
                draft = spec.drafting_time(hw, B, C, 1.0, sum(taus))
            else:
                cost = lambda q, tau, v: (engine_step(hw, m, tp, q, ctx, v) + spec.drafting_time(hw, B, C, q, B * tau)
                                          + spec.host_time(hw, B, q, B * (q - 1)))
                qs, tau, v = spec.choose(cost)
                draft, taus = spec.drafting_time(hw, B, C, qs, B * tau), [tau] * B
            drafts = sum(q - 1 for q in qs) if rates else B * (qs - 1)
            dt = engine_step(hw, m, tp, qs, ctx, v) + draft + spec.host_time(hw, B, 1.0 if rates else qs, drafts)
            part, rem, ctx = "decode", [x - u for x, u in zip(rem, taus)], [c + u for c, u in zip(ctx, taus)]
        if not steps:      # the policy moved since the last rollout: a CPU engine repacks its linears
            dt += hw.repack_s_per_param * m.matmul_params      # (engine/cpu_linear.py), in this first step
        if spec.configured:
            dt += hw.spec_step_overhead_s
        steps.append((t, dt, len(rem), part, draft))
        t += dt
        keep = [i for i, x in enumerate(rem) if x > 1e-9]
        rem, ctx, rate = [rem[i] for i in keep], [ctx[i] for i in keep], [rate[i] for i in keep]
    return t, steps


# ---- traces ---------------------------------------------------------------------------------------------
TRACE_KEYS = ("response_lens", "prompt_rank", "seq_forwards", "generated_tokens", "verify_steps",
              "proposed_tokens", "accepted_tokens")


def check_step(r: dict, where: str, prompt_len: int | None, head_cap: int | None = None) -> dict:
    """A metrics line -> {groups per prompt, prompt lens, ranks, spec}; ValueError naming file and key."""
    for k in TRACE_KEYS + (() if prompt_len else ("prompt_lens",)):
        if k not in r:
            hint = " (or pass --prompt-len)" if k == "prompt_lens" else ""
            raise ValueError(f"{where}: step {r.get('step', '?')}: missing key {k!r}{hint}")
    P, lens = len(r["prompt_rank"]), r["response_lens"]
    if not P or len(lens) % P:
        raise ValueError(f"{where}: step {r.get('step')}: 'response_lens' ({len(lens)}) is not G per prompt of "
                         f"'prompt_rank' ({P})")
    G = len(lens) // P
    plens = r.get("prompt_lens") or [prompt_len] * P
    rates = None
    if isinstance(r.get("response_forwards"), list) and isinstance(r.get("response_drafted"), list):
        # each response's own rate over its target forwards (its prefill's included: drafts ride there
        # too), so it takes exactly its measured number of forwards: tokens and query tokens per forward
        rows = [(L / max(f, 1), 1 + d / max(f, 1))
                for L, f, d in zip(lens, r["response_forwards"], r["response_drafted"])]
        rates = [rows[i * G:(i + 1) * G] for i in range(P)]
    return dict(step=r.get("step"), groups=[(plens[i], lens[i * G:(i + 1) * G]) for i in range(P)],
                ranks=r["prompt_rank"], spec=spec_from_metrics(r, head_cap), rank_specs=rank_specs(r), rates=rates,
                measured=r)


def read_run(path: str, prompt_len: int | None) -> tuple[list[dict], dict]:
    """RUN_DIR (metrics.jsonl + config.yaml) or a bench JSON whose rows keep their `steps` ->
    ([(label, [step traces])]..., config dict)."""
    p = Path(path)
    if p.is_dir():
        f = p / "metrics.jsonl"
        if not f.is_file():
            raise ValueError(f"{f}: metrics file not found")
        import yaml
        cfg = yaml.safe_load((p / "config.yaml").read_text()) if (p / "config.yaml").is_file() else {}
        recs = [r for _, r in read_jsonl(f)]
        cap = (_head_spec(cfg) or {}).get("num_draft_tokens")
        return [(p.name, [check_step(r, str(f), prompt_len, cap) for r in recs])], cfg
    if not p.is_file():
        raise ValueError(f"--run: {path}: neither a run directory nor a bench JSON file")
    out = []
    for row in json.loads(p.read_text()).get("rows", []):
        if "steps" not in row:
            raise ValueError(f"{path}: row {row.get('name')!r}: missing key 'steps' (the bench's per-step metrics)")
        out.append((row["name"], [check_step(r, f"{path}: row {row['name']!r}", prompt_len) for r in row["steps"]]))
    return out, {}


def gsm8k_trace(path: str, prompts: int, G: int, steps: int, scale: float = 1.0) -> list[dict]:
    """GSM8K-like steps: questions as prompts, reference solutions (no calculator annotations) as
    responses, in word pieces (0.88x SmolLM2's BPE count); prompts in file order, G consecutive answers
    per group; `scale` stretches every response (reasoning models write longer than the references)."""
    piece = re.compile(r"\d|[A-Za-z]+|[^\sA-Za-z\d]")
    rows = [json.loads(ln) for ln in Path(path).read_text().splitlines() if ln.strip()]
    n = lambda s: len(piece.findall(s))
    ans = [round(scale * n(re.sub(r"<<[^>]*>>", "", r["answer"]))) + 1 for r in rows]      # + eos
    group = lambda i: (n(rows[i % len(rows)]["question"]), [ans[(i * G + j) % len(ans)] for j in range(G)])
    return [dict(step=s, groups=[group(s * prompts + i) for i in range(prompts)], ranks=None, spec=Spec(),
                 measured={}) for s in range(steps)]


# ---- one step, a run ---------------------------------------------------------------------------------------
def rank_of(st: dict, ranks: int) -> list[int]:
    """Each prompt's rank: the trace's where it ran on as many ranks, else a contiguous split."""
    P, own = len(st["groups"]), st["ranks"]
    return own if own and max(own) + 1 == ranks else [i * ranks // P for i in range(P)]


def rollout(hw, m, lay, st, ranks: int, spec: Spec) -> dict:
    """Every rank drains its prompts; the trace's own speculation is replayed per rank and per row."""
    where = rank_of(st, ranks)
    replay = where is st["ranks"] and spec is st["spec"]
    per_rank, rates = (st.get("rank_specs"), st.get("rates")) if replay else (None, None)
    if per_rank:       # per-rank counters merge the drafters: which drafters ran and the head's use are the step's
        per_rank = [replace(s, head=spec.head, head_use=spec.head_use, history=spec.history, asked=spec.asked)
                    for s in per_rank]
    runs = [drain(hw, m, lay, [g for g, r in zip(st["groups"], where) if r == k],
                  per_rank[k] if per_rank and k < len(per_rank) else spec,
                  [x for x, r in zip(rates, where) if r == k] if rates else None) for k in range(ranks)]
    busy = [t for t, _ in runs]
    return dict(busy=busy, time=max(busy), bubble=[max(busy) - b for b in busy], steps=[s for _, s in runs])


def simulate(trace: list[dict], hw: Hardware, m: ModelShape, lay: Layout, spec_mode: str,
             ref_model: bool = False) -> dict:
    """spec_mode: "ar" (every response decoded token by token) or "spec" (the trace's speculation).
    -> per-step sync timings and the sync / async per-step means."""
    sync, dp = [], lay.dp
    spec = lambda st: Spec() if spec_mode == "ar" else st["spec"]
    for st in trace:
        ro = rollout(hw, m, lay, st, dp, spec(st))
        share = [[(p, L) for (p, ls), r in zip(st["groups"], rank_of(st, dp)) if r == k for L in ls] for k in range(dp)]
        T = train_time(hw, m, share, ref_model) / lay.tp
        S = weight_sync_time(hw, m, colocated=True, shared=lay.shared_weights)
        H = head_train_time(hw, st["spec"].head, st, st["spec"].head_training) \
            if spec_mode == "spec" and st["spec"].head else 0.0
        part = lambda f: [sum(f(x) for x in steps) for steps in ro["steps"]]    # per rank
        sync.append(dict(step=st["step"], time_rollout=ro["time"], time_train=T, time_weight_sync=S,
                         time_head=H, time_step=ro["time"] + T + S + H, rank_busy_time=ro["busy"],
                         rank_bubble_time=ro["bubble"],
                         rank_time_prefill=part(lambda x: (x[1] - x[4]) * (x[3] == "prefill")),
                         rank_time_decode=part(lambda x: (x[1] - x[4]) * (x[3] == "decode")),
                         rank_time_propose=part(lambda x: x[4]),
                         rank_time_backward=train_compute(hw, m, share, ref_model)))
    keys = ("time_rollout", "time_train", "time_weight_sync", "time_head", "time_step")
    out = dict(sync=sync, sync_mean={k: _mean([s[k] for s in sync]) for k in keys})
    if dp > 1:
        out["async"] = min((async_pipeline(trace, hw, m, lay, g, spec, ref_model)
                            for g in ([lay.gen_dp] if lay.gen_dp else range(1, dp))), key=lambda a: a["time_step"])
    # async on the same ranks (grpo.max_staleness: 1): each device time-shares rollout t+1 with training
    # t, which removes the bubble, never work: max_r(busy_r(t+1) + T(t)) + S
    nxt = sync[1:] or sync
    shared = [max(b + s["time_train"] for b in n["rank_busy_time"]) + s["time_weight_sync"] + s["time_head"]
              for s, n in zip(sync, nxt)]
    out["async_shared"] = dict(out["sync_mean"], time_step=_mean(shared), gen_ranks=dp, train_ranks=dp)
    return out


def async_pipeline(trace, hw, m, lay, gen, spec, ref_model) -> dict:
    """`gen` ranks generate, dp - gen train. Rollout t+1 starts when rollout t ends and weights of step
    t-1 have arrived; training t starts when rollout t and training t-1 are done:
        roll_end[t] = max(roll_end[t-1], sync_end[t-2]) + R_t;  sync_end[t] = max(roll_end[t], sync_end[t-1]) + T_t + S
    Per-step time = the pace of sync_end in steady state: ~ max(R, T + S)."""
    S = weight_sync_time(hw, m, colocated=False)
    roll, done, R, T = [], [], [], []
    for t, st in enumerate(trace):
        R.append(rollout(hw, m, lay, st, gen, spec(st))["time"])
        all_seqs, n = [(p, L) for p, ls in st["groups"] for L in ls], lay.dp - gen
        T.append(train_time(hw, m, [all_seqs[k::n] for k in range(n)], ref_model) / lay.tp)
        roll.append(max(roll[-1] if roll else 0.0, done[t - 2] if t >= 2 else 0.0) + R[-1])
        done.append(max(roll[-1], done[-1] if done else 0.0) + T[-1] + S)
    pace = (done[-1] - done[0]) / (len(done) - 1) if len(done) > 1 else done[0]
    return dict(gen_ranks=gen, train_ranks=lay.dp - gen, time_rollout=_mean(R), time_train=_mean(T),
                time_weight_sync=S, time_step=pace)


def _mean(xs):
    xs = [x for x in xs if x is not None]
    return sum(xs) / len(xs) if xs else None


# ---- this machine, calibrated here (the CPU, or its GPU) ---------------------------------------------------------
CALIBRATIONS = 3    # fits per rank, medians taken per field
LIGHT_PARAMS = 20e6  # above this many parameters the calibration is sized down (`calibrate`, light)


def calibrated(cfg: dict, threads: int, where: str, ranks: int, device: str) -> Hardware:
    """This CPU (device="cuda": its GPU, the engine in bf16 with CUDA graphs) fitted by `calibrate` in
    `ranks` processes at once, as a run's ranks share caches and memory bandwidth; cached by shape,
    threads, ranks, machine and torch version. On a busy machine every time here doubles."""
    import multiprocessing
    import platform
    import torch
    from nanospec.models.hub import cache_dir
    info = Path("/proc/cpuinfo")
    names = [ln.split(":", 1)[1].strip() for ln in (info.read_text().splitlines() if info.is_file() else [])
             if ln.startswith("model name")]
    machine = torch.cuda.get_device_name(0) if device != "cpu" else (names or [platform.processor()])[0]
    key = json.dumps([cfg, threads, ranks, machine, os.cpu_count(), torch.__version__, 26]
                     + [device] * (device != "cpu"), sort_keys=True, default=str)
    path = cache_dir() / "profiles" / f"sim_{device}_{hashlib.sha256(key.encode()).hexdigest()[:16]}.json"
    if path.is_file():     # said, so a calibration taken on a busy box or another day is not trusted unseen
        age = (time.time() - path.stat().st_mtime) / 3600
        print(f"simulate: the calibration cached {age:.1f} h ago ({path}); delete it to calibrate again, "
              f"on an idle box", flush=True)
        return Hardware(**json.loads(path.read_text()))
    if os.getloadavg()[0] > 0.5:
        print(f"simulate: the box is busy (1-minute load {os.getloadavg()[0]:.1f}): the calibration will price "
              f"that contention", flush=True)
    # a real model costs ~30x the embedded ~4M model: one fit per rank, a smaller grid, shorter drains
    params = ModelShape.from_config(cfg, where, "float32").params
    light = params > LIGHT_PARAMS
    fits_per_rank = 1 if light else CALIBRATIONS
    print(f"simulate: calibrating {machine if device != 'cpu' else 'this CPU'} on a random "
          f"{params / 1e6:.0f}M-parameter model of this shape (the trainer on the checkpoint's weights if any) "
          f"({ranks} process(es) x {threads} thread(s), {fits_per_rank} fit(s) each; about "
          f"{'3 min' if light else '1 min'} on an idle 2-core box; cached in {path})", flush=True)
    ctx = multiprocessing.get_context("spawn")
    queue, barrier = ctx.Queue(), ctx.Barrier(ranks)
    store = path.with_suffix(f".store{os.getpid()}")       # the ranks' gloo group (CPU): their all-reduce is timed
    path.parent.mkdir(parents=True, exist_ok=True)         # (gloo waits forever for a store it cannot create)
    store.unlink(missing_ok=True)
    procs = [ctx.Process(target=_calibrate_rank,
                         args=(cfg, threads, where, barrier, queue, fits_per_rank, light, r, device, (store, ranks)))
             for r in range(ranks)]
    for p in procs:
        p.start()
    fits = [queue.get(timeout=1800) for _ in range(fits_per_rank * ranks)]
    for p in procs:
        p.join()
    store.unlink(missing_ok=True)
    med = statistics.median       # per field, over every rank's fits: one fit on this box is +-10%
    hw = Hardware(f"{device} x{ranks}", *(med([f[k] for f in fits]) for k in list(fits[0])[1:]))
    hw = replace(hw, overlap=bool(hw.overlap), padded=bool(hw.padded))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(asdict(hw)))
    return hw


def _calibrate_rank(cfg, threads, where, barrier, queue, fits: int, light: bool, rank: int, device: str,
                    group: tuple) -> None:
    import torch.distributed as dist
    store, ranks = group
    gloo = device == "cpu" and ranks > 1
    if gloo:
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=ranks)
    for i in range(fits):
        log = (lambda msg: print(f"simulate:   fit {i + 1}/{fits}: {msg}", flush=True)) if rank == 0 else None
        queue.put(asdict(calibrate(cfg, threads, where, barrier.wait, light, log, device)))
    if gloo:
        dist.destroy_process_group()


def calibrate(cfg: dict, threads: int, where: str, sync=lambda: None, light: bool = False, log=None,
              device: str = "cpu") -> Hardware:
    """Fit Hardware to this CPU (fp32, `threads` torch threads) or GPU (engine in bf16 with CUDA graphs,
    trainer in fp32, timings after a synchronize) with nanospec's own code on a random model of this
    shape, in phases: the roofline (then the CPU's repack, a draft head's host time), the engine's host
    time, the trainer (on the checkpoint's own weights where `where` has them); without a process group
    the interconnect is a tensor copy (ranks on one host exchange through its memory). light: a smaller
    grid, shorter drains, fewer steps (a real model); log: gets each phase's elapsed time."""
    import numpy as np
    import torch
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    gpu = device != "cpu"
    m = ModelShape.from_config(cfg, where, "bfloat16" if gpu else "float32")
    llm, args, maxlen = _calibration_engine(cfg, where, device)
    wait = torch.cuda.synchronize if gpu else (lambda: None)
    med = lambda f, n=3: float(np.median([f() for _ in range(n)]))
    t_start = time.perf_counter()
    done = (lambda phase: log(f"{phase} ({time.perf_counter() - t_start:.0f} s)")) if log else (lambda phase: None)
    prompt_range = (32, 96) if light else (6, 48)   # light: a CPU rank's prompts of a real model's GRPO
    hw = _fit_wide(llm, m, _fit_roofline(llm, m, maxlen, med, light, gpu, sync, done), light, prompt_range, done)
    if not gpu:
        hw = replace(hw, repack_s_per_param=repack_time(llm, med) / m.matmul_params)
    hw = replace(hw, **head_overhead(llm, m, hw, maxlen, med, 1 if light else 3))
    done("draft head's drafting timed")
    sync()
    hw = _fit_engine_overheads(llm, hw, m, args.vocab_size, light, prompt_range, done)
    llm.sleep()      # as a run's engine sleeps while its trainer steps (an awake one slows them: docs/results.md)
    del llm
    hw = _fit_trainer(hw, m, args, device, light, prompt_range, sync, wait, done, where)
    if torch.distributed.is_initialized():
        return hw                                            # its all-reduce was timed
    buf = torch.empty(m.params, dtype=torch.float32, device=device)

    def copy_time() -> float:
        wait()
        t0 = time.perf_counter()
        buf.clone()
        wait()
        return time.perf_counter() - t0
    return replace(hw, interconnect_bw=2 * buf.numel() * 4 / med(copy_time))   # a transfer costs 2n / bw


def _calibration_engine(cfg: dict, where: str, device: str) -> tuple:
    """-> (LLM, ModelArgs, max_model_len): a random model of this shape, the trainer's drafters and controller."""
    from nanospec.config import SpeculationConfig
    from nanospec.engine.llm import LLM
    from nanospec.models.decoder import CausalLM, ModelArgs
    gpu = device != "cpu"
    args = ModelArgs.from_hf(dict(cfg, model_type=cfg.get("model_type", "llama")), where)
    maxlen = min(args.max_position_embeddings, 256)
    llm = LLM(CausalLM(args).to(device).eval(), None, max_num_seqs=64, max_model_len=maxlen,
              controller=SpeculationConfig(),
              speculative=[{"method": "prior", "num_draft_tokens": 8}, {"method": "suffix", "num_draft_tokens": 8}],
              device=device, dtype="bfloat16" if gpu else "float32", use_cuda_graphs=gpu,
              num_kv_blocks=4 * 64 * maxlen // 16 if gpu else None)     # not half the GPU's memory
    return llm, args, maxlen


def _forward_time(hw: Hardware, m: ModelShape, B: float, C: float, Q: float) -> float:
    """The roofline of LLM.time_forward(B, C, Q): B rows of C cached tokens, Q new ones each (Q > 1 verifies)."""
    return engine_step(hw, m, 1, Q, [C] * B, Q > 1)


def _fit_relative(X, y, t):
    """Non-negative least squares of y ~ X in relative error (each row / its time t): cheap steps count alike."""
    import numpy as np
    from scipy.optimize import nnls
    return nnls(np.array(X) / np.array(t)[:, None], np.array(y) / np.array(t))[0]


def _fit_roofline(llm, m: ModelShape, maxlen: int, med, light: bool, gpu: bool, sync, done) -> Hardware:
    """Phase 1: LLM.time_forward over a (B, C, Q) grid -> flops, mem_bw, step, row and verify overheads
    (least squares on log time: every batch size counts alike; on CPU compute and memory add)."""
    import numpy as np
    from scipy.optimize import least_squares
    grid = ([(B, C, Q) for B in (1, 4, 16) for C in (16, maxlen // 2, maxlen * 3 // 4) for Q in (1, 5)] if light else
            [(B, C, Q) for B in (1, 4, 16, 64) for C in (16, 64, maxlen // 2) for Q in (1, 3, 9)])
    llm.time_forward(8, 16, 1)                                                         # warm-up
    sync()                                     # every calibrating process starts each phase together
    fwd = [(B, C, Q, med(lambda: llm.time_forward(B, C, Q), 1 if light else 3)) for B, C, Q in grid]
    done(f"{len(grid)} forward shapes timed")
    hw_of = lambda x: Hardware("cpu", *np.exp(x[:2]), 1.0, *np.exp(x[2:5]), overlap=gpu)
    x = least_squares(lambda x: [math.log(_forward_time(hw_of(x), m, B, C, Q) / t) for B, C, Q, t in fwd],
                      np.log([1e14 if gpu else 1e10, 1e12 if gpu else 1e10, 1e-3, 1e-5, 1e-4])).x
    return hw_of(x)


def _fit_wide(llm, m: ModelShape, hw: Hardware, light: bool, prompt_range: tuple, done) -> Hardware:
    """Phase 1b: a wide step (more than SMALL_Q query tokens a row: a prefill) runs SDPA over its padded
    batch and wide GEMMs, not the small-Q kernels the grid timed, whose FLOP/s do not carry over to it
    (docs/results.md). Its FLOP/s are timed on prefills of ragged prompts, as a rollout's (each a new shape,
    the LM head at each row's last token), beyond their memory traffic and host time as fitted (on a GPU,
    whose traffic overlaps: beyond its host time)."""
    import torch
    g = torch.Generator().manual_seed(11)
    lo, hi = prompt_range
    batches = [[int(lo * (hi / lo) ** float(torch.rand(1, generator=g))) for _ in range(B)]
               for B in ((8, 16) if light else (16, 32, 64)) for _ in range(2)]
    count = replace(hw, flops=1.0, flops_eff=1.0, mem_bw=math.inf, step_overhead_s=0.0, seq_overhead_s=0.0)
    rest = replace(hw, flops=math.inf, mem_bw=math.inf if hw.overlap else hw.mem_bw)
    rows = [(*(engine_step(machine, m, 1, lens, [0] * len(lens), head_tokens=len(lens)) for machine in (count, rest)),
             llm.time_forward(len(lens), 0, lens)) for lens in batches]
    per_flop, = _fit_relative([[f] for f, _, _ in rows], [t - r for _, r, t in rows], [t for *_, t in rows])
    done(f"{len(batches)} prefills timed")
    return replace(hw, wide_flops=1.0 / per_flop) if per_flop > 0 else hw


def repack_time(llm, med) -> float:
    """Seconds an in-place weight update adds to the next engine step on CPU: every PackedLinear
    rebuilds its oneDNN layout (SmolLM2's figure: docs/results.md, the real-model seed table)."""
    import torch
    step = lambda: llm.time_forward(1, 16, 1)

    def after_update() -> float:
        with torch.no_grad():
            for p in llm.model.parameters():
                p.mul_(1.0)                  # moves each weight's _version, as AdamW's in-place step does
        return step()
    return max(med(after_update) - med(step), 0.0)


def _drain_steps(llm, spec: bool, seed: int, vocab: int, light: bool, prompt_range: tuple) -> list:
    """A GRPO-like drain: 8 prompts x 8 greedy samples of log-uniform 4-128 tokens (light: 2 x 8): B shrinks
    and C grows as in a rollout, and each step's new shape pays oneDNN's kernel builds.
    -> its decode steps [(B, C, Q, seconds, propose() seconds, verified any draft, rows its drafter was asked for)]."""
    import torch
    from nanospec.engine.sequence import SamplingParams
    llm.speculate = spec
    g = torch.Generator().manual_seed(seed)
    rnd = lambda lo, hi: int(torch.randint(lo, hi, (1,), generator=g))
    for i in range(2 if light else 8):
        ids = torch.randint(3, vocab, (rnd(*prompt_range),), generator=g).tolist()
        for j in range(8):
            T = int(4 * 32 ** float(torch.rand(1, generator=g)))
            llm.add_request(ids, SamplingParams(temperature=0.0, max_tokens=T), 8 * i + j, ("cal", seed, i, j))
    out = []
    while llm.scheduler.has_work():
        rows, prefill = list(llm.scheduler.running), bool(llm.scheduler.waiting)
        before, verified, asked = llm.stats["generated_tokens"], llm.stats["verify_steps"], llm.stats["asked_rows"]
        drafting, t0 = llm.seconds["propose"], time.perf_counter()
        llm.step()
        if not prefill and rows:
            C = max(len(s) - 1 for s in rows)        # every row gathers the longest one's keys
            Q = (llm.stats["generated_tokens"] - before) / len(rows)   # all drafts accepted: Q = emitted
            out.append((len(rows), C, Q, time.perf_counter() - t0, llm.seconds["propose"] - drafting,
                        llm.stats["verify_steps"] > verified, llm.stats["asked_rows"] - asked))
    return out


def _fit_engine_overheads(llm, hw: Hardware, m: ModelShape, vocab: int, light: bool, prompt_range: tuple,
                          done) -> Hardware:
    """Phase 2: host time per step and per row beyond the forward (AR drains), drafting per emitted token,
    a declined step's extra (the rule's bookkeeping), a row's when the drafter is asked and finds nothing
    (the engine's clips and KV reservations), then a verify step's (drains whose drafts are all accepted)."""
    import gc
    from nanospec.drafters.base import Proposal
    drain_steps = lambda spec, seed: _drain_steps(llm, spec, seed, vocab, light, prompt_range)
    ar = [s for seed in ((1, 2) if light else (1, 2, 5, 6)) for s in drain_steps(False, seed)]
    a, b = _fit_relative([[1.0, B] for B, *_ in ar], [t - _forward_time(hw, m, B, C, 1) for B, C, _, t, *_ in ar],
                         [s[3] for s in ar])
    hw = replace(hw, step_overhead_s=hw.step_overhead_s + a, seq_overhead_s=hw.seq_overhead_s + b)
    done(f"{len(ar)} decode steps timed")
    spec_seeds = (3, 4)                            # light too: its short drains verify few steps each
    gc.collect()     # a full collection due now would land in one propose() (8x a light drain's time)
    drafting, tokens = llm.seconds["propose"], llm.stats["generated_tokens"]
    # the drafters meet new prompts and responses, as in a rollout: propose() is timed per token they emit
    # (walks, inserts), not fitted; the verify drains below replay these responses
    for seed in spec_seeds:
        drain_steps(True, seed)
    hw = replace(hw, draft_token_s=(llm.seconds["propose"] - drafting) / (llm.stats["generated_tokens"] - tokens))
    # a step the rule declines costs an AR step plus its budgets and the engine's bookkeeping, per step (the
    # rule decides such a step from the rows' largest and summed worth, not row by row: controller.py),
    # timed on drains where its threshold is out of reach (it declines all but its probes)
    threshold, llm.controller.min_speedup = llm.controller.min_speedup, 1e9
    declined = [s for seed in (7, 8) for s in drain_steps(True, seed) if not s[5] and not s[6]]
    llm.controller.min_speedup = threshold
    ver = [s for seed in spec_seeds for s in drain_steps(True, seed) if s[2] > 1]   # every draft accepted
    # last (its rule and drafter state are not the rollouts'), where the rule asks on every step a drafter
    # that finds nothing: the engine's own work per row asked
    propose, llm.controller.min_speedup = llm.drafter.propose, 1e-9
    llm.drafter.propose = lambda seqs, budgets: Proposal([[] for _ in seqs])
    asked = [s for s in drain_steps(True, 9) if s[6]]
    llm.drafter.propose, llm.controller.min_speedup = propose, threshold
    rest = lambda B, C, Q, t, p, asked_rows: (t - p - hw.spec_step_overhead_s - hw.asked_row_s * asked_rows
                                              - _forward_time(hw, m, B, C, Q))
    if len(declined) >= 2:
        d, = _fit_relative([[1.0] for _ in declined], [rest(B, C, 1, t, p, 0) for B, C, _, t, p, *_ in declined],
                           [s[3] for s in declined])
        hw = replace(hw, spec_step_overhead_s=d)
    if len(asked) >= 2:
        e, = _fit_relative([[n] for *_, n in asked], [rest(B, C, 1, t, p, 0) for B, C, _, t, p, *_ in asked],
                           [s[3] for s in asked])
        hw = replace(hw, asked_row_s=e)
    if len(ver) >= 2:       # the controller may draft on too few steps to fit (and nnls aborts on none)
        # the rest of a verify step beyond its forward, propose(), the rule's and the engine's bookkeeping
        # per step and per draft token: its drafts are all accepted at up to k = 8, a rollout's far fewer
        c, per_token = _fit_relative([[1.0, B * (Q - 1)] for B, C, Q, *_ in ver],
                                     [rest(B, C, Q, t, p, n) for B, C, Q, t, p, _, n in ver], [s[3] for s in ver])
        hw = replace(hw, verify_overhead_s=hw.verify_overhead_s + c, verify_token_s=per_token)
    done(f"{len(declined)} declined, {len(asked)} asked-for-nothing and {len(ver)} verify steps timed"
         + ("" if len(ver) >= 2 else ": too few verify steps, the forward grid's verify cost stands"))
    return hw


def _fit_trainer(hw: Hardware, m: ModelShape, args, device: str, light: bool, prompt_range: tuple, sync, wait,
                 done, where: str = "") -> Hardware:
    """Phase 3: trainer steps on the checkpoint's weights where `where` (its config.json) has them (a random
    init trains measurably slower on CPU: docs/results.md), timed apart: forward + backward -> train_mfu
    (the median step's, through the origin: a run's rank_time_prepare is ~0); clip + AdamW ->
    train_overhead_s beyond AdamW's modelled traffic; the gradient all-reduce over gloo
    (rl/dist.all_reduce_grads) -> interconnect_bw."""
    import torch
    from nanospec.models.decoder import CausalLM
    from nanospec.models.loader import load_model
    from nanospec.rl.dist import all_reduce_grads
    from nanospec.rl.grpo import completion_logprobs, make_microbatch, micro_batches
    from nanospec.rl.loss import policy_loss, tis_weights
    from nanospec.rl.rollout import Sample
    ckpt = Path(where).parent if where.endswith("config.json") else None
    policy = (load_model(ckpt, device=device) if ckpt and (ckpt / "model.safetensors").is_file()
              else CausalLM(args).to(device)).train()
    params = list(policy.parameters())
    opt = torch.optim.AdamW(params, lr=1e-6)

    def train_step(n: int, seed: int) -> tuple[list, float, float, float]:
        """n samples, 8 per prompt -> (lengths, forward + backward s, all-reduce s, clip + AdamW s)."""
        g = torch.Generator().manual_seed(seed)
        rnd = lambda lo, hi: int(torch.randint(lo, hi, (1,), generator=g))
        plen = [rnd(*prompt_range) for _ in range(n // 8)]
        lens = [(plen[i // 8], int(2 * 64 ** float(torch.rand(1, generator=g)))) for i in range(n)]
        samples = [Sample(None, i, [5] * p, [7] * L, [0.0] * L, [False] * L, "length") for i, (p, L) in enumerate(lens)]
        wait()
        t0 = time.perf_counter()
        for idx in micro_batches(samples, 1):     # Trainer.learn's loss: TIS weights, clipped surrogate
            mb = make_microbatch([samples[i] for i in idx], torch.randn(len(idx)), 0, device)
            logp = completion_logprobs(policy, mb, 1.0)[0]
            w, _ = tis_weights(logp.detach(), mb.behaviour_lp, mb.mask, 2.0)
            policy_loss(logp, logp.detach(), mb.adv, mb.mask, num_seqs_global=n, tis_weight=w)[0].backward()
        wait()
        t1 = time.perf_counter()
        sync()                                    # the all-reduce alone, not a slower rank's backward
        t2 = time.perf_counter()
        all_reduce_grads(params)
        t3 = time.perf_counter()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        wait()
        return lens, t1 - t0, t3 - t2, time.perf_counter() - t3
    sizes, seeds = ((8, 16), (1, 2)) if light else ((16, 32, 64), (1, 2, 3))
    train_step(sizes[-1], 0)     # untimed: a process's first steps run slower than a run's (docs/results.md)
    sync()
    base = replace(hw, train_mfu=1.0, train_overhead_s=0.0)
    steps = [train_step(n, seed) for n in sizes for seed in seeds]
    done(f"{len(steps)} trainer steps timed")
    flops = [train_compute(base, m, [lens], False)[0] for lens, *_ in steps]   # seconds at train_mfu 1
    inv = statistics.median(t / c for c, (_, t, _, _) in zip(flops, steps))   # one step alone is noisy
    adamw = update_time(hw, m.params, 1)[1]
    hw = replace(hw, train_mfu=1.0 / max(inv, 1e-12),
                 train_overhead_s=max(statistics.median(o for *_, o in steps) - adamw, 0.0))
    if torch.distributed.is_initialized():    # a ring all-reduce moves 2 (n-1)/n of the bytes each way
        n = torch.distributed.get_world_size()
        hw = replace(hw, interconnect_bw=2 * 2 * (n - 1) / n * 4 * m.params / statistics.median(a for _, _, a, _ in steps))
    return hw


def head_overhead(llm, m: ModelShape, hw: Hardware, maxlen: int, med, reps: int) -> dict:
    """A fresh draft head's drafting time beyond its roofline, per forward: HeadDrafter.propose of K
    tokens on B scratch rows of C cached tokens (the catch-up forward of the last accepted position, K - 1
    more, K draws at T=0.7 and the q [B, K, V] it hands to verify), at `make head`'s draft vocabulary of
    4,096, B in {1, 16}, C in {16, maxlen / 2}. The residual per forward, fitted as a + B (b + c C) by least
    squares, is its host time per forward, per row it drafts (the draw, q), per key a row reads (the KV
    gather of short rows, slower than the roofline's bandwidth)."""
    import warnings
    import numpy as np
    import torch
    from nanospec.drafters.base import DraftTarget
    from nanospec.drafters.head import head_drafter
    from nanospec.engine.sequence import SamplingParams, Sequence
    target = DraftTarget(llm.model, llm.vocab_size, llm.blocks.num_blocks, llm.blocks.block_size, llm.device)
    vocab, K = min(llm.vocab_size, 4096), 4
    wait = torch.cuda.synchronize if llm.device.type == "cuda" else (lambda: None)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")              # "freshly initialised": as intended
        head = head_drafter(target, draft_vocab=vocab)
    roof = replace(hw, step_overhead_s=0.0, seq_overhead_s=0.0, verify_overhead_s=0.0)

    def propose(B: int, C: int) -> float:
        seqs = [Sequence([1] * C, SamplingParams(temperature=0.7)) for _ in range(B)]
        try:
            if not all(llm.blocks.ensure(s, C + 1 + K) for s in seqs):
                raise RuntimeError(f"head_overhead: not enough free KV blocks for B={B}, C={C}")
            head.runner.zero_new_blocks(seqs)
            hidden = torch.randn(B, C, m.hidden, dtype=next(llm.model.parameters()).dtype, device=llm.device)
            head.prefill(seqs, [[1] * C] * B, [0] * B, hidden)     # the head has fed positions 0 .. C-2
            for s in seqs:
                s.token_ids.append(1)                              # a verify accepted position C-1's successor
            wait()
            t0 = time.perf_counter()
            head.propose(seqs, [K] * B)
            wait()
            return time.perf_counter() - t0
        finally:
            for s in seqs:
                llm.blocks.free(s)
                head.free(s)

    fits = []
    for B in (1, 16):
        for C in (16, maxlen // 2):
            propose(B, C)     # oneDNN builds kernels on a shape's first call: 25-30 ms here
            rest = med(lambda: propose(B, C), reps) / K - step_time(roof, m.draft_head(vocab), 1, B, B, B * C, B * C)
            fits.append(([1.0, B, B * C], rest))
    abc = np.linalg.lstsq(np.array([x for x, _ in fits]), np.array([r for _, r in fits]), rcond=None)[0]
    return {name: float(max(x, 0.0)) for name, x in zip(("draft_step_overhead_s", "draft_row_s", "draft_key_s"), abc)}


# ---- command line -----------------------------------------------------------------------------------------------
def _cfg(cfg: dict, *keys, default=None):
    for k in keys:
        cfg = cfg.get(k) if isinstance(cfg, dict) else None
    return default if cfg is None else cfg


def table(res: dict, modes: tuple, dp: int) -> list[dict]:
    """Rows sync / async (split) / async on the same ranks x AR / spec, seconds per step.
    rollout_speedup: rollout throughput per generating rank vs AR in the same mode (async AR and spec
    may split the ranks differently); step_speedup: vs sync AR."""
    rows, base = [], res["ar"]["sync_mean"]["time_step"]
    per_rank = lambda r: r["time_rollout"] * r.get("gen_ranks", dp)
    names = {"sync": {"sync_mean": "sync"}, "async": {"async": "async", "async_shared": "async, same ranks"}}
    for key, name in [kv for m in modes for kv in names[m].items()]:
        for kind in ("ar", "spec"):
            r, ar = res[kind].get(key), res["ar"].get(key)
            if r is not None:
                split = f"{r['gen_ranks']} gen / {r['train_ranks']} train" if key == "async" else "all ranks"
                rows.append(dict(mode=name, rollout=kind, time_rollout=r["time_rollout"],
                                 time_train_sync=r["time_train"] + r["time_weight_sync"], time_step=r["time_step"],
                                 rollout_speedup=per_rank(ar) / per_rank(r), step_speedup=base / r["time_step"],
                                 split=split))
    return rows


def print_rows(rows: list[dict], title: str) -> None:
    cols = list(dict.fromkeys(k for r in rows for k in r))
    fmt = lambda v: f"{v:.3f}" if isinstance(v, float) else str(v)
    w = [max(len(c), *(len(fmt(r.get(c, ""))) for r in rows)) for c in cols]
    print(f"\n== {title}\n" + "  ".join(c.ljust(x) for c, x in zip(cols, w)))
    for r in rows:
        print("  ".join(fmt(r.get(c, "")).ljust(x) for c, x in zip(cols, w)))


def validate(label: str, trace: list[dict], res: dict) -> list[dict]:
    """Predicted (the trace's own speculation replayed) vs measured, means over the steps. An
    off-policy run (`staleness` 1) time-shares each rank: only its step time compares."""
    out, off = [], any(st["measured"].get("staleness") for st in trace)
    add = lambda metric, meas, pred: out.append(dict(run=label, metric=metric, measured=meas, predicted=pred,
                                                     error_pct=100 * (pred - meas) / meas))
    for key in ("time_step",) if off else ("time_rollout", "time_train", "time_weight_sync", "time_head", "time_step"):
        meas = _mean([st["measured"].get("head/time" if key == "time_head" else key) for st in trace])
        if meas:
            add(key, meas, res["spec"]["async_shared" if off else "sync_mean"][key])
    # by part, mean over ranks (runs that recorded them): engine forwards (decode: verify and the step's
    # host work), drafting, the trainer's forward + backward; `other` has no predicted counterpart
    rank_mean = lambda r, k: _mean(r.get(k) or [None])

    def other(r):        # busy time outside the recorded parts (a part a run did not record counts 0)
        busy = rank_mean(r, "rank_busy_time")
        parts = (rank_mean(r, f"rank_time_{k}") for k in ("prefill", "decode", "propose"))
        return 0.0 if busy is None else busy - sum(t or 0.0 for t in parts)
    for key in ("prefill", "decode", "propose", "backward") if not off else ():
        meas = _mean([rank_mean(st["measured"], f"rank_time_{key}") for st in trace])
        if meas:
            if key == "decode":      # the simulator's decode step holds all of a step's host time
                meas += _mean([other(st["measured"]) for st in trace])
            add(f"rank {key}" + (" + host" if key == "decode" else ""), meas,
                _mean([rank_mean(s, f"rank_time_{key}") for s in res["spec"]["sync"]]))
    return out


def _head_spec(cfg: dict) -> dict | None:
    """The draft head's entry in a run's rollout.speculative, or None."""
    specs = _cfg(cfg, "rollout", "speculative") or []
    return next((d for d in (specs if isinstance(specs, list) else [specs]) if d.get("method") == "head"), None)


def run_head(cfg: dict, m: ModelShape) -> ModelShape | None:
    """The shape of the draft head a run's rollout.speculative names (its draft vocabulary from the
    head's config.json where it is saved), or None."""
    head = _head_spec(cfg)
    if head is None:
        return None
    saved = Path(head.get("model") or "", "config.json")
    vocab = json.loads(saved.read_text()).get("draft_vocab_size") if saved.is_file() else head.get("draft_vocab")
    return m.draft_head(vocab)


def _acceptance(text: str) -> float | tuple:
    values = tuple(float(x) for x in text.split(","))
    if not all(0.0 <= v <= 1.0 for v in values):
        raise argparse.ArgumentTypeError(f"{text!r}: expected numbers in [0, 1], comma-separated")
    return values[0] if len(values) == 1 else values


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m tools.simulate", description=__doc__.splitlines()[0])
    ap.add_argument("--run", help="RUN_DIR (metrics.jsonl, config.yaml) or a bench JSON whose rows keep 'steps'")
    ap.add_argument("--lengths", help="'gsm8k' or a GSM8K-format .jsonl: lengths of its reference solutions")
    ap.add_argument("--prompts", type=int, default=64, help="--lengths: prompts per step")
    ap.add_argument("--G", type=int, default=16, help="--lengths: samples per prompt")
    ap.add_argument("--steps", type=int, default=8, help="--lengths: steps")
    ap.add_argument("--length-scale", type=float, default=1.0, help="--lengths: stretch every response")
    ap.add_argument("--acceptance", type=_acceptance,
                    help="draft acceptance (0.4), or per draft position (0.8,0.6,0.5: each given the drafts "
                         "before it were accepted); spec rows draft the best k")
    ap.add_argument("--draft-len", type=int, default=8, help="largest k with --acceptance")
    ap.add_argument("--drafter", default="history", choices=("history", "head"),
                    help="--acceptance: history drafters (host time per token) or a draft head (its forwards)")
    ap.add_argument("--draft-vocab", type=int, help="--drafter head: its draft vocabulary (default: the model's)")
    ap.add_argument("--model", help=f"a preset ({', '.join(MODELS)}), a config.json, or any model train.py takes")
    ap.add_argument("--dtype", choices=("float32", "bfloat16", "float16"))
    ap.add_argument("--hardware", default="cpu", help=f"cpu or cuda (calibrated), {', '.join(PRESETS)} or a JSON file")
    ap.add_argument("--threads", type=int, help="cpu: torch threads per rank (default: the run's run.num_threads)")
    ap.add_argument("--dp", type=int, help="data-parallel ranks (default: the run's)")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--gen-dp", type=int, help="async: ranks that generate (default: the best split)")
    ap.add_argument("--max-seqs", type=int, help="sequences per engine (default: the run's, else 256)")
    ap.add_argument("--prompt-len", type=int, help="prompt tokens where the trace has no 'prompt_lens'")
    ap.add_argument("--skip", type=int, default=1, help="--run: leading warm-up steps left out")
    ap.add_argument("--mode", default="both", choices=("sync", "async", "both"))
    ap.add_argument("--out", help="write the results as JSON here")
    ap.add_argument("--plot", help="--run RUN_DIR: simulated vs measured timeline PNG")
    return ap


def _traces(a) -> tuple[list, dict]:
    """-> ([(label, trace)], the run's config): --run's steps less the warm-up, or --lengths' projected
    trace; --acceptance replaces every step's speculation."""
    if bool(a.run) == bool(a.lengths):
        raise ValueError("pass one of --run RUN_DIR|bench.json and --lengths gsm8k|FILE.jsonl")
    runs, cfg = read_run(a.run, a.prompt_len) if a.run else ([], {})
    runs = [(label, tr[a.skip:] if len(tr) > a.skip else tr) for label, tr in runs]
    if a.lengths:
        from nanospec.tasks.dataset import default_gsm8k_dir
        path = default_gsm8k_dir() / "train.jsonl" if a.lengths == "gsm8k" else Path(a.lengths)
        if a.acceptance is None:
            raise ValueError("--lengths needs --acceptance (the drafts' per-token acceptance)")
        runs = [(f"gsm8k x{a.prompts}x{a.G}" + (f", lengths x{a.length_scale:g}" if a.length_scale != 1 else ""),
                 gsm8k_trace(str(path), a.prompts, a.G, a.steps, a.length_scale))]
    if a.acceptance is not None:
        best = Spec(((1.0, a.draft_len, a.acceptance),), 1.0, a.draft_len, history=a.drafter == "history")
        runs = [(label, [dict(st, spec=best, rank_specs=None, rates=None) for st in tr]) for label, tr in runs]
    return runs, cfg


def _model_shape(a, cfg: dict, runs: list) -> tuple[ModelShape, dict, str, list]:
    """-> (the model's shape, its config, where that was read, runs whose steps price the draft head)."""
    spec_model = a.model or _cfg(cfg, "model", "path") or _cfg(cfg, "sft", "out_dir")
    if not spec_model:
        raise ValueError(f"{a.run}: no model to size: pass --model (a preset, config.json or model)")
    mcfg, where = load_model_config(spec_model)
    dtype = a.dtype or (_cfg(cfg, "rollout", "dtype") if a.run and not a.model else None)
    m = ModelShape.from_config(mcfg, where, dtype)
    head = run_head(cfg, m) if a.run else None     # a replayed run's head: its forwards priced
    if a.drafter == "head":
        if a.acceptance is None:
            raise ValueError("--drafter head needs --acceptance (the head's, per draft position)")
        head = m.draft_head(a.draft_vocab)
    if head is not None:
        mode = _cfg(cfg, "speculation", "head_training", default="step")
        runs = [(label, [dict(st, spec=replace(st["spec"], head=head, head_training=mode)) for st in tr])
                for label, tr in runs]
    return m, mcfg, where, runs


def _report_run(a, label: str, trace: list[dict], hw: Hardware, m: ModelShape, lay: Layout, ref: bool,
                modes: tuple, projecting: bool) -> dict:
    """One trace simulated AR and speculative: its tables printed (and plotted) -> its entry of the JSON."""
    res = {kind: simulate(trace, hw, m, lay, kind, ref) for kind in ("ar", "spec")}
    rows = table(res, modes, lay.dp)
    val = [] if projecting else validate(label, trace, res)
    lens = [L for st in trace for _, ls in st["groups"] for L in ls]
    print_rows(rows, f"{label}: {len(trace)} steps of {len(lens) // max(len(trace), 1)} responses "
                     f"(mean {sum(lens) / max(len(lens), 1):.0f} tokens), projected seconds per step")
    if val:
        print_rows(val, f"{label}: predicted (trace replayed) vs measured, mean per step")
    if a.plot and a.run and Path(a.run).is_dir():
        from tools.report import plot_sim_timeline
        print("wrote", plot_sim_timeline([st["measured"] for st in trace], res["spec"]["sync"], a.plot))
    return dict(label=label, table=rows, validation=val, simulated=res)


def main(argv: list[str] | None = None) -> int:
    a = _parser().parse_args(argv)
    try:
        runs, cfg = _traces(a)
        m, mcfg, where, runs = _model_shape(a, cfg, runs)
        first = runs[0][1][0]["measured"] if runs and runs[0][1] else {}
        ranks = len(first.get("rank_busy_time") or [0])          # the run's
        if a.hardware == "cuda":
            import torch
            if not torch.cuda.is_available():
                raise ValueError("--hardware cuda calibrates this machine's GPU: none is visible")
        if a.hardware == "cpu" and m.params > 2e9:
            raise ValueError(f"--hardware cpu calibrates on a model of {m.name}'s shape ({m.params / 1e9:.3g}B "
                             f"parameters in fp32): pass a GPU preset ({', '.join(PRESETS)}) or a hardware JSON")
        if a.hardware in ("cpu", "cuda"):
            hw = calibrated(mcfg, a.threads or _cfg(cfg, "run", "num_threads", default=1), where,
                            a.dp or ranks, a.hardware)
        else:
            hw = PRESETS.get(a.hardware) or Hardware(**json.loads(Path(a.hardware).read_text()))
        lay = Layout(a.dp or ranks, a.tp, a.gen_dp,
                     a.max_seqs or _cfg(cfg, "rollout", "max_num_seqs", default=64 if a.run else 256),
                     _cfg(cfg, "rollout", "block_size", default=16))
        ref = _cfg(cfg, "grpo", "beta", default=0.0) > 0
        # measured vs predicted only for a replay of the run as it ran: its machine (cpu, a hardware
        # JSON, or a GPU preset for a GPU run), its ranks and drafts
        on_gpu = str(_cfg(cfg, "rollout", "device", default="cpu")).startswith("cuda")
        projecting = ((a.hardware in PRESETS and not on_gpu) or lay.tp != 1 or a.acceptance is not None
                      or lay.dp != ranks)
        lay = replace(lay, shared_weights=bool(a.run) and not projecting and not a.dtype
                      and _cfg(cfg, "rollout", "dtype", default="float32") == "float32"
                      and not _cfg(cfg, "rollout", "use_cuda_graphs", default=False)
                      and not _cfg(cfg, "grpo", "max_staleness", default=0)
                      and _cfg(cfg, "run", "sharding", default="none") != "fsdp")
    except (ValueError, OSError, KeyError, json.JSONDecodeError) as e:
        print(f"simulate: error: {e}", file=sys.stderr)
        return 2
    modes = ("sync", "async") if a.mode == "both" else (a.mode,)
    print(f"model {m.name}: {m.params / 1e9:.3g}B params, {m.dtype_bytes}-byte weights, "
          f"{m.kv_bytes_per_token / 1024:.3g} KiB KV/token; hardware {hw.name}; dp {lay.dp} x tp {lay.tp}; "
          f"max {lay.max_seqs} seqs per engine")
    out = dict(model=asdict(m), hardware=asdict(hw), layout=asdict(lay), runs=[])
    if hw.name in DEVICE_BYTES:     # what fits on the device: KV for max_seqs of the trace's longest sequence
        ctx = max((pl + max(ls) for _, tr in runs for st in tr for pl, ls in st["groups"]), default=2048)
        out["memory"] = memory_rows(m, lay.dp * lay.tp, lay.max_seqs * int(ctx), DEVICE_BYTES[hw.name])
        print_rows(out["memory"], f"memory per rank, {lay.dp * lay.tp} ranks, KV for {lay.max_seqs} sequences of "
                                  f"{ctx:.0f} tokens, {DEVICE_BYTES[hw.name] / 1e9:.0f} GB per device")
    for label, trace in runs:
        out["runs"].append(_report_run(a, label, trace, hw, m, lay, ref, modes, projecting))
    if a.out:
        Path(a.out).write_text(json.dumps(out, indent=1))
        print("wrote", a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
