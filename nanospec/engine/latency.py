"""The cost model behind every speculation decision: seconds of one target step at (B, C, Q).

Measured, not assumed (EfficientRollout's system-aware toggle): a short profile of this engine on this
machine at start-up, cached on disk, then refitted online from every step the engine times.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import statistics
from collections import deque
from pathlib import Path
from typing import Callable, Sequence

import numpy as np
from scipy.optimize import nnls

from nanospec.config import check, is_int


class LatencyModel:
    """Seconds of one batched target step: t(B, C, Q) = w . [1, B, B*Q, B*C, B*Q*C, [Q > 1]].

    B = sequences in the step, C = mean cached context per sequence, Q = query tokens per sequence
    (1 = plain decode, k+1 = verify). One feature per cost a decoder step pays:
      1      fixed per-step overhead (Python, kernel launches; dominates at batch 1 on CPU)
      B      per-sequence work (sampling, cache indexing)
      B*Q    token-proportional matmuls (projections + MLP over B*Q rows)
      B*C    reading each sequence's KV cache once (memory traffic, independent of Q)
      B*Q*C  attention: every query token against every cached key
      [Q>1]  a verify step's fixed extra: packing a ragged batch, the rejection sampler's residuals.
             A step with one draft token pays it in full, so a lone likely draft may not pay.
    Fit: nonnegative least squares on *relative* error (each row divided by its time). Nonnegative
    weights on nondecreasing features keep t monotone in B, C and Q, so noise never makes a longer
    verify look cheaper; relative error keeps the fast small-batch steps, where the toggle's call
    matters most (the rollout's tail), as accurate as the slow large-batch ones.
    Online: `observe` keeps the `fit` samples as anchors (they cover Q > 1 even while the toggle is
    off and only decodes are timed) plus a bounded deque of recent samples; refit every `refit_every`.
    """

    def __init__(self, coef: Sequence[float] | None = None, min_seconds: float = 1e-6,
                 buffer: int = 256, refit_every: int = 16):
        check(min_seconds > 0, "min_seconds", "> 0", min_seconds)
        check(is_int(buffer) and buffer >= 1, "buffer", "an int >= 1", buffer)
        check(is_int(refit_every) and refit_every >= 1, "refit_every", "an int >= 1", refit_every)
        if coef is not None:
            coef = np.asarray(coef, dtype=float)
            check(coef.shape == (6,) and bool(np.all(coef >= 0)), "coef", "6 nonnegative floats", coef)
        self.min_seconds, self.refit_every = min_seconds, refit_every
        self._set(coef)
        self.anchors: list[tuple] = []
        self.recent: deque = deque(maxlen=buffer)
        self._since_fit = 0

    @staticmethod
    def features(B, C, Q) -> np.ndarray:
        """[1, B, B*Q, B*C, B*Q*C, Q>1]: [6] for one (B, C, Q), [6, n] for arrays of n samples."""
        B, C, Q = (np.asarray(v, dtype=float) for v in (B, C, Q))
        return np.stack([np.ones_like(B), B, B * Q, B * C, B * Q * C, (Q > 1).astype(float)])

    @staticmethod
    def _sample(s) -> tuple:
        check(len(s) == 4, "sample", "(B, C, Q, seconds)", s)
        B, C, Q, t = s
        check(B >= 1 and C >= 0 and Q >= 1, "sample", "B >= 1, C >= 0, Q >= 1", s)
        check(math.isfinite(t) and t > 0, "sample seconds", "a finite time > 0", t)
        return float(B), float(C), float(Q), float(t)

    def fit(self, samples: Sequence[tuple]) -> "LatencyModel":
        check(len(samples) > 0, "samples", "a non-empty list of (B, C, Q, seconds)", samples)
        self.anchors = [self._sample(s) for s in samples]
        self._refit()
        return self

    def _refit(self) -> None:
        rows = np.array(self.anchors + list(self.recent))                # [n, 4]: B, C, Q, seconds
        X, y = self.features(rows[:, 0], rows[:, 1], rows[:, 2]).T, rows[:, 3]
        X = X / y[:, None]                                 # minimise sum(((pred - t) / t)^2)
        scale = np.linalg.norm(X, axis=0)
        scale[scale == 0] = 1.0                            # e.g. all C == 0: that weight stays 0
        w, _ = nnls(X / scale, np.ones(len(rows)))         # column scaling: B*Q*C ~ 1e6 vs 1
        self._set(w / scale)
        self._since_fit = 0

    def _set(self, coef) -> None:
        self.coef = coef
        self._w = None if coef is None else tuple(map(float, coef))   # plain floats: predict is hot

    def predict(self, B: float, C: float, Q: float) -> float:
        """w . features(B, C, Q), in Python floats (~1 us; the toggle calls it ~2*k times per step)."""
        if self._w is None:
            raise RuntimeError("LatencyModel.predict: not fitted; call fit() or calibrate() first")
        w1, wB, wBQ, wBC, wBQC, wV = self._w
        return max(w1 + B * (wB + Q * wBQ + C * wBC + Q * C * wBQC) + (wV if Q > 1 else 0.0), self.min_seconds)

    def token_cost(self, C: float) -> float:
        """Seconds one more verified token adds to a packed step at context C (d t / d(B*Q))."""
        return self._w[2] + C * self._w[4]

    @property
    def verify_overhead(self) -> float:
        """Seconds a step pays once when it verifies any draft at all (the [Q > 1] weight)."""
        return self._w[5]

    def observe(self, B: float, C: float, Q: float, seconds: float) -> None:
        self.recent.append(self._sample((B, C, Q, seconds)))
        self._since_fit += 1
        if self._since_fit >= self.refit_every:
            self._refit()

    def calibrate(self, time_fn: Callable[[int, int, int], float], shapes: Sequence[tuple[int, int, int]],
                  repeats: int = 3) -> list:
        """Time every (B, C, Q) shape `repeats` times, fit on the medians (robust to warm-up and the
        ±10% run-to-run noise), return the samples."""
        check(is_int(repeats) and repeats >= 1, "repeats", "an int >= 1", repeats)
        check(len(shapes) > 0, "shapes", "a non-empty list of (B, C, Q)", shapes)
        samples = [(B, C, Q, statistics.median(float(time_fn(B, C, Q)) for _ in range(repeats)))
                   for B, C, Q in shapes]
        self.fit(samples)
        return samples


def profile_shapes(max_seqs: int, max_model_len: int, free_blocks: int, block_size: int,
                   query_lens: Sequence[int]) -> list[tuple[int, int, int]]:
    """The (B, C, Q) shapes the start-up profile times, cut to the KV pool it is given.

    The full grid is B in {1, 8, 32} (<= max_num_seqs) x two contexts x `query_lens`. A shape is timed
    only where its B sequences of C + Q tokens fit the free blocks; a batch size whose contexts do not
    fit is timed at the longest context that does, and one that cannot hold even a query is skipped
    (the engine can never run it either). The fit covers the rest, so a small pool (a tight
    `kv_cache_gib`, a long `max_model_len`) profiles what it can instead of failing."""
    ctx = min(64, max_model_len // 2)
    shapes = []
    for B in (b for b in (1, 8, 32) if b <= max_seqs):
        room = free_blocks // B * block_size                  # tokens each of B sequences can hold
        qs = [q for q in query_lens if q <= room]
        if not qs:
            continue
        ctxs = [c for c in (ctx // 2, ctx) if c + max(qs) <= room] or [room - max(qs)]
        shapes += [(B, C, Q) for C in ctxs for Q in qs]
    return shapes


def profiled_latency(llm, drafter=None, query_lens=(1, 4, 8)) -> LatencyModel:
    """A LatencyModel fitted to a short profile of the target's (or a model drafter's) forward on this
    machine (EfficientRollout: the toggle's cost model is measured, not assumed). The profile is cached
    on disk per model shape, dtype, device, threads and torch version (`profile_cache_path`), so a
    second engine on the same machine starts without profiling; online samples refit it as it runs."""
    shapes = profile_shapes(llm.scheduler.max_num_seqs, llm.max_model_len, llm.num_free_blocks,
                            llm.blocks.block_size, query_lens)
    path = profile_cache_path(llm.model if drafter is None else drafter.model, llm.device, shapes)
    latency, time_fn = LatencyModel(), lambda B, C, Q: llm.time_forward(B, C, Q, drafter=drafter)
    if path.is_file():
        try:
            latency.fit([tuple(r) for r in json.loads(path.read_text())["samples"]])
        except (ValueError, KeyError, TypeError, json.JSONDecodeError):
            latency = LatencyModel()    # a damaged cache entry is simply profiled again
        if latency.coef is not None and still_holds(latency, time_fn, shapes):
            return latency
    samples = latency.calibrate(time_fn, shapes, repeats=3)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps({"samples": samples}))
    os.replace(tmp, path)            # atomic: a concurrent rank reads the old file or the new one
    return latency


def still_holds(latency: LatencyModel, time_fn, shapes, tolerance: float = 1.3) -> bool:
    """Does a cached profile still price this machine as it is now? Times the smallest decode and the
    largest decode and verify of the grid (median of 3) against its predictions. A profile taken under
    another load (another job on the box, another clock) is off by a factor at every shape; trusted,
    it would make every later drafting choice on wrong prices, so it is profiled again."""
    decode = [s for s in shapes if s[2] == 1]
    probe = {min(decode), max(decode), max(shapes)} if decode else {max(shapes)}
    for B, C, Q in probe:
        t = statistics.median(float(time_fn(B, C, Q)) for _ in range(3))
        if not 1 / tolerance <= t / latency.predict(B, C, Q) <= tolerance:
            return False
    return True


def replayed_profile(path, draft: bool = False) -> tuple[LatencyModel, LatencyModel | None, float]:
    """`speculation.latency_profile`: the controller's cost models read from a file, in place of this
    run's profile and clock, so that its choices (and so the drafts, and the uniforms each row draws)
    are a function of the tokens alone, and a run repeats exactly. -> (target, model drafter, seconds
    of a history drafter's propose() per sequence). The file is a profile-cache entry, or that plus:
        {"samples": [[B, C, Q, seconds], ...],          target steps (the cache's format)
         "draft_samples": [[B, C, 1, seconds], ...],    one forward of a model drafter (needed with one)
         "draft_seconds_per_seq": 0.0}                  a history drafter's propose() (default 0)"""
    try:
        data = json.loads(Path(path).read_text())
        target = LatencyModel().fit([tuple(r) for r in data["samples"]])
        drafter = LatencyModel().fit([tuple(r) for r in data["draft_samples"]]) if draft else None
        per_seq = float(data.get("draft_seconds_per_seq", 0.0))
    except (OSError, json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
        want = '"samples" and, with a model drafter, "draft_samples"' if draft else '"samples"'
        raise ValueError(f"speculation.latency_profile: {path}: expected a JSON object with {want}: "
                         f"lists of [B, C, Q, seconds] ({type(e).__name__}: {e})") from None
    return target, drafter, per_seq


def profile_cache_path(model, device, shapes: list):
    """$NANOSPEC_CACHE/profiles/<hash>.json, keyed by everything the timings depend on but the weights."""
    import platform
    import torch
    from nanospec.models.hub import cache_dir
    if device.type == "cuda":
        dev = torch.cuda.get_device_name(device)
    else:      # the CPU model where Linux names it (platform.processor() is often empty there)
        cpuinfo = Path("/proc/cpuinfo")
        names = [ln.split(":", 1)[1].strip() for ln in (cpuinfo.read_text().splitlines() if cpuinfo.is_file() else [])
                 if ln.startswith("model name")]
        dev = f"{names[0] if names else platform.processor() or platform.machine()} x{os.cpu_count()}"
    layers = sorted({type(m).__name__ for m in model.modules()})
    key = json.dumps([repr(model.args), str(next(model.parameters()).dtype), dev, torch.get_num_threads(),
                      torch.__version__, layers, shapes], sort_keys=True)
    return cache_dir() / "profiles" / f"{hashlib.sha256(key.encode()).hexdigest()[:16]}.json"
