"""tools.simulate: roofline regimes, the drain against hand computations, speculation priced (never
assumed), the async pipeline, the CLI on a tiny synthetic run, presets, and bad input."""
import json
import math
import re
from dataclasses import replace

import pytest

from tools import simulate as sim

TINY = dict(model_type="llama", num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
            intermediate_size=128, vocab_size=50, tie_word_embeddings=True, torch_dtype="float32")


def clock(step=1.0, seq=0.0, verify=0.0) -> sim.Hardware:
    """A machine where only the host overheads cost anything: step times are hand-countable."""
    return sim.Hardware("clock", 1e30, 1e30, 1e30, step_overhead_s=step, seq_overhead_s=seq, verify_overhead_s=verify)


def shape(name="qwen3-8b") -> sim.ModelShape:
    cfg, where = sim.load_model_config(name)
    return sim.ModelShape.from_config(cfg, where)


def test_presets_load():
    assert sim.PRESETS["h100"].mem_bw == 3.35e12 and sim.PRESETS["h200"].mem_bw == 4.8e12
    assert sim.PRESETS["h100"].flops == sim.PRESETS["h200"].flops == 989e12
    assert 8.1e9 < shape("qwen3-8b").params < 8.3e9          # Qwen3-8B: 8.2B parameters
    assert 7.9e9 < shape("llama3-8b").params < 8.1e9         # Llama-3.1-8B: 8.0B
    m = shape()
    assert m.dtype_bytes == 2 and m.kv_bytes_per_token == 2 * 36 * 8 * 128 * 2


def test_roofline_regimes():
    hw, m = sim.replace(sim.PRESETS["h100"], step_overhead_s=0, seq_overhead_s=0, verify_overhead_s=0), shape()
    t = lambda B, Q, C=256: sim.step_time(hw, m, 1, B, B * Q, B * C, B * Q * C, Q > 1)
    weights = m.matmul_params * m.dtype_bytes / (hw.mem_bw * hw.bw_eff)
    # small batch: memory-bound, a step ~ one read of the weights, and verifying 8 drafts costs ~ a decode
    assert t(1, 1) == pytest.approx(weights, rel=0.01)
    assert t(1, 9) / t(1, 1) < 1.01
    # large batch: compute-bound, time grows with the query tokens
    assert t(1024, 9) / t(1024, 1) > 5
    assert t(1024, 9) == pytest.approx(2 * m.matmul_params * 1024 * 9 / (hw.flops * hw.flops_eff), rel=0.1)
    # tensor parallelism splits the work and pays all-reduces
    assert sim.step_time(hw, m, 2, 1, 1, 256, 256) < t(1, 1)


def test_drain_matches_hand_computation():
    m = sim.ModelShape.from_config(TINY, "tiny")
    # lengths 1, 3, 5: a prefill step (3 rows, each emits a token, the 1-token response ends), then 2 decode
    # steps of 2 rows and 2 of 1 row: 1.3 + 2 * 1.2 + 2 * 1.1
    t, steps = sim.drain(clock(1.0, 0.1), m, sim.Layout(max_seqs=64), [(4, [1, 3, 5])], sim.Spec())
    assert t == pytest.approx(1.3 + 2.4 + 2.2) and [s[2] for s in steps] == [3, 2, 2, 1, 1]
    assert [s[3] for s in steps] == ["prefill"] + ["decode"] * 4 and not any(s[4] for s in steps)
    # every draft accepted (a = 1, k = 1): 2 tokens per verify -> remaining 2 and 4 take 1 and 2 steps
    spec = sim.Spec(((1.0, 1, 1.0),), on=1.0)
    t, steps = sim.drain(clock(1.0, 0.0, 0.5), m, sim.Layout(max_seqs=64), [(4, [1, 3, 5])], spec)
    assert t == pytest.approx(1.5 + 2 * 1.5) and len(steps) == 3      # its prefill verifies drafts too
    # max 2 running: the third sequence is admitted by a second prefill when the first two are done
    t, steps = sim.drain(clock(), m, sim.Layout(max_seqs=2), [(4, [2, 2, 2])], sim.Spec())
    assert t == 4.0 and [s[2] for s in steps] == [2, 2, 1, 1]
    # replayed per row: 5 tokens in 2 forwards and 9 in 3 (the prefill's included) take exactly that
    t, steps = sim.drain(clock(), m, sim.Layout(), [(4, [5, 9])], sim.Spec(), [[(5 / 2, 1.5), (9 / 3, 2.0)]])
    assert t == 3.0 and [s[2] for s in steps] == [2, 2, 1]


def test_a_prefill_prices_the_lm_head_where_it_samples_and_the_heads_prompt_forward():
    """engine/llm.py `_prefill` runs the LM head only at each fresh prompt's last token (and its drafts), and
    a draft head runs one forward over the prompt (its KV): the replay's prefill step prices both."""
    m = sim.ModelShape.from_config(TINY, "tiny")
    hw = sim.Hardware("cpu", 1e9, 1e30, 1e30, overlap=False)       # only FLOPs cost: hand-countable
    lm_head = m.vocab * m.hidden
    every, sampled = (sim.engine_step(hw, m, 1, [40], [0], head_tokens=h) for h in (None, 1))
    assert every - sampled == pytest.approx(2 * lm_head * 39 / hw.flops)
    _, steps = sim.drain(hw, m, sim.Layout(), [(40, [1])], sim.Spec())      # one prefill, and done
    assert len(steps) == 1 and steps[0][1] == pytest.approx(sampled)
    head = replace(sim.Spec(), head=m.draft_head())
    _, with_head = sim.drain(replace(hw, draft_step_overhead_s=0.5), m, sim.Layout(), [(40, [1])], head)
    head_forward = (2 * (head.head.matmul_params - lm_head) * 40 + head.head.attn_flops_per_pair * 40 * 40) / hw.flops
    assert with_head[0][1] == pytest.approx(sampled + head_forward + 0.5)


def test_leviathan_and_its_inverse():
    assert sim.leviathan(0.0, 4) == 1.0 and sim.leviathan(1.0, 4) == 5.0
    assert sim.leviathan(0.5, 2) == pytest.approx(1 + 0.5 + 0.25)
    for a, k in ((0.3, 8), (0.8, 3.5), (0.95, 6)):
        rate = (sim.leviathan(a, k) - 1) / k
        assert sim.alpha_from_rate(rate, k) == pytest.approx(a, abs=1e-6)


def test_per_position_acceptance_and_a_priced_head():
    # acceptance per draft position, each given the ones before (accept_pos<j>); the last repeats
    assert sim.leviathan((1.0, 0.5), 3) == pytest.approx(1 + 1 + 0.5 + 0.25)
    assert sim.leviathan((0.6,), 4) == pytest.approx(sim.leviathan(0.6, 4))
    hw, m = sim.PRESETS["h100"], shape()
    head = m.draft_head(32000)
    assert head.layers == 1 and head.vocab == 32000 and head.matmul_params < m.matmul_params / 20
    lay, acc = sim.Layout(2), (0.8, 0.7, 0.6, 0.5)
    ar = sim.simulate(trace(), hw, m, lay, "ar")["sync_mean"]["time_rollout"]
    run = lambda hw, head: sim.simulate(trace(spec=sim.Spec(((1.0, 4, acc),), 1.0, 4, head)), hw, m, lay,
                                        "spec")["sync_mean"]["time_rollout"]
    free, priced = run(hw, None), run(hw, head)
    assert free < priced < ar                              # its forwards cost, and it still pays here
    # a head forward costing a decode step's worth each: no k pays, the rows decode as AR, and each rank's
    # one prefill still runs the head over its prompts (its KV): one slow forward more
    assert run(sim.replace(hw, draft_step_overhead_s=1.0), head) == pytest.approx(ar + 1.0, abs=1e-3)


def test_a_cpu_engine_repacks_its_linears_once_a_rollout():
    m, groups = shape(), [(16, [3, 5]), (8, [4])]
    plain, _ = sim.drain(clock(1.0), m, sim.Layout(), groups, sim.Spec())
    hw = sim.replace(clock(1.0), repack_s_per_param=1e-9)
    t, steps = sim.drain(hw, m, sim.Layout(), groups, sim.Spec())
    assert t == pytest.approx(plain + 1e-9 * m.matmul_params)         # in the first step only
    assert steps[0][1] == pytest.approx(1.0 + 1e-9 * m.matmul_params) and steps[1][1] == pytest.approx(1.0)


def test_an_engine_with_drafters_pays_the_rules_bookkeeping_on_every_step():
    # engine/llm.py asks the rule for budgets on every step once a drafter is configured, drafting or not;
    # AR (Spec()) never does
    m, groups = shape(), [(16, [3, 5]), (8, [4])]
    hw = sim.replace(clock(1.0), spec_step_overhead_s=0.25)
    plain, ar = sim.drain(hw, m, sim.Layout(), groups, sim.Spec())
    t, steps = sim.drain(hw, m, sim.Layout(), groups, sim.Spec(history=True))
    assert [s[3] for s in steps] == ["prefill"] + ["decode"] * 4 == [s[3] for s in ar]
    extra = [b - a for (_, b, *_), (_, a, *_) in zip(steps, ar)]
    assert extra == pytest.approx([0.25] * 5)                  # the prefill step and each decode step
    assert t == pytest.approx(plain + sum(extra))


def test_the_rows_a_drafter_is_asked_for_are_priced_drafts_found_or_not():
    # engine/llm.py's per-row work (clips, KV blocks reserved) on a step whose drafter is asked, on the
    # trace's share of row-forwards (its `asked_rows`): 3 prefill rows and 3 + 3 + 2 + 1 decode rows here
    m, groups = shape(), [(16, [3, 5]), (8, [4])]
    hw = sim.replace(clock(1.0), asked_row_s=0.1)
    plain = sim.drain(hw, m, sim.Layout(), groups, sim.Spec(history=True))[0]
    t, steps = sim.drain(hw, m, sim.Layout(), groups, sim.Spec(history=True, asked=0.5))
    assert [s[2] for s in steps] == [3, 3, 3, 2, 1] and t == pytest.approx(plain + 0.1 * 0.5 * (3 + 9))
    r = {"seq_forwards": 10, "asked_rows": 4, "drafter/suffix/verify_steps": 2, "drafter/suffix/proposed": 4}
    assert sim.spec_from_metrics(r).asked == 0.4 and sim.spec_from_metrics(dict(r, asked_rows=0)).asked == 0
    # and each draft token a step verifies costs its own (the calibration's verify drains draft 8 a row,
    # rollouts about 2): a replay drafting 2 tokens on half its row-forwards pays for 1 a row per step
    hw = sim.replace(hw, verify_token_s=0.2)
    assert sim.Spec(asked=0.5).host_time(hw, 4, 1, 6) == pytest.approx(0.1 * 4 * 0.5 + 0.2 * 6)
    spec = sim.Spec(((0.5, 2.0, 0.5),), 1.0, history=True)
    free, steps = sim.drain(sim.replace(hw, verify_token_s=0.0), m, sim.Layout(), groups, spec)
    priced = sim.drain(hw, m, sim.Layout(), groups, spec)[0]
    # every step's rows, the prefill's 3 included, carry replay_q() - 1 = 1 draft each
    assert priced - free == pytest.approx(0.2 * sum(B * (spec.replay_q() - 1) for _, _, B, _, _ in steps))


def test_history_drafters_are_priced_per_emitted_token():
    # their propose() walks and inserts every token its rows emit, drafting or not, prefill included
    m, groups = sim.ModelShape.from_config(TINY, "tiny"), [(4, [1, 3, 5])]
    hw = sim.replace(clock(1.0), draft_token_s=0.5)
    plain = sim.drain(hw, m, sim.Layout(), groups, sim.Spec())[0]
    t, steps = sim.drain(hw, m, sim.Layout(), groups, sim.Spec(history=True))
    assert t == pytest.approx(plain + 9 * 0.5) and sum(s[4] for s in steps) == pytest.approx(9 * 0.5)
    # a trace names its drafters: history ones (suffix) are priced so, a model drafter (head) is not
    r = {"seq_forwards": 10, "drafter/suffix/verify_steps": 2, "drafter/suffix/proposed": 4}
    assert sim.spec_from_metrics(r).history
    head = {"seq_forwards": 10, "drafter/head/verify_steps": 2, "drafter/head/proposed": 4}
    assert not sim.spec_from_metrics(head).history


def test_a_replayed_head_is_priced():
    # 40 engine steps, the head verified on 120 rows with 4 drafts each: on every step, 3 rows a step
    r = {"seq_forwards": 400, "target_forwards": 40, "spec_on_frac": 1.0, "drafter/head/verify_steps": 120,
         "drafter/head/proposed": 480, "drafter/head/accepted": 200}
    spec = sim.spec_from_metrics(r)
    assert spec.head_use == pytest.approx((1.0, 4.0, 3.0)) and spec.head is None
    # its forwards are those of its longest draft in each step it ran, counted by the engine: 25 steps
    # of 4.8 rows, 3.2 forwards each; a trace without that counter assumes the cap on each drafting step
    counted = dict(r, **{"drafter/head/propose_steps": 25, "drafter/head/depth": 80})
    assert sim.spec_from_metrics(counted).head_use == pytest.approx((25 / 40, 3.2, 4.8))
    assert sim.spec_from_metrics(dict(r, drafting_steps=30), head_cap=5).head_use == pytest.approx((0.75, 5, 4))
    hw, m = clock(1.0), shape()
    free = sim.drain(hw, m, sim.Layout(), [(16, [40, 40])], spec)[0]
    priced = sim.drain(sim.replace(hw, draft_step_overhead_s=0.25), m, sim.Layout(), [(16, [40, 40])],
                       sim.replace(spec, head=m.draft_head()))[0]
    assert priced > free
    # the run's config names the head: its shape, with the draft vocabulary its config.json saved
    cfg = {"rollout": {"speculative": [{"method": "prior"}, {"method": "head", "draft_vocab": 512}]}}
    assert sim.run_head(cfg, m).vocab == 512 and sim.run_head({"rollout": {"speculative": None}}, m) is None


def test_a_drafting_head_pays_per_row_and_per_key_its_prompt_forward_per_forward_only():
    """The calibration's fit of HeadDrafter.propose (tools.simulate.head_overhead): a + B (b + c C) a forward.
    A drafting step's head forwards pay all three (their draws, the q handed to verify, the KV gather of
    short rows); the head's forward over a prompt (no draw) pays the per-forward part only."""
    m = shape()
    spec = sim.Spec(head=m.draft_head(), head_use=(0.5, 3.0, 4.0))     # half the steps, 3 forwards of 4 rows
    base = clock(step=0.0)
    priced = sim.replace(base, draft_step_overhead_s=0.01, draft_row_s=0.002, draft_key_s=1e-5)
    C = 100.0
    extra = spec.drafting_time(priced, 8, C, 1.0, 0.0) - spec.drafting_time(base, 8, C, 1.0, 0.0)
    assert extra == pytest.approx(0.5 * 3 * (0.01 + 4 * (0.002 + 1e-5 * C)))
    prompt = spec.head_prefill_time(priced, [40, 40], [0, 0]) - spec.head_prefill_time(base, [40, 40], [0, 0])
    assert prompt == pytest.approx(0.01)


def test_the_head_step_is_priced_by_where_it_learns():
    # step: its passes over the positions it learned from, then the gradient all-reduce and AdamW over
    # its own weights (fc + layer, not the LM rows); bubble: the passes ran in the idle time; off: nothing
    hw, head = sim.Hardware("h", 1e12, 1e11, 1e10), shape().draft_head(32000)
    st = dict(measured={"rank_busy_time": [1.0, 1.0], "head/positions": 2048}, groups=[(16, [40, 40])])
    step, bubble = (sim.head_train_time(hw, head, st, mode) for mode in ("step", "bubble"))
    body = head.matmul_params - head.vocab * head.hidden
    assert bubble == pytest.approx(2 * 0.5 * 4 * body / (1e10 / 2) + 28 * body / 1e11)
    assert step > 10 * bubble and sim.head_train_time(hw, head, st, "off") == 0.0


def trace(steps=3, G=4, lens=(10, 40, 80, 20, 5, 60, 30, 90), spec=None):
    groups = [(16, list(lens[i * G:(i + 1) * G])) for i in range(len(lens) // G)]
    return [dict(step=s, groups=groups, ranks=[0, 1], spec=spec or sim.Spec(), measured={}) for s in range(steps)]


@pytest.mark.parametrize("hw", ["h100", "clock"])
def test_speculation_is_priced_not_assumed(hw):
    hw, m = (sim.PRESETS["h100"] if hw == "h100" else clock(1.0, 0.0, 0.5)), shape()
    lay = sim.Layout(2)
    ar = sim.simulate(trace(), hw, m, lay, "ar")["sync_mean"]
    zero = sim.simulate(trace(spec=sim.Spec(((1.0, 4, 0.0),), 1.0)), hw, m, lay, "spec")["sync_mean"]
    good = sim.simulate(trace(spec=sim.Spec(((1.0, 4, 0.8),), 1.0)), hw, m, lay, "spec")["sync_mean"]
    assert zero["time_rollout"] > ar["time_rollout"] > good["time_rollout"]      # acceptance 0 only costs
    assert zero["time_train"] == ar["time_train"]                                # same tokens to train on
    best = sim.simulate(trace(spec=sim.Spec(((1.0, 8, 0.0),), 1.0, best_k=8)), hw, m, lay, "spec")["sync_mean"]
    assert best["time_rollout"] == pytest.approx(ar["time_rollout"])               # best k at a = 0 is k = 0


def test_async_is_max_of_rollout_and_train_in_steady_state():
    hw, m = sim.PRESETS["h100"], shape()
    tr = trace(steps=6)
    res = sim.simulate(tr, hw, m, sim.Layout(4, 1, gen_dp=2), "ar")
    a = res["async"]
    assert (a["gen_ranks"], a["train_ranks"]) == (2, 2)
    assert a["time_step"] == pytest.approx(max(a["time_rollout"], a["time_train"] + a["time_weight_sync"]))
    assert a["time_weight_sync"] == pytest.approx(m.params * 2 / (hw.interconnect_bw / 2))
    s = res["sync_mean"]
    assert s["time_step"] == pytest.approx(s["time_rollout"] + s["time_train"] + s["time_weight_sync"])
    # the same ranks time-share rollout and training: the pipeline saves the bubble, never work
    shared, step = res["async_shared"]["time_step"], res["sync"][0]
    assert shared == pytest.approx(max(step["rank_busy_time"]) + step["time_train"] + step["time_weight_sync"])
    assert shared <= s["time_step"] * (1 + 1e-12)


def write_run(tmp_path, drop=None, bad_config=False):
    steps = []
    for s in range(3):
        r = dict(step=s, response_lens=[10, 40, 80, 20, 5, 60, 30, 90], prompt_rank=[0, 1], prompt_lens=[16, 20],
                 seq_forwards=200, generated_tokens=335, verify_steps=100, proposed_tokens=400, accepted_tokens=135,
                 **{"drafter/prior/verify_steps": 100, "drafter/prior/proposed": 400, "drafter/prior/accepted": 135},
                 spec_on_frac=0.8, time_rollout=1.0, time_train=0.5, time_weight_sync=0.01, time_step=1.6,
                 rank_busy_time=[0.8, 1.0], rank_bubble_time=[0.2, 0.0], rank_time_prefill=[0.1, 0.1],
                 rank_time_decode=[0.5, 0.7], rank_time_propose=[0.1, 0.1], rank_time_backward=[0.4, 0.4])
        if drop:
            r.pop(drop)
        steps.append(r)
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in steps))
    cfg = dict(TINY)
    if bad_config:
        cfg.pop("hidden_size")
    (tmp_path / "model.json").write_text(json.dumps(cfg))
    (tmp_path / "config.yaml").write_text("rollout:\n  max_num_seqs: 64\n  dtype: float32\n")
    return tmp_path


def test_cli_on_a_tiny_run(tmp_path, capsys):
    run = write_run(tmp_path)
    out, png, hw = tmp_path / "sim.json", tmp_path / "timeline.png", tmp_path / "hw.json"
    hw.write_text(json.dumps(sim.asdict(sim.replace(sim.PRESETS["h100"], name="saved calibration"))))
    assert sim.main(["--run", str(run), "--model", str(run / "model.json"), "--hardware", str(hw), "--out", str(out),
                     "--plot", str(png)]) == 0
    res = json.loads(out.read_text())["runs"][0]
    modes = ("sync", "async", "async, same ranks")
    assert [(r["mode"], r["rollout"]) for r in res["table"]] == [(m, k) for m in modes for k in ("ar", "spec")]
    assert {v["metric"] for v in res["validation"]} == {"time_rollout", "time_train", "time_weight_sync", "time_step",
                                                         "rank prefill", "rank decode + host", "rank propose",
                                                         "rank backward"}
    assert all(math.isfinite(v["error_pct"]) for v in res["validation"])
    # by part, mean over ranks and steps: the step's host time not in a forward or a draft goes with decode
    measured = {v["metric"]: v["measured"] for v in res["validation"]}
    assert measured["rank decode + host"] == pytest.approx(0.6 + (0.9 - 0.8)) and measured["rank propose"] == 0.1
    assert res["simulated"]["spec"]["sync_mean"]["time_weight_sync"] == 0.0   # an fp32 engine shares the policy
    sync = res["simulated"]["spec"]["sync"][0]
    assert sum(sync["rank_time_prefill"]) + sum(sync["rank_time_decode"]) + sum(sync["rank_time_propose"]) \
        == pytest.approx(sum(sync["rank_busy_time"]))
    assert png.stat().st_size > 0 and "predicted" in capsys.readouterr().out
    # the projection's one command, on a small GSM8K-format file
    data = tmp_path / "gsm.jsonl"
    answer = "3 + 4 = <<3+4=7>>7\n#### 7"
    data.write_text("".join(json.dumps(dict(question="Tom has 3 apples. How many?", answer=answer * (i + 1))) + "\n"
                            for i in range(10)))
    assert sim.main(["--lengths", str(data), "--acceptance", "0.4", "--model", "qwen3-8b", "--hardware", "h200",
                     "--dp", "8", "--prompts", "8", "--G", "4", "--steps", "3", "--out", str(out)]) == 0
    res = json.loads(out.read_text())["runs"][0]
    assert len(res["table"]) == 6 and all(r["time_step"] > 0 for r in res["table"])
    assert res["simulated"]["spec"]["sync_mean"]["time_weight_sync"] > 0     # a projection copies its weights
    assert res["validation"] == []            # a projection has nothing measured to compare with


def test_bad_input_names_the_file_and_key(tmp_path, capsys):
    run = write_run(tmp_path, drop="prompt_rank")
    with pytest.raises(ValueError, match=r"metrics\.jsonl: step 0: missing key 'prompt_rank'"):
        sim.read_run(str(run), None)
    assert sim.main(["--run", str(run), "--model", str(run / "model.json"), "--hardware", "h100"]) == 2
    assert "missing key 'prompt_rank'" in capsys.readouterr().err
    run = write_run(tmp_path, drop="prompt_lens")
    with pytest.raises(ValueError, match="missing key 'prompt_lens'.*--prompt-len"):
        sim.read_run(str(run), None)
    assert sim.read_run(str(run), 16)[0][0][1][0]["groups"][0][0] == 16
    assert sim.main(["--run", str(run), "--model", str(run / "model.json"), "--hardware", "h100",
                     "--prompt-len", "16"]) == 0         # the whole CLI: prompt tokens are a count (range())
    run, hw = write_run(tmp_path, drop="rank_time_propose"), tmp_path / "hw.json"   # drafting not timed
    hw.write_text(json.dumps(sim.asdict(sim.replace(sim.PRESETS["h100"], name="saved calibration"))))
    assert sim.main(["--run", str(run), "--model", str(run / "model.json"), "--hardware", str(hw)]) == 0
    assert "rank decode + host" in capsys.readouterr().out
    run = write_run(tmp_path, bad_config=True)
    with pytest.raises(ValueError, match=r"model\.json: missing key 'hidden_size'"):
        sim.ModelShape.from_config(*sim.load_model_config(str(run / "model.json")))
    assert sim.main(["--run", str(run), "--model", str(run / "model.json"), "--hardware", "h100"]) == 2
    assert "missing key 'hidden_size'" in capsys.readouterr().err
    (tmp_path / "rows.json").write_text(json.dumps({"rows": [{"name": "AR", "speedup": 1.0}]}))
    with pytest.raises(ValueError, match=r"rows\.json: row 'AR': missing key 'steps'"):
        sim.read_run(str(tmp_path / "rows.json"), None)


def test_light_calibration_times_each_part_on_a_tiny_model():
    """calibrate(light) end to end on a tiny model, one process: on CPU compute and memory add (no overlap),
    the drafters' propose() time per row is measured (not a fitted residual), the trainer's forward +
    backward sets train_mfu through the origin, and without a process group the interconnect is a copy."""
    phases = []
    hw = sim.calibrate(dict(TINY, max_position_embeddings=256), 1, "tiny", light=True, log=phases.append)
    assert hw.overlap is False and hw.flops > 0 and hw.mem_bw > 0 and hw.interconnect_bw > 0
    assert hw.train_mfu > 0 and hw.train_overhead_s >= 0 and hw.draft_token_s > 0
    assert min(hw.step_overhead_s, hw.seq_overhead_s, hw.verify_overhead_s, hw.wide_flops) >= 0
    assert any("prefills timed" in p for p in phases)     # (wide_flops 0: its compute hid under host time)
    # the rule's bookkeeping is fitted on steps it declined: with its threshold out of reach, all but its probes;
    # the engine's per-row work on steps whose drafter finds nothing, with the threshold at ~0
    counts = [m.groups() for m in map(re.compile(r"(\d+) declined, (\d+) asked-for-nothing").search, phases) if m]
    assert counts and int(counts[0][0]) >= 20 and int(counts[0][1]) >= 20 and hw.asked_row_s >= 0, phases
    lens = [(40, 100)] * 8
    assert sim.train_compute(hw, sim.ModelShape.from_config(TINY, "tiny"), [lens, []], False)[1] == 0.0


def test_the_trainer_fit_trains_the_checkpoints_own_weights(tmp_path, monkeypatch):
    """A model with weights beside its config.json is timed on them (a random init trains slower on
    CPU); without weights, on a random init of its shape."""
    import torch
    from nanospec.models.decoder import CausalLM, ModelArgs
    args = ModelArgs.from_hf(dict(TINY, max_position_embeddings=256), "tiny")
    loaded = []

    def load_model(path, device="cpu"):
        loaded.append(path)
        return CausalLM(args)
    monkeypatch.setattr("nanospec.models.loader.load_model", load_model)
    m, hw = sim.ModelShape.from_config(TINY, "tiny"), sim.Hardware("cpu", 1e9, 1e9, 1e9, overlap=False)
    fit = lambda where: sim._fit_trainer(hw, m, args, "cpu", True, (6, 12), lambda: None, lambda: None,
                                         lambda _: None, where)
    (tmp_path / "config.json").write_text(json.dumps(TINY))
    assert fit(str(tmp_path / "config.json")).train_mfu > 0 and loaded == []        # no weights: random init
    torch.save({}, tmp_path / "model.safetensors")                                  # (only its presence counts)
    assert fit(str(tmp_path / "config.json")).train_mfu > 0 and loaded == [tmp_path]


def test_engine_step_prices_the_engines_padding():
    """The replay pads an engine step as engine/runner.py does: keys to the longest row, a wide step's
    queries to the widest row; the linears see only the real tokens."""
    from nanospec.engine.paged_attention import SMALL_Q
    assert sim.SMALL_Q == SMALL_Q
    m, hw = sim.ModelShape.from_config(TINY, "tiny"), sim.Hardware("cpu", 1e9, 1e9, 1e9, overlap=False)
    # two rows of 1 query token after 10 and 30 cached: both read 31 keys and score 31 pairs
    assert sim.engine_step(hw, m, 1, [1, 1], [10, 30]) == sim.step_time(hw, m, 1, 2, 2, 62 - 2, 2 * 31)
    # a prefill of prompts of 40 and 4 tokens: SDPA runs [2, 40, 40]
    assert sim.engine_step(hw, m, 1, [40, 4], [0, 0]) == sim.step_time(hw, m, 1, 2, 44, 80 - 44, 2 * 40 * 40)
    # a wide step (a prefill past SMALL_Q) runs at the FLOP/s timed for it, a narrow one at the grid's
    wide = replace(hw, wide_flops=hw.flops / 3)
    assert sim.engine_step(wide, m, 1, [40, 4], [0, 0]) == sim.step_time(replace(hw, flops=hw.flops / 3), m, 1, 2, 44,
                                                                          80 - 44, 2 * 40 * 40)
    assert sim.engine_step(wide, m, 1, [1, 1], [10, 30]) == sim.engine_step(hw, m, 1, [1, 1], [10, 30])
    # varlen kernels (the GPU presets): each row its own keys, causal pairs among the new tokens
    varlen = replace(hw, padded=False)
    assert sim.engine_step(varlen, m, 1, [1, 1], [10, 30]) == sim.step_time(varlen, m, 1, 2, 2, 40, 10.5 + 30.5)
    # one number of new tokens for every row prices as the same list
    for machine in (hw, varlen):
        each = sim.engine_step(machine, m, 1, [3, 3], [10, 30])
        assert sim.engine_step(machine, m, 1, 3, [10, 30]) == pytest.approx(each)
