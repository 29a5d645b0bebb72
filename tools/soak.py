"""Soak: GRPO with random faults for as long as asked; reports the faults, what survived them, and the
data lost, which must be none.

    python -m tools.soak --minutes 20 [--seed 0] [--out runs/soak]

Rounds alternate at random between:
  kill    a 2-rank torchrun of the embedded default (4 GRPO steps, a checkpoint every 2, every policy on,
          repeatable as in tests/test_faults.py) SIGKILLed 1-3 times at random points (tools/faults.py),
          resumed until it finishes. Lost: a complete checkpoint gone before a newer one exists, or a
          metric or the final weights differing from an uninterrupted reference run.
  flood   random requests (greedy and seeded, n up to 4, random aborts, speculation on) through an LLM
          whose KV pool holds about three of the longest sequences (preemption, KV exhaustion). Lost: a
          request neither finished nor aborted, a leaked KV block, a greedy row differing from the same
          request on a large pool.
Exits 1 if anything was lost.
"""
from __future__ import annotations

import argparse
import hashlib
import itertools
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

from nanospec.config import read_jsonl

ROOT = Path(__file__).resolve().parents[1]
RUN = ["--config", "configs/default.yaml", "--sft.steps=150", "--sft.batch_size=16", "--grpo.num_steps=4",
       "--grpo.prompts_per_step=4", "--grpo.num_generations=4", "--task.num_test=8", "--task.num_train=64",
       "--run.save_every=2", "--speculation.bubble_token_budget=64"]
TIMED = ("time", "rank_busy", "rank_bubble_time", "rank_bubble_draft_time", "rank_train", "rank_rollout",
         "tokens_per_s", "rollout_imbalance", "rss", "bubble_recovered_frac")   # keys that measure time


def untimed(rec: dict) -> dict:
    return {k: v for k, v in rec.items() if not any(t in k for t in TIMED)}


def write_profile(path: Path) -> None:
    """A fixed cost model in the profile-cache format (engine/latency.py), t = a + b*B + c*B*Q + d*B*C
    (+ a verify overhead), under which the embedded model's drafts pay: the drafters' state (what a
    resume must restore) is exercised. This machine's measured profile would turn most drafting off."""
    grid = list(itertools.product((1, 8, 32), (32, 64), (1, 4, 8)))
    samples = [[B, C, Q, 2e-3 + 5e-5 * B + 2e-5 * B * Q + 1e-7 * B * C + 5e-4 * (Q > 1)] for B, C, Q in grid]
    heads = [[B, C, 1, 3e-4 + 1e-5 * B + 1e-8 * B * C] for B, C, _ in grid]     # a draft head's forward
    path.write_text(json.dumps({"samples": samples, "draft_samples": heads, "draft_seconds_per_seq": 5e-5}))


class Soak:
    def __init__(self, out: Path, seed: int):
        self.out, self.rng = out, random.Random(seed)
        self.injected, self.survived, self.lost = [], [], []

    # ---- kill rounds -------------------------------------------------------------------------------
    def train(self, run: Path, *extra, fault: str = "") -> int:
        profile = self.out / "profile.json"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
               *(["-m", "tools.faults"] if fault else []), "train.py",
               *RUN, f"--run.out_dir={run}", f"--sft.out_dir={self.out / 'sft'}", *extra,
               *([f"--speculation.latency_profile={profile}"] if profile.is_file() else [])]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "NANOSPEC_FAULT": fault}
        with open(run.parent / f"{run.name}.log", "a") as log:
            return subprocess.run(cmd, cwd=ROOT, stdout=log, stderr=log, env=env).returncode

    def reference(self) -> None:
        """The SFT model, a fixed cost model, then an uninterrupted run to compare with."""
        self.out.mkdir(parents=True, exist_ok=True)
        if self.train(self.out / "sft", "--sft-only") != 0:
            raise SystemExit(f"soak: the SFT warm-up failed; see {self.out}/sft.log")
        write_profile(self.out / "profile.json")
        ref = self.out / "reference"
        if self.train(ref) != 0:
            raise SystemExit(f"soak: the reference run failed; see {ref}.log")
        self.ref_metrics, self.ref_weights = self.results(ref)

    @staticmethod
    def results(run: Path) -> tuple[list[dict], str]:
        weights = run / "checkpoints" / "step_000004" / "model.safetensors"
        return ([untimed(r) for _, r in read_jsonl(run / "metrics.jsonl")],
                hashlib.sha256(weights.read_bytes()).hexdigest())

    def random_fault(self) -> str:
        point, rank = self.rng.choice(["rollout", "optimizer", "save"]), self.rng.randrange(2)
        if point == "save":               # checkpoints are written at steps 2 and 4
            return f"save:{self.rng.choice([2, 4])}:{rank}:{self.rng.randint(1, 3) if rank == 0 else 1}"
        return f"{point}:{self.rng.randrange(4)}:{rank}:{self.rng.randint(1, 8) if point == 'rollout' else 1}"

    def kill_round(self, i: int) -> None:
        from nanospec.rl.checkpoint import list_checkpoints, verify_checkpoint
        run, faults = self.out / f"kill{i:03d}", []
        for attempt in range(self.rng.randint(1, 3) + 1):
            fault = self.random_fault() if attempt < 3 and (attempt == 0 or self.rng.random() < 0.7) else ""
            before = [c.name for c in list_checkpoints(run)]
            rc = self.train(run, *(["--resume"] if attempt else []), fault=fault)
            after = list_checkpoints(run)
            for c in after:
                verify_checkpoint(c)               # raises on a half-written checkpoint
            if before and (not after or after[-1].name < before[-1]):
                self.lost.append(f"kill{i:03d}: checkpoints {before} -> {[c.name for c in after]} after {fault}")
            if fault and rc != 0:
                faults.append(fault)
                self.injected.append(fault)
            elif rc != 0:
                self.lost.append(f"kill{i:03d}: the run failed without a fault (rc {rc}); see {run}.log")
                return
            if rc == 0:
                break
        if rc != 0 and self.train(run, "--resume") != 0:
            self.lost.append(f"kill{i:03d}: the last resume failed; see {run}.log")
            return
        metrics, weights = self.results(run)
        if metrics != self.ref_metrics or weights != self.ref_weights:
            self.lost.append(f"kill{i:03d}: after {faults} the run differs from the reference")
        else:
            self.survived.extend(faults)

    # ---- flood rounds ------------------------------------------------------------------------------
    def flood_round(self, i: int, n: int = 300) -> None:
        from nanospec.engine.llm import LLM
        from nanospec.engine.sequence import SamplingParams
        rng, spec = self.rng, [{"method": "prior"}, {"method": "suffix"}, {"method": "ngram"}]
        vocab, max_len = 40, 192
        prompts = [[rng.randrange(3, vocab) for _ in range(rng.randint(2, 40))] for _ in range(60)]
        reqs = [(rng.choice(prompts), SamplingParams(
            temperature=0.0 if rng.random() < 0.5 else 1.0, seed=rng.randrange(10**6), n=rng.choice([1, 1, 1, 4]),
            max_tokens=min(int(rng.paretovariate(1.2) * 8), 140), ignore_eos=rng.random() < 0.5)) for _ in range(n)]
        small = LLM(str(self.out / "sft"), max_model_len=max_len, block_size=8, num_kv_blocks=3 * max_len // 8,
                    speculative=spec)
        total, seqs, aborted, pending = small.num_free_blocks, [], set(), list(range(n))[::-1]
        while pending or small.scheduler.has_work():
            for _ in range(rng.randint(0, 8)):          # arrivals over time
                if pending:
                    j = pending.pop()
                    seqs += [(j, s) for s in small.add_request(reqs[j][0], reqs[j][1], j)]
            if rng.random() < 0.05 and seqs:              # an abort, running or waiting
                j, s = rng.choice(seqs)
                if not s.is_finished:
                    small.abort(s)
                    aborted.add(s.seq_id)
            if small.scheduler.has_work():
                small.step()
        self.injected.append(f"flood:{n} requests, {len(aborted)} aborts, pool {total} blocks")
        lost = [s.seq_id for _, s in seqs if not s.is_finished or (s.finish_reason == "abort") != (s.seq_id in aborted)]
        if small.num_free_blocks != total:
            lost.append(f"{total - small.num_free_blocks} leaked blocks")
        big = LLM(str(self.out / "sft"), max_model_len=max_len)     # greedy rows: plain AR, no preemption
        want = {j: big.add_request(reqs[j][0], reqs[j][1], j)[0] for j in {j for j, _ in seqs}
                if reqs[j][1].temperature == 0}
        while big.scheduler.has_work():
            big.step()
        lost += [s.seq_id for j, s in seqs if j in want and s.seq_id not in aborted
                 and s.completion_token_ids != want[j].completion_token_ids]
        if lost:
            self.lost.append(f"flood{i:03d}: {lost[:5]}")
        else:
            self.survived.append(self.injected[-1])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--minutes", type=float, default=20.0, help="wall time to soak for (rounds finish)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="runs/soak", help="run directories and logs")
    args = ap.parse_args(argv)
    soak, t0 = Soak(Path(args.out).resolve(), args.seed), time.time()
    soak.reference()
    i = 0
    while time.time() - t0 < 60 * args.minutes:
        kind = soak.rng.choice(["kill", "kill", "flood"])
        (soak.kill_round if kind == "kill" else soak.flood_round)(i)
        print(f"[soak] {time.time() - t0:6.0f}s round {i} ({kind}): {len(soak.injected)} faults injected, "
              f"{len(soak.survived)} survived, {len(soak.lost)} losses", flush=True)
        i += 1
    print(f"== nanospec soak: {i} rounds in {(time.time() - t0) / 60:.1f} min ==")
    print(f"faults injected ({len(soak.injected)}): " + ", ".join(soak.injected))
    print(f"survived: {len(soak.survived)} of {len(soak.injected)}")
    print(f"data lost: {'none' if not soak.lost else soak.lost}")
    return 1 if soak.lost else 0


if __name__ == "__main__":
    sys.exit(main())
