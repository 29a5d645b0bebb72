import json
import os
import subprocess
import sys

import pytest

from tools import report

PNG = b"\x89PNG\r\n\x1a\n"
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _full_rec(step, spec="prior+bubble"):
    busy = [1.0 + 0.1 * step, 2.0, 0.5]
    bubble = [2.0 - busy[0], 0.0, 1.5]          # slowest rank sets time_rollout = 2.0
    draft = [0.5 * b for b in bubble]
    rec = {"step": step, "time_step": 3.0, "time_rollout": 2.0, "time_train": 0.6, "time_weight_sync": 0.2,
           "rank_rollout_time": [2.0] * 3, "rank_busy_time": busy, "rank_bubble_time": bubble,
           "rank_bubble_draft_time": draft, "rank_predicted_work": [10.0, 20.0, 5.0],
           "bubble_draft_tokens": 40, "bubble_draft_accepted": 12, "bubble_recovered_frac": 0.5,
           "reward_mean": 0.1 * step, "reward_std": 0.05, "accuracy": 0.05 * step, "frac_reward_zero_std": 0.3,
           "response_len_mean": 20.0, "response_len_p50": 4, "response_len_max": 150,
           "target_forwards_per_token": 0.5, "mean_accepted_len": 2.0 + step * 0.1, "spec_on_frac": 0.7,
           "draft_len_mean": 4.0, "tokens_per_s": 1000.0,
           "loss": 0.1, "grad_norm": 1.0, "kl": 0.01, "clip_frac": 0.02, "lr": 1e-4,
           "mismatch/mean_abs": 1e-6, "mismatch/max_abs": 1e-5, "speculative": spec, "lossy": False,
           "eval/reward_mean": 0.2 + 0.01 * step, "eval/sampled_reward_mean": 0.15, "entropy": 0.9,
           "completions/clipped_ratio": 0.1, "completions/mean_terminated_length": 18.0,
           "adv_mass/truncated": -0.01, "adv_mass/terminated": 0.01}
    for d in ("prior", "suffix", "bubble"):
        rec.update({f"drafter/{d}/mean_accepted_len": 1.5, f"drafter/{d}/acceptance_rate": 0.4,
                    f"drafter/{d}/proposed": 100, f"drafter/{d}/accepted": 40, f"drafter/{d}/draft_len": 3})
    return rec


def _write(run_dir, recs):
    os.makedirs(run_dir, exist_ok=True)
    with open(os.path.join(run_dir, "metrics.jsonl"), "w") as f:
        for r in recs:
            f.write((r if isinstance(r, str) else json.dumps(r)) + "\n")
    return str(run_dir)


def _pngs_ok(run_dir, md, names):
    for n in names:
        path = os.path.join(run_dir, f"report_{n}.png")
        with open(path, "rb") as f:
            assert f.read(8) == PNG, path
        assert f"](report_{n}.png)" in md


def test_full_report_renders_all_plots(tmp_path):
    run = _write(tmp_path / "spec", [_full_rec(s) for s in range(4)])
    out = report.write_report(run)
    md = open(out).read()
    _pngs_ok(run, md, ["timeline", "quality", "speculation", "training", "step_time"])
    assert "_Skipped" not in md and "no data" not in md
    assert "| mean reward, first step | 0 |" in md.replace("0.0 |", "0 |")
    assert "| bubble fraction recovered | 0.5 |" in md


def test_headline_numbers():
    recs = [_full_rec(s) for s in range(4)]
    h = report.headline(recs)
    assert h["steps"] == 4 and h["mean reward, first step"] == 0.0 and h["mean reward, last step"] == pytest.approx(0.3)
    assert h["mean accepted length"] == pytest.approx(2.15)
    assert h["rollout time per step (s)"] == 2.0
    bub = sum(sum(r["rank_bubble_time"]) for r in recs)
    assert h["bubble share of rank rollout time"] == pytest.approx(bub / (4 * 3 * 2.0))
    for r in recs:                              # recovered fraction falls back to draft/bubble time
        del r["bubble_recovered_frac"]
        r["rank_bubble_draft_time"] = [0.25 * b for b in r["rank_bubble_time"]]
    assert report.headline(recs)["bubble fraction recovered"] == pytest.approx(0.25)


def test_missing_keys_skip_with_notes(tmp_path):
    recs = [{"step": s, "reward_mean": 0.1 * s, "time_rollout": 1.0, "response_len_mean": 9.0} for s in range(3)]
    run = _write(tmp_path / "ar", recs)
    md = open(report.write_report(run)).read()
    assert "## Per-rank timeline" in md and "_Skipped: no `rank_busy_time`" in md
    assert not os.path.exists(os.path.join(run, "report_timeline.png"))
    assert md.count("_Skipped: none of its metrics present._") == 2    # speculation, training health
    assert "no data for accuracy" in md and "no data for target fwd / token" in md
    _pngs_ok(run, md, ["quality", "step_time"])
    assert not os.path.exists(os.path.join(run, "report_speculation.png"))
    assert "| mean accepted length | n/a |" in md


def test_only_step_key(tmp_path):
    run = _write(tmp_path / "bare", [{"step": 0}, {"step": 1}])
    md = open(report.write_report(run)).read()
    assert md.count("_Skipped") == 5 and ".png" not in md


@pytest.mark.parametrize("lines,lineno,what", [
    ([], None, "empty"),
    ([{"step": 0}, {"step": 1}, "{not json"], 3, "invalid JSON"),
    ([{"step": 0}, {"reward_mean": 1.0}], 2, "missing required key 'step'"),
    ([{"step": 0, "reward_mean": "high"}], 1, "non-numeric"),
    ([{"step": 0, "rank_busy_time": [1.0, "x"]}], 1, "non-numeric"),
    ([{"step": 0}, [1, 2]], 2, "JSON object"),
    ([{"step": "zero"}], 1, "integer"),
])
def test_malformed_input_names_file_and_line(tmp_path, lines, lineno, what):
    run = _write(tmp_path / "bad", lines)
    with pytest.raises(ValueError) as e:
        report.write_report(run)
    msg = str(e.value)
    assert "metrics.jsonl" in msg and what in msg
    if lineno is not None:
        assert f"line {lineno}:" in msg


def test_missing_file(tmp_path):
    with pytest.raises(ValueError, match="metrics file not found"):
        report.load_metrics(str(tmp_path / "nope" / "metrics.jsonl"))


def test_plot_bench(tmp_path):
    rows = [{"name": "ar", "speedup": 1.0}, {"name": "suffix", "speedup": 1.7},
            {"name": "lenient", "speedup": 2.2, "lossy": True}]
    out = report.plot_bench(rows, str(tmp_path / "bench.png"), "bench")
    assert open(out, "rb").read(8) == PNG
    assert report._bench_labels(rows) == ["ar", "suffix", "lenient (lossy)"]
    with pytest.raises(ValueError, match=r"results\[1\]\['speedup'\]"):
        report.plot_bench([rows[0], {"name": "x"}], str(tmp_path / "b2.png"), "t")


def test_compare_and_cli_main(tmp_path, capsys):
    spec = _write(tmp_path / "spec", [_full_rec(s) for s in range(3)])
    ar = _write(tmp_path / "ar", [dict(_full_rec(s, spec=None), mean_accepted_len=1.0) for s in range(3)])
    assert report.main([spec, "--compare", ar]) == 0
    out = capsys.readouterr().out.strip()
    md = open(out).read()
    assert "Compared with: ar [AR]" in md and "spec [prior+bubble]" in md
    assert "| mean accepted length | 2.1 | 1 |" in md
    _pngs_ok(spec, md, ["timeline", "quality", "speculation", "training", "step_time"])


def test_cli_subprocess_error(tmp_path):
    run = _write(tmp_path / "bad", [{"step": 0}, {"step": 1}, "{oops"])
    p = subprocess.run([sys.executable, "-m", "tools.report", run], cwd=ROOT, capture_output=True, text=True)
    assert p.returncode != 0 and "line 3: invalid JSON" in p.stderr


def test_arms_of_several_seeds_draw_mean_and_band_with_a_seed_table(tmp_path):
    """Two arms of 3 runs each: per-step means, +-1 std bands, the seed table and a Welch t-test."""
    import yaml
    arms = {}
    for arm, spec, shift in (("spec", "prior+suffix", 0.0), ("ar", None, 0.01)):
        arms[arm] = []
        for seed in range(3):
            recs = [dict(_full_rec(s, spec=spec), **{"eval/reward_mean": 0.2 + 0.05 * seed + shift + 0.01 * s})
                    for s in range(3)]
            recs[0]["eval_before/reward_mean"] = 0.175
            d = _write(tmp_path / f"{arm}_s{seed}", recs)
            (tmp_path / f"{arm}_s{seed}" / "config.yaml").write_text(yaml.safe_dump({"run": {"seed": seed}}))
            arms[arm].append(d)
    mean, spread = report.mean_over_runs([report.load_metrics(os.path.join(d, "metrics.jsonl")) for d in arms["spec"]])
    assert [r["step"] for r in mean] == [0, 1, 2]
    assert mean[2]["eval/reward_mean"] == pytest.approx(0.2 + 0.05 + 0.02)            # mean over seeds 0, 1, 2
    assert spread["eval/reward_mean"][2] == pytest.approx(0.05)                       # sample std of 0, .05, .1
    assert spread["reward_std"][0] == pytest.approx(0.0, abs=1e-12)                 # equal in every seed
    assert report.main([*arms["spec"], "--compare", *arms["ar"]]) == 0
    md = open(os.path.join(arms["spec"][0], "report.md")).read()
    assert "x3 runs" in md and "## Seeds" in md and "| spec_s2 | 2 | 0.175 | 0.320 |" in md
    assert "**mean +- std of 3** | | | 0.270 +- 0.050" in md
    assert "Welch t-test" in md and "p = 0.8" in md      # a 0.01 shift against a 0.05 spread: no difference
    _pngs_ok(arms["spec"][0], md, ["quality", "speculation", "training"])
