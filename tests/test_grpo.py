"""GRPO trainer: data-parallel exactness, metrics, logprob mismatch, drafter health, checkpoints."""
import json
import random
import shutil
import warnings

import pytest
import torch
import torch.multiprocessing as mp

from conftest import make_hf_model
from nanospec import SamplingParams
from nanospec.rl.checkpoint import latest_checkpoint, list_checkpoints, verify_checkpoint
from nanospec.config import config_from_dict
from nanospec.rl.grpo import Trainer, completion_logprobs, make_microbatch
from nanospec.models.loader import save_model
from nanospec.models.decoder import CausalLM, ModelArgs
from tools.report import load_metrics
from nanospec.rl.rollout import Sample
from nanospec.rl.sft import init_weights
from nanospec.tasks import build_tokenizer, format_prompt

OFF = {"bubble_drafting": False, "length_aware_assignment": False, "length_classes": [], "toggle": False}


def tiny_cfg(tmp_path, **over):
    """A world-1 config around a tiny random Llama (sharpened weights) with the synthetic tokenizer."""
    d = tmp_path / "model"
    if not d.exists():
        tok = build_tokenizer()
        make_hf_model(d, "llama", vocab_size=len(tok), hidden_size=64, layers=2, max_pos=128)
        tok.save_pretrained(d)
    raw = {"model": {"path": str(d)}, "task": {"num_train": 32, "num_test": 4, "max_steps": 4},
           "grpo": {"num_steps": 2, "prompts_per_step": 2, "num_generations": 4, "max_completion_length": 24},
           "rollout": {"speculative": None, "max_num_seqs": 16}, "speculation": dict(OFF),
           "run": {"out_dir": str(tmp_path / "run")}}
    for key, v in over.items():   # "grpo__loss_type" -> raw["grpo"]["loss_type"]
        sec, name = key.split("__")
        raw.setdefault(sec, {})[name] = v
    return config_from_dict(raw)


def fixed_samples(tr: Trainer) -> list[Sample]:
    """2 prompts x 4 completions (right and wrong traces: rewards differ) with the model's own logprobs."""
    rng, out = random.Random(0), []
    for p in tr.problems(0):
        ids = format_prompt(tr.tokenizer, p.prompt)
        for _ in range(tr.cfg.grpo.num_generations):
            c = tr.tokenizer.encode(tr.task.sft_text(p, rng, 0.6), add_special_tokens=False) + [tr.tokenizer.eos_token_id]
            out.append(Sample(p, p.prompt, ids, c, [0.0] * len(c), [False] * len(c), "stop"))
    with torch.no_grad():
        lp = completion_logprobs(tr.policy, make_microbatch(out, torch.zeros(len(out)), 0, "cpu"), 1.0)[0]
    for b, s in enumerate(out):
        s.logprobs = lp[b, :len(s.completion_ids)].tolist()
    return out


def params_after(cfg, samples):
    """(parameters after one learn step, the all-reduced clipped gradient it applied)."""
    tr = Trainer(cfg, log=lambda *a: None)
    tr.learn(samples)
    flat = lambda ts: torch.cat([t.detach().flatten() for t in ts])
    return flat(tr.policy.parameters()), flat(p.grad for p in tr.policy.parameters())


def _rank_main(rank, tmp, cfg_by_loss, samples):
    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo", init_method=f"file://{tmp}/pg", rank=rank, world_size=2)
    from nanospec.rl.dist import cleanup
    done = False
    try:
        mine = samples[rank * 4:(rank + 1) * 4]          # one whole group per rank
        out = {lt: params_after(cfg, mine) for lt, cfg in cfg_by_loss.items()}
        if rank == 0:
            torch.save(out, f"{tmp}/dist.pt")
        done = True
    finally:
        cleanup(sync=done)    # a barrier first: leaving alone can SIGABRT the other rank (CI saw it)


def test_two_ranks_match_one_process_with_grad_accumulation(tmp_path):
    tr = Trainer(tiny_cfg(tmp_path), log=lambda *a: None)
    samples = fixed_samples(tr)
    assert len({s.problem.prompt for s in samples}) == 2
    init = torch.cat([p.detach().flatten() for p in tr.policy.parameters()])
    cfgs = {lt: tiny_cfg(tmp_path, grpo__loss_type=lt, grpo__learning_rate=1e-2) for lt in ("grpo", "dapo")}
    mp.spawn(_rank_main, args=(str(tmp_path), cfgs, samples), nprocs=2, join=True)
    dist_params = torch.load(tmp_path / "dist.pt")
    for lt in ("grpo", "dapo"):
        single = params_after(tiny_cfg(tmp_path, grpo__loss_type=lt, grpo__learning_rate=1e-2,
                                       grpo__gradient_accumulation_steps=2), samples)
        whole = params_after(cfgs[lt], samples)                          # one micro-batch of 8
        assert (single[0] - init).abs().max() > 1e-3, "the update must be non-trivial"
        assert torch.allclose(dist_params[lt][0], single[0], atol=1e-5, rtol=0), lt
        assert torch.allclose(dist_params[lt][1], single[1], atol=1e-7, rtol=0), lt
        # other padding/reduction order: compare gradients (Adam's first step ~ lr * sign(g) amplifies
        # float noise in near-zero gradient entries, so parameters are the wrong thing to compare)
        assert single[1].abs().max() > 1e-3 and torch.allclose(whole[1], single[1], atol=1e-6, rtol=0), lt


REQUIRED = ["step", "reward_mean", "reward_std", "accuracy", "frac_reward_zero_std", "response_len_mean",
            "response_len_p50", "response_len_max", "time_rollout", "time_train", "time_weight_sync",
            "time_step", "rank_busy_time", "rank_train_time", "rank_time_decode", "rank_time_propose",
            "rank_time_backward", "rank_time_optimizer", "target_forwards_per_token", "mean_accepted_len",
            "tokens_per_s", "loss", "grad_norm", "kl", "clip_frac", "lr", "mismatch/mean_abs",
            "mismatch/max_abs", "speculative", "lossy"]


def test_train_writes_metrics_and_fp32_mismatch_is_tiny(tmp_path):
    cfg = tiny_cfg(tmp_path, rollout__speculative=[{"method": "suffix", "num_draft_tokens": 4}],
                   grpo__beta=0.04, task__num_test=4)
    trainer = Trainer(cfg, log=lambda *a: None)
    out = trainer.train()
    recs = load_metrics(str(tmp_path / "run" / "metrics.jsonl"))     # validates value types
    assert [r["step"] for r in recs] == [0, 1]
    for r in recs:
        assert not [k for k in REQUIRED if k not in r], sorted(r)
        assert r["mismatch/mean_abs"] < 1e-5 and r["mismatch/max_abs"] < 1e-4
        assert r["speculative"] == "suffix" and r["kl"] is not None
    assert "drafter/suffix/acceptance_rate" in recs[1]
    assert out["eval_before"]["eval/n"] == 4 and "eval/reward_mean" in out["eval_after"]
    assert 0 <= out["eval_after"]["eval/sampled_reward_mean"] <= 1
    assert trainer.evaluate() == out["eval_after"]      # seeded: greedy and sampled eval are reproducible
    assert [p.name for p in list_checkpoints(tmp_path / "run")] == ["step_000002"]
    old = tmp_path / "run" / "checkpoints" / "step_000099"       # a longer earlier run in the same dir
    shutil.copytree(tmp_path / "run" / "checkpoints" / "step_000002", old)
    Trainer(cfg, log=lambda *a: None).train()                     # a fresh (not resumed) run
    assert not old.exists() and latest_checkpoint(tmp_path / "run").name == "step_000002"
    assert [r["step"] for r in load_metrics(str(tmp_path / "run" / "metrics.jsonl"))] == [0, 1]


def test_bf16_engine_shows_mismatch(tmp_path):
    tr = Trainer(tiny_cfg(tmp_path, rollout__dtype="bfloat16", grpo__num_iterations=2, grpo__tis_cap=2.0,
                          grpo__loss_type="grpo"), log=lambda *a: None)
    m = tr.train_step()
    assert m["mismatch/mean_abs"] > 1e-4, m["mismatch/mean_abs"]
    assert 0 < m["tis/mean_weight"] <= 2.0 and m["step"] == 0 and tr.step == 1


def test_acceptance_collapse_warns_for_stale_self_drafter(tmp_path):
    # small-init layers + a sharp lm_head: the NF4 self-drafter agrees with its policy on most greedy tokens
    tok, d = build_tokenizer(), tmp_path / "sharp"
    torch.manual_seed(0)
    model = init_weights(CausalLM(ModelArgs(vocab_size=len(tok), hidden_size=64, intermediate_size=128,
                                            num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                                            tie_word_embeddings=False, eos_token_id=tok.eos_token_id)))
    model.lm_head.weight.data.mul_(50)
    save_model(model, d, tok)
    tr = Trainer(tiny_cfg(tmp_path, model__path=str(d), rollout__speculative={"method": "self", "num_draft_tokens": 4}),
                 log=lambda *a: None)
    prompts = [format_prompt(tr.tokenizer, p.prompt) for i in range(3) for p in tr.problems(i)]

    def rollout_and_check():
        tr.llm.reset_stats()
        tr.llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True), use_tqdm=False)
        m = tr.llm.summary()
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            tr.drafter_health(m)
        return m, [str(x.message) for x in w]

    def new_layer_weights(seed, scale):
        torch.manual_seed(seed)
        with torch.no_grad():
            for name, p in tr.policy.named_parameters():
                if p.dim() == 2 and ".layers." in name:
                    p.normal_(0, scale * p.std().item())

    for _ in range(3):
        m, w = rollout_and_check()
        assert not w and m["drafter/self_nf4/checksum_ok"] == 1.0 and m["drafter/self_nf4/acceptance_rate"] > 0.6
    new_layer_weights(1, 4.0)
    tr.sync_weights()                                   # a big update, drafter refreshed: no alarm
    m, w = rollout_and_check()
    assert not w and m["drafter/self_nf4/checksum_ok"] == 1.0, (m, w)
    new_layer_weights(2, 1.0)
    with torch.no_grad():                              # a missed refresh: engine updated, NF4 copy stale
        for name, t in tr.policy.state_dict().items():
            tr.llm.model.state_dict()[name].copy_(t)
    m, w = rollout_and_check()
    assert m["drafter/self_nf4/checksum_ok"] == 0.0 and m["drafter/self_nf4/acceptance_rate"] < 0.1
    assert any("stale drafter" in x for x in w) and not any("collapsed" in x for x in w), w
    m, w = rollout_and_check()                          # collapse persists for `patience` = 2 steps
    assert any("acceptance collapsed" in x and "'self_nf4'" in x for x in w), w


def test_checkpoint_roundtrip_and_corruption(tmp_path):
    cfg = tiny_cfg(tmp_path, rollout__speculative=[{"method": "prior", "num_draft_tokens": 4},
                                                   {"method": "suffix", "num_draft_tokens": 4}])
    tr = Trainer(cfg, log=lambda *a: None)
    tr.train_step()
    ck = tr.save()
    assert ck.name == "step_000001" and latest_checkpoint(cfg.run.out_dir) == ck
    rng, opt = torch.get_rng_state(), tr.opt.state_dict()
    pred = tr.worker.predictor.state_dict()
    prior_cache = tr.llm.drafter.drafters[0]._cache
    torch.rand(10)
    cfg.run.resume = True
    tr2 = Trainer(cfg, log=lambda *a: None)
    assert tr2.step == 1 and torch.equal(torch.get_rng_state(), rng)
    assert tr2.worker.predictor.state_dict() == pred
    assert {k: [e.tokens for e in v] for k, v in tr2.llm.drafter.drafters[0]._cache.items()} == \
        {k: [e.tokens for e in v] for k, v in prior_cache.items()}
    for a, b in zip(tr.policy.parameters(), tr2.policy.parameters()):
        assert torch.equal(a, b)
    for a, b in zip(tr.llm.model.parameters(), tr2.llm.model.parameters()):
        assert torch.equal(a, b)
    for k, v in opt["state"].items():
        for name, t in v.items():
            assert torch.equal(t, tr2.opt.state_dict()["state"][k][name])
    # an interrupted write (temp dir, no manifest) is never listed; a truncated file is a clear error
    (ck.parent / ".tmp_step_000002").mkdir()
    assert latest_checkpoint(cfg.run.out_dir) == ck
    f = ck / "model.safetensors"
    f.write_bytes(f.read_bytes()[:1000])
    with pytest.raises(ValueError, match="model.safetensors.*truncated"):
        verify_checkpoint(ck)
    with pytest.raises(ValueError, match="model.safetensors"):
        Trainer(cfg, log=lambda *a: None)
    manifest = json.loads((ck / "COMPLETE.json").read_text())
    assert set(manifest["files"]) >= {"model.safetensors", "config.json", "trainer_state.pt", "rank0.pt"}


def test_drafter_monitor_ignores_noise_but_not_a_sustained_collapse():
    from nanospec.rl.grpo import DrafterMonitor
    mon = DrafterMonitor()
    step = lambda rate, n=200: mon.update({"drafter/suffix/acceptance_rate": rate, "drafter/suffix/proposed": n})
    for r in (0.3, 0.1, 0.25, 0.2, 0.02, 0.3, 0.01, 0.25, 0.0):   # noisy, single dips, tiny counts
        assert step(r) == [] and step(0.0, n=10) == []
    mon = DrafterMonitor()
    assert [step(r) for r in (0.6, 0.7, 0.65, 0.05)] == [[], [], [], []]
    alerts = step(0.04)
    assert len(alerts) == 1 and "'suffix'" in alerts[0] and step(0.03) == []   # one warning per episode


def test_sft_only_builds_a_draft_model_the_engine_accepts(tmp_path):
    """`train.py --config configs/draft.yaml --sft-only` (= make draft) writes the small SFT model and
    nothing else; it speaks the task's vocabulary, so it plugs in as `method: draft_model`."""
    import train
    from nanospec import LLM
    out = tmp_path / "draft"
    assert train.main(["--config", "configs/draft.yaml", "--sft-only", "--sft.steps=3", "--sft.batch_size=8",
                       f"--sft.out_dir={out}", f"--run.out_dir={tmp_path / 'run'}"]) == 0
    cfg = json.loads((out / "config.json").read_text())
    assert (cfg["num_hidden_layers"], cfg["hidden_size"]) == (2, 128)
    assert not (tmp_path / "run").exists()                                   # no GRPO ran
    target = tiny_cfg(tmp_path).model.path
    prompts = [format_prompt(build_tokenizer(), p) for p in ("a 3 b 7 ?", "a 1 ?")]
    sp = SamplingParams(temperature=0, max_tokens=12, n=2)
    ar = LLM(target).generate(prompts, sp, use_tqdm=False)
    spec = LLM(target, controller=None, speculative={"method": "draft_model", "model": str(out), "num_draft_tokens": 3})
    assert [o.token_ids for o in spec.generate(prompts, sp, use_tqdm=False)] == [o.token_ids for o in ar]
    assert spec.stats["per_drafter"]["draft_model"]["proposed"] > 0


def test_one_step_off_policy_trains_on_the_rollout_made_ahead_and_resumes_exactly(tmp_path):
    """grpo.max_staleness=1: step t trains on samples drawn by the policy before update t-1 (staleness 1
    from step 1 on), while the thread rolls out step t+1; the rollout made ahead is checkpointed."""
    from tools.soak import untimed
    spec = [{"method": "prior", "num_draft_tokens": 4}, {"method": "suffix", "num_draft_tokens": 4}]
    cfg = tiny_cfg(tmp_path, grpo__max_staleness=1, grpo__tis_cap=2.0, grpo__num_steps=4, run__save_every=2,
                   rollout__speculative=spec)
    tr = Trainer(cfg, log=lambda *a: None)
    assert tr.llm.model is not tr.policy              # the engine keeps the older weights while t trains
    tr.train()
    recs = load_metrics(str(tmp_path / "run" / "metrics.jsonl"))
    assert [r["staleness"] for r in recs] == [0, 1, 1, 1]
    assert all(r["time_overlap"] > 0 for r in recs[:3]) and recs[3]["time_overlap"] == 0   # none ahead of the last
    assert all(r["tis/mean_weight"] is not None for r in recs)
    # resume from step 2: its checkpoint holds the step-2 rollout made during step 1
    run2 = tmp_path / "resumed"
    shutil.copytree(tmp_path / "run" / "checkpoints" / "step_000002", run2 / "checkpoints" / "step_000002")
    cfg.run.out_dir, cfg.run.resume = str(run2), True
    tr2 = Trainer(cfg, log=lambda *a: None)
    assert tr2.pending is not None and tr2.pending.version == 1 and tr2.pending.metrics["step"] == 2
    tr2.train()
    resumed = load_metrics(str(run2 / "metrics.jsonl"))
    assert [untimed(r) for r in resumed] == [untimed(r) for r in recs[2:]]


def test_max_staleness_is_validated():
    from nanospec.config import config_from_dict
    with pytest.raises(ValueError, match=r"grpo\.max_staleness: expected 0 \(synchronous\) or 1"):
        config_from_dict({"grpo": {"max_staleness": 2, "tis_cap": 2.0}})
    with pytest.raises(ValueError, match=r"grpo\.tis_cap: expected a cap >= 1 with max_staleness 1"):
        config_from_dict({"grpo": {"max_staleness": 1, "tis_cap": None}})


def test_truncated_responses_leave_the_loss_only_when_asked(tmp_path):
    """mask_truncated_completions (TRL's knob, DAPO's overlong filtering): a step whose responses were
    all cut at max_completion_length moves no weight with the mask, and does without it."""
    before = None
    for mask in (True, False):
        cfg = tiny_cfg(tmp_path, grpo__mask_truncated_completions=mask)
        tr = Trainer(cfg, log=lambda *a: None)
        samples = fixed_samples(tr)
        for s in samples:
            s.finish_reason = "length"
        before = torch.cat([p.detach().flatten().clone() for p in tr.policy.parameters()])
        rec = tr.learn(samples)
        after = torch.cat([p.detach().flatten() for p in tr.policy.parameters()])
        assert torch.equal(before, after) == mask, mask
        assert rec["truncated"] == [True] * len(samples) and rec["entropy_sum"] > 0


def test_length_metrics_say_where_the_advantage_goes():
    """clipped ratio, terminated length, entropy and the advantage mass sum_i A_i |o_i| / sum |o_i| on
    truncated vs terminated responses, over every rank's record."""
    recs = [dict(lengths=[10, 30], truncated=[False, True], adv_tokens=[-0.5 * 10, 1.0 * 30], entropy_sum=20.0),
            dict(lengths=[20, 40], truncated=[False, False], adv_tokens=[0.25 * 20, -0.75 * 40], entropy_sum=60.0)]
    m = Trainer._length_metrics(recs)
    assert m["completions/clipped_ratio"] == 0.25 and m["completions/mean_length"] == 25
    assert m["completions/mean_terminated_length"] == pytest.approx(70 / 3)
    assert m["entropy"] == pytest.approx(80 / 100)
    assert m["adv_mass/truncated"] == pytest.approx(30 / 100)
    assert m["adv_mass/terminated"] == pytest.approx((-5 + 5 - 30) / 100)


def test_learning_guard_warns_once_per_episode_naming_the_metric():
    from nanospec.rl.grpo import LearningGuard
    g, start = LearningGuard(), {"eval/reward_mean": 0.2, "eval/reward_sem": 0.03}
    seen = [g.update({"step": i, "completions/clipped_ratio": c}, start) for i, c in enumerate([0.3, 0.6, 0.9, 0.2, 0.7])]
    assert [len(w) for w in seen] == [0, 1, 0, 0, 1] and "completions/clipped_ratio" in seen[1][0]
    # 2 standard errors of the difference: 2 * hypot(0.03, 0.03) = 0.085
    assert g.update({"step": 5, "eval/reward_mean": 0.13, "eval/reward_sem": 0.03}, start) == []
    w = g.update({"step": 6, "eval/reward_mean": 0.10, "eval/reward_sem": 0.03}, start)
    assert len(w) == 1 and w[0].startswith("eval/reward_mean = 0.100")


def test_token_entropy_of_uniform_and_peaked_logits():
    from nanospec.rl.loss import token_entropy
    V = 50
    flat, peaked = torch.zeros(1, 1, V), torch.full((1, 1, V), -1e4)
    peaked[..., 3] = 0
    assert token_entropy(flat).item() == pytest.approx(torch.log(torch.tensor(float(V))).item(), rel=1e-6)
    assert token_entropy(peaked).item() == pytest.approx(0.0, abs=1e-6)
    # temperature flattens: entropy at T=2 of random logits exceeds that at T=1
    x = torch.randn(2, 3, V, generator=torch.Generator().manual_seed(0)) * 3
    assert (token_entropy(x, 2.0) > token_entropy(x, 1.0)).all()


def test_building_a_trainer_trains_nothing(tmp_path):
    """The SFT warm-up is train.py's step before the Trainer (parse -> warm-up -> build -> train): without
    model.path or a model_dir, building one is a one-line error, and no SFT model is trained."""
    cfg = tiny_cfg(tmp_path, model__path=None, sft__out_dir=str(tmp_path / "sft"))
    with pytest.raises(ValueError, match="model.path: empty"):
        Trainer(cfg, log=lambda *a: None)
    assert not (tmp_path / "sft").exists()
