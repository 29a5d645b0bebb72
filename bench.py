"""Benchmarks: `python bench.py --suite engine|spec|rollout|gpu|real|assisted|suffix|scale|trl|idle|all`.

Each suite measures its variants side by side in one run, prints a table, and writes
`<out>/<suite>.json` plus `<out>/<suite>.png` (speedup bars). Speed is only ever measured here,
never asserted in tests. Suites live in benchmarks/<suite>.py and expose `run(args) -> list[dict]`;
every row has at least `name` and `speedup` (vs the suite's baseline), plus `lossy: bool`; the
memory suite (`scale`) has no speedups, only bytes.
"""
import argparse
import importlib
import json
import os
import sys
import time
from pathlib import Path

SUITES = ("engine", "spec", "rollout", "gpu", "real", "assisted", "suffix", "scale", "trl", "idle")
ALL = ("engine", "spec", "rollout", "gpu")     # `real` fetches SmolLM2 and runs ~20 min: asked for by name


def print_table(rows: list[dict], title: str) -> None:
    cols = list(dict.fromkeys(k for r in rows for k in r if not isinstance(r[k], (list, dict))))
    fmt = lambda v: f"{v:.3f}" if isinstance(v, float) else str(v)
    widths = [max(len(c), *(len(fmt(r.get(c, ""))) for r in rows)) for c in cols]
    print(f"\n== {title}")
    print("  ".join(c.ljust(w) for c, w in zip(cols, widths)))
    for r in rows:
        print("  ".join(fmt(r.get(c, "")).ljust(w) for c, w in zip(cols, widths)))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--suite", default="all", choices=SUITES + ("all",))
    ap.add_argument("--out", default="bench_out")
    ap.add_argument("--quick", action="store_true", help="smaller workloads (smoke runs)")
    ap.add_argument("--threads", type=int, default=int(os.environ.get("OMP_NUM_THREADS", 2)))
    args, extra = ap.parse_known_args(argv)
    args.extra = extra
    import torch
    torch.set_num_threads(args.threads)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    for suite in ALL if args.suite == "all" else (args.suite,):
        module = importlib.import_module(f"benchmarks.{suite}")
        t0 = time.perf_counter()
        rows = module.run(args)
        if not rows:            # e.g. gpu suite without CUDA: the suite printed why
            continue
        print_table(rows, f"{suite} ({time.perf_counter() - t0:.0f}s)")
        result = {"suite": suite, "rows": rows, "argv": sys.argv, "torch_threads": args.threads}
        Path(args.out, f"{suite}.json").write_text(json.dumps(result, indent=2))
        fast = [r for r in rows if "speedup" in r]
        if fast:                # (memory suites have no speedups to plot)
            from tools.report import plot_bench
            plot_bench(fast, str(Path(args.out, f"{suite}.png")), f"bench: {suite}")
        print(f"wrote {args.out}/{suite}.json" + (f" and {suite}.png" if fast else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
