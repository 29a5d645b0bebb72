"""CUDA graphs for decode / verify steps, and KV-pool sizing from free GPU memory.

Why: at small batch a decode step is launch-bound. The decoder issues ~80 small kernels per layer
(norms, RoPE, paged-KV writes and gathers, attention, MLP), so a 24-layer model spends milliseconds
in Python and the CUDA launch path while the GPU idles. Capturing the forward once and replaying it
is one launch per step (as in vLLM / nano-vllm). Speculation makes this matter more: every verify
step is such a small launch-bound forward (`bench.py --suite gpu` measures it; docs/results.md).

How:
* Batch-size buckets 1, 2, 4, ... up to max_num_seqs (max_num_seqs itself is the last bucket). A step
  with B sequences replays the graph of the smallest bucket >= B; rows B.. are padding: token 0 at
  position 0, written to the null block and reading only null-block keys (paged_attention.PagedKV), so padding
  never touches a real sequence's KV.
* One graph per (bucket, Q), Q = new tokens per sequence: 1 for decode, k+1 for a verify with k drafts
  (ragged rows pad to Q like Runner). `capture(qs)` captures each Q for every bucket, largest first,
  into one shared memory pool (smaller graphs reuse the largest one's scratch; replays never
  overlap). LLM captures every Q <= max_q at start-up, as vLLM does: a capture inside a step stalls it
  (a forward per bucket, and the capture itself) and the controller's latency model would learn that
  stall as the price of a verify. A Q not captured yet is captured at its first step. Weights change by
  in-place copy (LLM.load_weights) and every input goes through the static buffers below, so graphs
  are only recaptured when the KV cache is re-allocated (`sleep` / `wake_up`, before the next step).
* Static inputs, per Q: one int64 tensor [bmax, 3Q + nb] = token ids | positions | slot mapping |
  block table, filled by one host->device copy per step. Key slots [b, C] are computed inside the
  graph from the block table, C = nb * block_size = max_model_len rounded up to the block size. The
  attention masks every key beyond the query's position, so a static C is exact: the extra keys get
  weight exp(-inf) = 0.
* Everything else runs Runner.forward eagerly: prefill chunks (Q > max_q), B > the largest bucket.
* A draft head (`features=True`, drafters/head.py) reads one feature vector per token beside its id:
  one more static buffer per Q, [bmax, Q, D], that each step's features are padded into. The head's
  drafting steps are one-token forwards of a single layer, all launch overhead on a GPU: graphs matter
  for it more than for the target.

`emulate=True` (CPU tests, no CUDA): the same buffers, padding and captured closures, "replayed" by
calling the closure, so bucket choice, padding and static-buffer bookkeeping are testable anywhere.
"""
from __future__ import annotations

import bisect

import torch
from torch.nn.utils.rnn import pad_sequence

from nanospec.engine.paged_attention import PagedKV
from nanospec.engine.runner import Runner
from nanospec.models.decoder import CausalLM
from nanospec.engine.sequence import Sequence


def batch_buckets(max_num_seqs: int) -> list[int]:
    """[1, 2, 4, ..., max_num_seqs] (powers of two below it, then max_num_seqs itself)."""
    if isinstance(max_num_seqs, bool) or not isinstance(max_num_seqs, int) or max_num_seqs < 1:
        raise ValueError(f"max_num_seqs must be an int >= 1, got {max_num_seqs!r}")
    out = [1]
    while out[-1] * 2 < max_num_seqs:
        out.append(out[-1] * 2)
    return out + [max_num_seqs] if out[-1] != max_num_seqs else out


def kv_block_bytes(model: CausalLM, block_size: int) -> int:
    """Bytes of one KV block over all layers: 2 (K and V) * layers * block_size * n_kv * head_dim * elem."""
    a, p = model.args, model.model.embed_tokens.weight
    return 2 * a.num_layers * block_size * a.num_kv_heads * a.head_dim * p.element_size()


def kv_blocks_for_memory(model: CausalLM, block_size: int, gpu_memory_utilization: float) -> int:
    """How many KV blocks fit in `utilization * total GPU memory - memory already in use`.

    Call after the weights are on the GPU, so that they count as in use. Activations and graph pools
    are not reserved: leave them the rest of the memory (utilization < 1).
    """
    dev = model.model.embed_tokens.weight.device
    if dev.type != "cuda" or not torch.cuda.is_available():
        raise RuntimeError(f"kv_blocks_for_memory needs a model on CUDA, got device {dev}")
    if not isinstance(gpu_memory_utilization, (int, float)) or not 0 < gpu_memory_utilization <= 1:
        raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization!r}")
    free, total = torch.cuda.mem_get_info(dev)
    budget = gpu_memory_utilization * total - (total - free)
    n = int(budget // kv_block_bytes(model, block_size))
    if n < 1:
        raise RuntimeError(f"gpu_memory_utilization={gpu_memory_utilization}: {(total - free) / 2**30:.1f} GiB "
                           f"of {total / 2**30:.1f} GiB already in use, no room for KV blocks; raise it")
    return n


def captured_runner(model: CausalLM, *, num_blocks: int, block_size: int, max_num_seqs: int, max_model_len: int,
                    max_q: int, features: bool = False) -> "GraphRunner":
    """A GraphRunner with every width Q <= max_q captured now: the engine's, and a draft head's
    (features=True, through DraftTarget.graph_runner) over the same geometry."""
    r = GraphRunner(model, num_blocks, block_size, max_num_seqs, max_model_len, max_q=max_q, features=features)
    r.capture(range(1, max_q + 1))
    return r


class GraphRunner(Runner):
    """Runner whose decode/verify forwards replay CUDA graphs; same API (forward/prepare/cache/device)."""

    def __init__(self, model: CausalLM, num_blocks: int, block_size: int, max_num_seqs: int,
                 max_model_len: int, *, max_q: int = 8, emulate: bool = False, features: bool = False):
        dev = next(model.parameters()).device
        if dev.type != "cuda" and not emulate:
            raise RuntimeError(f"use_cuda_graphs=True needs CUDA: the model is on {dev} (torch.cuda.is_available()"
                               f"={torch.cuda.is_available()}); use device='cuda' or use_cuda_graphs=False")
        if max_q < 1 or max_model_len < 1:
            raise ValueError(f"max_q and max_model_len must be >= 1, got {max_q}, {max_model_len}")
        super().__init__(model, num_blocks, block_size)
        self.emulate = emulate
        self.buckets = batch_buckets(max_num_seqs)
        self.max_q = max_q
        self.nb = -(-max_model_len // block_size)       # block-table width; C = nb * block_size keys
        self.bufs: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}   # Q -> (inputs [bmax, 3Q+nb], out)
        self.features = features
        self.feats: dict[int, torch.Tensor] = {}           # Q -> features [bmax, Q, D] (a draft head's)
        self.graphs: dict[tuple[int, int], tuple] = {}     # (bucket, Q) -> (CUDAGraph | None if emulated, closure)
        self.pool = None
        self._asleep_qs: list[int] = []                   # the Qs captured before sleep, for wake_up
        self.num_captures = 0
        self.num_replays = 0
        self.num_eager = 0

    def sleep(self) -> None:
        super().sleep()
        self._asleep_qs = sorted(self.bufs)
        self.graphs.clear()      # captured against the freed cache: recaptured by wake_up
        self.bufs.clear()
        self.feats.clear()

    def wake_up(self) -> None:
        super().wake_up()
        self.capture(self._asleep_qs)        # the same widths as before, on the new cache
        self._asleep_qs = []

    def bucket_for(self, batch: int) -> int | None:
        """Smallest bucket >= batch, or None if the batch is larger than every bucket."""
        i = bisect.bisect_left(self.buckets, batch)
        return self.buckets[i] if i < len(self.buckets) else None

    def pad_row(self, Q: int) -> list[int]:
        """A padding row: token 0 at position 0 writing to the null slot; block table all null."""
        null = self.null_block
        return [0] * (2 * Q) + [null * self.block_size] * Q + [null] * self.nb

    # ---- capture --------------------------------------------------------------------------------
    def _closure(self, b: int, Q: int):
        """The forward of bucket b over the static buffers of Q: what gets captured (or, emulated, called)."""
        inp, out = self.bufs[Q]
        ids, pos, slots, table = inp[:b].split([Q, Q, Q, self.nb], dim=1)
        offs = torch.arange(self.block_size, device=self.device)
        out_b, model, cache, bs = out[:b], self.model, self.cache, self.block_size
        feats = self.feats[Q][:b].flatten(0, 1) if self.features else None      # [b Q, D]

        def run():
            keys = (table[:, :, None] * bs + offs).flatten(1)                 # [b, C] key slots
            out_b.copy_(model(ids, pos, PagedKV(cache, slots, keys), feats))
        return run

    @torch.inference_mode()
    def capture(self, qs) -> None:
        """Capture every bucket for each Q in qs (largest bucket first, one shared pool); skips captured Q."""
        for Q in qs:
            if not 1 <= Q <= self.max_q:
                raise ValueError(f"capture: Q must be in [1, max_q={self.max_q}], got {Q}")
            if Q in self.bufs:
                continue
            a, bmax = self.model.args, self.buckets[-1]
            inp = torch.tensor([self.pad_row(Q)] * bmax, dtype=torch.long, device=self.device)
            out = torch.zeros(bmax, Q, a.hidden_size, dtype=self.cache.dtype, device=self.device)
            self.bufs[Q] = (inp, out)
            if self.features:
                self.feats[Q] = torch.zeros_like(out)
            for b in reversed(self.buckets):
                # inputs are all padding here, so the warm-up run only writes to the null block
                run, g = self._closure(b, Q), None
                if not self.emulate:
                    run()                                  # warm-up: lazy inits, cuBLAS handles
                    torch.cuda.synchronize(self.device)
                    if self.pool is None:
                        self.pool = torch.cuda.graph_pool_handle()
                    g = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(g, pool=self.pool):
                        run()
                # keep `run` alive: the graph reads the addresses of every tensor the closure holds
                self.graphs[b, Q] = (g, run)
                self.num_captures += 1

    # ---- step -----------------------------------------------------------------------------------
    def host_inputs(self, seqs: list[Sequence], tokens: list[list[int]], starts: list[int], b: int,
                    Q: int) -> torch.Tensor:
        """[b, 3Q + nb] int64 on the host: ids | positions | slots | block table; rows >= B are padding."""
        rows = self.host_rows(seqs, tokens, starts, Q, self.nb) + [self.pad_row(Q)] * (b - len(seqs))
        return torch.tensor(rows, dtype=torch.long)

    @torch.inference_mode()
    def forward(self, seqs: list[Sequence], tokens: list[list[int]], starts: list[int],
                features: torch.Tensor | None = None) -> torch.Tensor:
        """-> hidden [B, Q, D] (a view of the static output buffer: read it before the next step).
        features: [N, D] per real token in row order (a draft head's runner only; without them, as
        LLM.time_forward profiles it, the head reads whatever the buffer last held)."""
        B, Q = len(seqs), max(len(t) for t in tokens)
        b = self.bucket_for(B)
        if b is None or Q > self.max_q or any(len(s.block_table) > self.nb for s in seqs):
            self.num_eager += 1
            return super().forward(seqs, tokens, starts, features)
        if features is not None and not self.features:
            raise ValueError("GraphRunner.forward: features given, but this runner was captured without them")
        if Q not in self.bufs:
            self.capture([Q])
        inp, out = self.bufs[Q]
        self.zero_new_blocks(seqs)
        inp[:b].copy_(self.host_inputs(seqs, tokens, starts, b, Q))   # the one H2D copy
        if features is not None:     # ragged rows padded to Q (what pads them is never read back)
            self.feats[Q][:B].copy_(pad_sequence(features.split([len(t) for t in tokens]), batch_first=True))
        g, run = self.graphs[b, Q]
        run() if g is None else g.replay()
        self.num_replays += 1
        return out[:B]
