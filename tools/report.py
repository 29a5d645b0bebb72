"""Plots and a one-page Markdown report of where rollout time goes.

    python -m tools.report RUN_DIR [RUN_DIR ...] [--compare OTHER_RUN_DIR [OTHER_RUN_DIR ...]]

reads RUN_DIR/metrics.jsonl (a JSON object per GRPO step, seconds) and writes RUN_DIR/report_*.png and
report.md: the timeline shows the bubble (every rank waits for the slowest sequence) and what bubble
drafting recovered; the quality plot, that speculation did not change learning; the speculation plot, why
it paid or not. Several run dirs on a side are one arm's seeds: mean curves, +-1 std bands and a Welch
t-test (one RL run is one draw). Every metric but `step` is optional: a missing one skips its panel.
matplotlib's object API (Figure + Agg canvas, no pyplot state), imported lazily.
"""
from __future__ import annotations

import argparse
import math
import os
import sys

from nanospec.config import read_jsonl

DPI = 80
# keys of another type than a number, or null; the rest: numbers or lists of them (`rank_*`: lists)
TYPED_KEYS = {"speculative": (str, "a string or null"), "lossy": (bool, "true/false")}


def _is_num(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _check_value(key: str, v) -> str | None:
    """Return what is wrong with metric `key` = v, or None if it is acceptable."""
    if key == "step":
        return None if isinstance(v, int) and not isinstance(v, bool) else f"expected an integer, got {v!r:.40}"
    if v is None:
        return None
    if key in TYPED_KEYS:
        kind, what = TYPED_KEYS[key]
        return None if isinstance(v, kind) else f"expected {what}, got {v!r:.40}"
    if isinstance(v, list):
        bad = [x for x in v if not _is_num(x)]
        return f"non-numeric value {bad[0]!r:.40} in list" if bad else None
    if key.startswith("rank_"):
        return f"expected a per-rank list of numbers, got {v!r:.40}"
    return None if _is_num(v) else f"non-numeric value {v!r:.40}"


def load_metrics(path: str) -> list[dict]:
    """Parse and validate a metrics.jsonl (blank lines ignored); ValueError names file and line."""
    if not os.path.isfile(path):
        raise ValueError(f"{path}: metrics file not found")
    recs = []
    for n, rec in read_jsonl(path):
        if not isinstance(rec, dict):
            raise ValueError(f"{path}: line {n}: expected a JSON object, got {type(rec).__name__}")
        if "step" not in rec:
            raise ValueError(f"{path}: line {n}: missing required key 'step'")
        for k, v in rec.items():
            if (err := _check_value(k, v)) is not None:
                raise ValueError(f"{path}: line {n}: key {k!r}: {err}")
        recs.append(rec)
    if not recs:
        raise ValueError(f"{path}: empty metrics file (no JSON lines)")
    return recs


def _series(recs, key):
    pts = [(r["step"], float(r[key])) for r in recs if _is_num(r.get(key))]
    return [p[0] for p in pts], [p[1] for p in pts]


def _mean(xs):
    xs = [x for x in xs if math.isfinite(x)]
    return sum(xs) / len(xs) if xs else None


def _mean_std(xs):
    """Mean and sample standard deviation of two or more numbers (seeds of one arm)."""
    mu = sum(xs) / len(xs)
    return mu, math.sqrt(sum((x - mu) ** 2 for x in xs) / (len(xs) - 1))


def _rank_list(r, key):
    return r[key] if isinstance(r.get(key), list) else None


def _busy(r):
    return _rank_list(r, "rank_busy_time") or _rank_list(r, "rank_rollout_time") or []


def _step_parts(r):
    """(rollout, train, sync, total) seconds of one step; rollout = slowest rank."""
    busy = _busy(r)
    bub = _rank_list(r, "rank_bubble_time") or [0.0] * len(busy)
    R = r.get("time_rollout")
    if not _is_num(R):
        R = max([b + u for b, u in zip(busy, bub)] + list(busy) + [0.0])
    T, S = (float(r[k]) if _is_num(r.get(k)) else 0.0 for k in ("time_train", "time_weight_sync"))
    total = r["time_step"] if _is_num(r.get("time_step")) else R + T + S
    return float(R), T, S, float(max(total, R + T + S))


def headline(recs) -> dict:
    """Headline numbers (None where the metric is missing)."""
    rew = _series(recs, "reward_mean")[1]
    total = lambda key: sum(sum(_rank_list(r, key) or []) for r in recs)     # over ranks and steps
    mean = lambda key: _mean(_series(recs, key)[1])
    bub, rank_time = total("rank_bubble_time"), sum(_step_parts(r)[0] * len(_busy(r)) for r in recs)
    rec_frac = mean("bubble_recovered_frac")
    if rec_frac is None and bub > 0 and any("rank_bubble_draft_time" in r for r in recs):
        rec_frac = total("rank_bubble_draft_time") / bub
    pos = [mean(f"drafter/head/accept_pos{j}") for j in range(1, 5)]    # the draft head's, None without one
    loss = _series(recs, "head/loss")[1]
    return {
        "steps": len(recs),
        "mean reward, first step": rew[0] if rew else None,
        "mean reward, last step": rew[-1] if rew else None,
        "bubble share of rank rollout time": bub / rank_time if rank_time > 0 and bub > 0 else None,
        "bubble fraction recovered": rec_frac,
        "bubble share spent training the draft head": total("rank_bubble_train_time") / bub if bub > 0 else None,
        "mean accepted length": mean("mean_accepted_len"),
        "target forwards per token": mean("target_forwards_per_token"),
        "rollout time per step (s)": mean("time_rollout"),
        "step time (s)": mean("time_step"),
        "tokens/s": mean("tokens_per_s"),
        "draft head: acceptance at positions 1-4": None if pos[0] is None else
            " / ".join("-" if p is None else f"{p:.2f}" for p in pos),
        "draft head: loss, first / last step": f"{loss[0]:.3f} / {loss[-1]:.3f}" if loss else None,
        "draft head: training time per step (s)": mean("head/time"),
    }


def _figure(w, h):
    from matplotlib.figure import Figure
    return Figure(figsize=(w, h), dpi=DPI)


def _save(fig, out):
    fig.tight_layout()
    fig.savefig(out, dpi=DPI)   # a bare Figure renders through the Agg canvas for .png
    return out


def _rank_bars(ax, recs, nr: int, cats: dict, bubble) -> float:
    """recs' steps end to end on ax, a row per rank: rollout busy, the bubble's parts (bubble(r, i, b, R)
    -> [(category, seconds)]), train, weight sync; a bar set per category and rank. -> total seconds."""
    segs, t0 = {c: [[] for _ in range(nr)] for c in cats}, 0.0
    for r in recs:
        R, T, S, total = _step_parts(r)
        for i, b in enumerate(_busy(r)):
            x, parts = t0 + b, [("rollout busy", (t0, b))]
            for c, w in bubble(r, i, b, R):
                parts.append((c, (x, w)))
                x += w
            for c, seg in parts + [("train", (t0 + R, T)), ("weight sync", (t0 + R + T, S))]:
                if seg[1] > 0:
                    segs[c][i].append(seg)
        t0 += total
    for c, color in cats.items():
        for i in range(nr):
            if segs[c][i]:
                ax.broken_barh(segs[c][i], (i - 0.4, 0.8), facecolors=color,
                               hatch="//" if c == "bubble: drafting" else None,
                               label=c if not any(segs[c][:i]) else None)
    ax.set_yticks(range(nr), [f"rank {i}" for i in range(nr)])
    ax.invert_yaxis()
    return t0


def plot_timeline(recs, out) -> str | None:
    """Gantt-style: one row per rank, steps end to end. Returns None if no per-rank times."""
    if not any(_busy(r) for r in recs):
        return None
    cats = {"rollout busy": "tab:blue", "bubble: drafting": "tab:green", "bubble: idle": "lightgray",
            "train": "tab:orange", "weight sync": "tab:purple"}

    def bubble(r, i, b, R):     # the recorded bubble (else the wait for the slowest rank), drafting first
        bub, drf = _rank_list(r, "rank_bubble_time"), _rank_list(r, "rank_bubble_draft_time")
        u = bub[i] if bub and i < len(bub) else max(0.0, R - b)
        d = min(drf[i], u) if drf and i < len(drf) else 0.0
        return [("bubble: drafting", d), ("bubble: idle", u - d)]
    nr = max(len(_busy(r)) for r in recs)
    fig = _figure(7, 0.5 * nr + 1.6)
    ax = fig.subplots()
    _rank_bars(ax, recs, nr, cats, bubble)
    frac = headline(recs)["bubble fraction recovered"]
    ax.set_title("per-rank timeline" + (f" - bubble recovered {frac:.0%}" if frac is not None else ""), fontsize=9)
    ax.set_xlabel("time (s)")
    ax.legend(fontsize=6, ncol=5, loc="upper center", bbox_to_anchor=(0.5, -0.25))
    return _save(fig, out)


def plot_sim_timeline(measured: list[dict], simulated: list[dict], out: str) -> str:
    """Measured vs simulated (`tools.simulate --plot`) per-rank timelines of the same metrics-like
    steps, one panel each on one time axis: rollout busy, bubble (idle), train, weight sync."""
    if not measured or not simulated:
        raise ValueError("plot_sim_timeline: expected non-empty measured and simulated step lists")
    cats = {"rollout busy": "tab:blue", "bubble": "lightgray", "train": "tab:orange", "weight sync": "tab:purple"}
    nr = max(len(_busy(r)) for r in measured + simulated)
    fig = _figure(7, 1.0 * nr + 2.4)
    axes = fig.subplots(2, 1, sharex=True)
    for ax, (title, recs) in zip(axes, (("measured", measured), ("simulated", simulated))):
        t = _rank_bars(ax, recs, nr, cats, lambda r, i, b, R: [("bubble", R - b)])
        ax.set_title(f"{title}: {len(recs)} steps, {t:.2f} s", fontsize=9)
    axes[-1].set_xlabel("time (s)")
    from matplotlib.patches import Patch
    axes[-1].legend([Patch(color=c) for c in cats.values()], list(cats), fontsize=6, ncol=4, loc="upper center",
                    bbox_to_anchor=(0.5, -0.35))
    return _save(fig, out)


def _line_panels(runs, panels, out, title, spreads):
    """runs: [(label, recs)]; panels: [(ylabel, [(key, legend)])]; spreads: per run, {key: {step: std
    over seeds}}. Colour = key, linestyle = run. -> (path or None, notes for panels with no data)."""
    has = lambda k: any(_series(recs, k)[0] for _, recs in runs)
    active = [(yl, [kl for kl in keys if has(kl[0])]) for yl, keys in panels]
    notes = [f"{yl}: no {'/'.join(f'`{k}`' for k, _ in keys)}" for (yl, keys), (_, a) in zip(panels, active) if not a]
    active = [p for p in active if p[1]]
    if not active:
        return None, notes
    fig = _figure(6.5, 1.7 * len(active) + 0.6)
    axes = fig.subplots(len(active), 1, sharex=True, squeeze=False)[:, 0]
    for ax, (yl, keys) in zip(axes, active):
        for ci, (key, leg) in enumerate(keys):
            for ri, (label, recs) in enumerate(runs):
                xs, ys = _series(recs, key)
                if not xs:
                    continue
                name = f"{label}: {leg}" if len(runs) > 1 else leg
                ax.plot(xs, ys, color=f"C{ci}", ls=("-", "--")[ri % 2], marker=".", ms=3, lw=1, label=name)
                band = lambda sd, **kw: ax.fill_between(xs, [y - s for y, s in zip(ys, sd)],
                                                        [y + s for y, s in zip(ys, sd)], color=f"C{ci}", **kw)
                spread = spreads[ri].get(key)
                if spread:                                    # several seeds: mean +- std over them
                    band([spread.get(x, 0.0) for x in xs], alpha=0.15 if ri == 0 else 0.08,
                         hatch=None if ri == 0 else "//")
                elif key == "reward_mean":
                    sx, sd = _series(recs, "reward_std")
                    if sx == xs:
                        band(sd, alpha=0.12)
        ax.set_ylabel(yl, fontsize=8)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=6)
    axes[0].set_title(title, fontsize=9)
    axes[-1].set_xlabel("step")
    return _save(fig, out), notes


def plot_step_time(runs, out) -> str | None:
    """Stacked bars per step: rollout / train / sync / other; a compare run is hatched beside it."""
    parts = ("time_rollout", "time_train", "time_weight_sync")
    if not any(_is_num(r.get(k)) for _, recs in runs for r in recs for k in parts):
        return None
    fig = _figure(6.5, 2.8)
    ax = fig.subplots()
    w = 0.8 / len(runs)
    for ri, (label, recs) in enumerate(runs):
        x = [r["step"] + (ri - (len(runs) - 1) / 2) * w for r in recs]
        vals = [[float(r[k]) if _is_num(r.get(k)) else 0.0 for r in recs] for k in parts]
        tot = [r["time_step"] if _is_num(r.get("time_step")) else 0.0 for r in recs]
        vals.append([max(0.0, t - sum(v)) for t, v in zip(tot, zip(*vals))])
        bottom = [0.0] * len(recs)
        for ci, (name, v) in enumerate(zip(("rollout", "train", "weight sync", "other"), vals)):
            lab = f"{label}: {name}" if len(runs) > 1 else name
            ax.bar(x, v, w, bottom=bottom, color=f"C{ci}", hatch="//" if ri else None, label=lab)
            bottom = [b + y for b, y in zip(bottom, v)]
    ax.set(xlabel="step", ylabel="seconds")
    ax.set_title("step-time breakdown", fontsize=9)
    ax.legend(fontsize=6, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    return _save(fig, out)


def _bench_labels(results) -> list[str]:
    return [r["name"] + (" (lossy)" if r.get("lossy") else "") for r in results]


def plot_bench(results: list[dict], out_png: str, title: str) -> str:
    """Bar chart of `speedup` per row (`name` label), line at 1.0, lossy rows hatched + labelled."""
    if not isinstance(results, list) or not results:
        raise ValueError("plot_bench: results must be a non-empty list of dicts with 'name' and 'speedup'")
    for i, r in enumerate(results):
        if not isinstance(r, dict) or not isinstance(r.get("name"), str):
            raise ValueError(f"plot_bench: results[{i}]['name'] must be a string")
        if not _is_num(r.get("speedup")):
            raise ValueError(f"plot_bench: results[{i}]['speedup'] must be a number, got {r.get('speedup')!r}")
    fig = _figure(max(4.0, 0.7 * len(results) + 1.5), 3.2)
    ax = fig.subplots()
    for i, r in enumerate(results):
        lossy = bool(r.get("lossy"))
        ax.bar(i, r["speedup"], color="tab:orange" if lossy else "tab:blue", edgecolor="black",
               hatch="//" if lossy else None)
        ax.text(i, r["speedup"], f"{r['speedup']:.2f}x", ha="center", va="bottom", fontsize=7)
    ax.axhline(1.0, color="black", ls="--", lw=1)
    ax.set_xticks(range(len(results)), _bench_labels(results), rotation=30, ha="right", fontsize=7)
    ax.set_ylabel("speedup vs AR")
    ax.set_title(title, fontsize=9)
    return _save(fig, out_png)


def _label(run_dir, recs):
    spec = next((r["speculative"] for r in reversed(recs) if r.get("speculative")), None)
    lossy = " lossy" if any(r.get("lossy") for r in recs) else ""
    return f"{os.path.basename(os.path.normpath(run_dir))} [{spec or 'AR'}{lossy}]"


def mean_over_runs(runs: list[list[dict]]) -> tuple[list[dict], dict]:
    """One arm's runs -> (a record per step all have: numbers and lists averaged, else the first run's
    value; {key: {step: std over runs}})."""
    steps = sorted(set.intersection(*({r["step"] for r in recs} for recs in runs)))
    by_step = [{r["step"]: r for r in recs} for recs in runs]
    out, spread = [], {}
    for st in steps:
        rows, rec = [b[st] for b in by_step], {}
        for k in dict.fromkeys(k for r in rows for k in r):
            vals = [r.get(k) for r in rows]
            nums = [float(v) for v in vals if _is_num(v) and math.isfinite(v)]
            if k != "step" and len(nums) == len(vals):
                rec[k] = sum(nums) / len(nums)
                if len(nums) > 1:
                    spread.setdefault(k, {})[st] = _mean_std(nums)[1]
            elif all(isinstance(v, list) and len(v) == len(vals[0]) and all(map(_is_num, v)) for v in vals):
                rec[k] = [sum(x) / len(x) for x in zip(*vals)]
            else:
                rec[k] = vals[0]
        out.append(rec)
    return out, spread


def seed_table(arms: list[tuple[str, list[str], list[list[dict]]]]) -> list[str]:
    """Markdown: each run's seed, eval before -> after (greedy reward, accuracy), wall seconds; per arm
    the mean +- std; a Welch t-test on the final greedy reward between the first two arms."""
    import yaml
    lines = ["| arm | run | seed | eval reward before | eval reward after | accuracy after | step time sum (s) |",
             "|---|---|---|---|---|---|---|"]
    finals = []
    f = lambda v: "n/a" if v is None else f"{v:.3f}"
    for label, dirs, runs in arms:
        after = []
        for d, recs in zip(dirs, runs):
            cfg = os.path.join(d, "config.yaml")
            seed = (yaml.safe_load(open(cfg)) or {}).get("run", {}).get("seed") if os.path.isfile(cfg) else None
            last = next((r for r in reversed(recs) if _is_num(r.get("eval/reward_mean"))), {})
            a = last.get("eval/reward_mean")
            after += [a] if a is not None else []
            lines.append(f"| {label} | {os.path.basename(os.path.normpath(d))} | {seed} | "
                         f"{f(recs[0].get('eval_before/reward_mean'))} | {f(a)} | {f(last.get('eval/accuracy'))} | "
                         f"{sum(r['time_step'] for r in recs if _is_num(r.get('time_step'))):.0f} |")
        if len(after) > 1:
            mu, sd = _mean_std(after)
            lines.append(f"| {label} | **mean +- std of {len(after)}** | | | {mu:.3f} +- {sd:.3f} | | |")
        finals.append(after)
    if len(finals) > 1 and min(len(finals[0]), len(finals[1])) > 1:
        from scipy.stats import ttest_ind
        t = ttest_ind(finals[0], finals[1], equal_var=False)
        lines += ["", f"Welch t-test on the final greedy eval reward, {arms[0][0]} vs {arms[1][0]}: "
                      f"t = {t.statistic:.3f}, p = {t.pvalue:.3f} (p > 0.05: no difference detected at these seeds)."]
    return lines


# (panel title, [(metric, legend)]) of the report's line plots; the speculation panels add each drafter
QUALITY_PANELS = [
    ("reward", [("reward_mean", "mean reward (+-std)")]),
    ("eval reward", [("eval/reward_mean", "greedy"), ("eval/sampled_reward_mean", "sampled")]),
    ("accuracy", [("accuracy", "accuracy"), ("frac_reward_zero_std", "frac zero-std groups")]),
    ("response length", [("response_len_mean", "mean"), ("response_len_p50", "p50"),
                         ("response_len_max", "max"), ("completions/mean_terminated_length", "ended")]),
    ("truncation / entropy", [("completions/clipped_ratio", "truncated share"), ("entropy", "entropy")])]
TRAIN_PANELS = [
    ("loss", [("loss", "loss")]), ("grad norm", [("grad_norm", "grad norm")]),
    ("kl / clip", [("kl", "kl"), ("clip_frac", "clip frac")]),
    ("advantage mass", [("adv_mass/truncated", "truncated"), ("adv_mass/terminated", "terminated")]),
    ("logprob mismatch", [("mismatch/mean_abs", "mean |d|"), ("mismatch/max_abs", "max |d|")])]


def write_report(run_dir, compare_dir=None) -> str:
    """Write report_*.png and report.md into the (first) run dir -> report.md's path. run_dir /
    compare_dir: a run dir, or a list of one arm's run dirs (seeds)."""
    as_list = lambda d: [] if d is None else [d] if isinstance(d, (str, os.PathLike)) else list(d)
    arms = []
    for dirs in (as_list(run_dir), as_list(compare_dir)):
        if dirs:
            runs = [load_metrics(os.path.join(d, "metrics.jsonl")) for d in dirs]
            label = _label(dirs[0], runs[0]) + (f" x{len(dirs)} runs" if len(dirs) > 1 else "")
            arms.append((label, dirs, runs))
    run_dir = arms[0][1][0]
    merged = [mean_over_runs(runs) if len(runs) > 1 else (runs[0], {}) for _, _, runs in arms]
    runs = [(label, recs) for (label, _, _), (recs, _) in zip(arms, merged)]
    dr = sorted({k.split("/")[1] for _, rs in runs for r in rs for k in r if k.count("/") == 2 and k[:8] == "drafter/"})
    per = lambda m: [(f"drafter/{d}/{m}", d) for d in dr]
    p = lambda name: os.path.join(run_dir, f"report_{name}.png")
    lines = [f"# Rollout report: {runs[0][0]}", ""]
    if len(runs) > 1:
        lines += [f"Compared with: {runs[1][0]} (dashed lines / hatched bars).", ""]
    if any(len(d) > 1 for _, d, _ in arms):
        lines += ["Several runs in an arm: curves are their per-step mean, bands +-1 std over the runs.", ""]
    heads = [headline(r) for _, r in runs]
    lines += ["| metric | " + " | ".join(l for l, _ in runs) + " |", "|---" * (len(runs) + 1) + "|"]
    lines += [f"| {k} | " + " | ".join("n/a" if h[k] is None else h[k] if isinstance(h[k], str) else f"{h[k]:.4g}" for h in heads) + " |" for k in heads[0]]
    if any(len(d) > 1 for _, d, _ in arms):
        lines += ["", "## Seeds", ""] + seed_table(arms)

    def section(title, path, notes=(), why=""):
        lines.extend(["", f"## {title}", ""])
        lines.append(f"_Skipped: {why}._" if path is None else f"![{title}]({os.path.basename(path)})")
        lines.extend(f"- _no data for {n}; panel skipped._" for n in notes)

    section("Per-rank timeline", plot_timeline(runs[0][1], p("timeline")),
            why="no `rank_busy_time` / `rank_rollout_time` in metrics")
    lines += ["", "Rows are ranks; grey = idle bubble waiting for the slowest rank, hatched green = bubble spent "
                 "pre-generating drafts." + (" (main run only)" if len(runs) > 1 else "")]
    spec = [("accepted length", [("mean_accepted_len", "all")] + per("mean_accepted_len")),
            ("target fwd / token", [("target_forwards_per_token", "all")]),
            ("acceptance rate", per("acceptance_rate")),
            ("draft length", [("draft_len_mean", "all")] + per("draft_len")),
            ("spec on frac", [("spec_on_frac", "spec on"), ("bubble_recovered_frac", "bubble recovered")])]
    for title, panels, name in (("Reward, accuracy, response length", QUALITY_PANELS, "quality"),
                                ("Speculation", spec, "speculation"), ("Training health", TRAIN_PANELS, "training")):
        path, notes = _line_panels(runs, panels, p(name), title, [sp for _, sp in merged])
        section(title, path, notes, why="none of its metrics present")
    section("Step-time breakdown", plot_step_time(runs, p("step_time")),
            why="no `time_rollout` / `time_train` / `time_weight_sync`")
    out = os.path.join(run_dir, "report.md")
    with open(out, "w") as f:
        f.write("\n".join(lines) + "\n")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tools.report", description=__doc__.splitlines()[0])
    ap.add_argument("run_dir", nargs="+", help="directory holding metrics.jsonl; several: one arm's seeds")
    ap.add_argument("--compare", nargs="+", default=None,
                    help="a second arm drawn on the same axes: one run dir, or several (its seeds)")
    a = ap.parse_args(argv)
    print(write_report(a.run_dir, a.compare))
    return 0


if __name__ == "__main__":
    sys.exit(main())
