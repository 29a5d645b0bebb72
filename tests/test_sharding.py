"""run.sharding: fsdp (FSDP2 over gloo here) against the replicated trainer, multi-node launch, DCP
checkpoints resumed at another world size.

The end-to-end runs are conftest.E2E's (the embedded default on 2 gloo ranks, every speculation policy
on, the repeatable mode, 4 GRPO steps, a checkpoint at steps 2 and 4): the replicated runs are
test_faults' references, made once.
"""
import os
import subprocess
import textwrap

import pytest
import torch

from conftest import ROOT
from nanospec.config import read_jsonl
from tools.soak import untimed

PY = str(ROOT / ".venv" / "bin" / "python")
NONE, OFF = ("--run.sharding=none",), ("--run.sharding=none", "--grpo.max_staleness=1")


def metrics(out) -> list[dict]:
    return [r for _, r in read_jsonl(out / "metrics.jsonl")]


def weights(out, step=4) -> dict:
    from safetensors.torch import load_file
    return load_file(out / "checkpoints" / f"step_{step:06d}" / "model.safetensors")


def close(a, b, rel=1e-5, abs_=1e-5) -> bool:
    """Equal, or (numbers, lists of numbers) within rel of each other. `mismatch/*` are differences of
    two float computations (engine vs trainer logprobs, ~1e-7 each): compared absolutely."""
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(close(x, y, rel, abs_) for x, y in zip(a, b))
    if isinstance(a, float) and isinstance(b, (int, float)):
        return abs(a - b) <= max(rel * max(abs(a), abs(b)), abs_ if abs_ else 0.0)
    return a == b


@pytest.fixture(scope="module")
def runs(e2e):
    """The replicated and FSDP runs of the same 4 steps -> (E2E, the replicated run, the FSDP run)."""
    return e2e, e2e.reference(*NONE), e2e.reference("--run.sharding=fsdp")


def assert_same_run(none, fsdp, init) -> None:
    """Every untimed metric of the 4 steps within rel 1e-5, the final weights within 1e-5 (and 1% of
    how far training moved them from `init`)."""
    ref, got = metrics(none), metrics(fsdp)
    assert [r["step"] for r in got] == [0, 1, 2, 3] and got[0]["speculative"] == "prior+suffix"
    assert sum(r["accepted_tokens"] for r in got) > 0 and sum(r["bubble_draft_accepted"] for r in got) > 0
    for a, b in zip(ref, got):
        a, b = untimed(a), untimed(b)
        assert a.keys() == b.keys()
        bad = [(k, a[k], b[k]) for k in a
               if not close(a[k], b[k], abs_=1e-5 if k.startswith("mismatch/") else 0.0)]
        assert not bad, (a["step"], bad)
    w0, w1 = weights(none), weights(fsdp)
    moved = max(float((w0[k] - init[k]).abs().max()) for k in w0)      # how far the 4 steps moved them
    diff = max(float((w0[k] - w1[k]).abs().max()) for k in w0)
    assert w0.keys() == w1.keys() and diff <= min(1e-5, moved / 100), (diff, moved)


def sft_weights(e2e) -> dict:
    from safetensors.torch import load_file
    return load_file(e2e.root / "sft" / "model.safetensors")


@pytest.mark.slow
def test_fsdp_matches_replicated_on_two_ranks(runs):
    e2e, none, fsdp = runs
    assert_same_run(none, fsdp, sft_weights(e2e))
    ck = fsdp / "checkpoints" / "step_000004"
    assert sorted(p.name for p in (ck / "dcp").iterdir()) == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    from transformers import AutoModelForCausalLM     # the consolidated export is an HF model directory
    assert AutoModelForCausalLM.from_pretrained(ck).config.model_type == "llama"


@pytest.mark.slow
def test_off_policy_fsdp_matches_replicated(runs):
    """grpo.max_staleness 1: the rollout thread's engine beside FSDP's collectives in the main thread."""
    e2e = runs[0]
    off_fsdp = e2e.reference("--run.sharding=fsdp", "--grpo.max_staleness=1")
    assert [r["staleness"] for r in metrics(off_fsdp)] == [0, 1, 1, 1]
    assert_same_run(e2e.reference(*OFF), off_fsdp, sft_weights(e2e))


@pytest.mark.slow
def test_two_nodes_match_one_node_under_fsdp(runs, tmp_path):
    e2e, _, fsdp = runs
    e2e.launch(tmp_path / "nodes", "--run.sharding=fsdp", nodes=2, procs=1)
    assert [untimed(r) for r in metrics(tmp_path / "nodes")] == [untimed(r) for r in metrics(fsdp)]
    w0, w1 = weights(fsdp), weights(tmp_path / "nodes")
    assert all(torch.equal(w0[k], w1[k]) for k in w0)


DUMP = textwrap.dedent("""
    # resume as train.py would (same arguments), then write the whole weights and AdamW state (rank 0)
    import sys
    import torch
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
    from nanospec.config import load_config
    from nanospec.rl import dist
    from nanospec.rl.grpo import Trainer
    from nanospec.rl.sft import prepare_sft_model
    argv = sys.argv[1:]
    dump = next(a.split("=", 1)[1] for a in argv if a.startswith("--dump="))
    argv = [a for a in argv if not a.startswith("--dump=")]
    i = argv.index("--config")
    cfg = load_config(argv[i + 1], argv[:i] + argv[i + 2:] + ["--run.resume=true"])
    dist.init_distributed("gloo")
    tr = Trainer(cfg, model_dir=prepare_sft_model(cfg))
    m, o = get_state_dict(tr.policy, tr.opt, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if dist.rank() == 0:
        torch.save({"model": m, "optimizer": o["state"], "step": tr.step}, dump)
    dist.cleanup()
""")


def saved_state(ck):
    """A DCP checkpoint's whole weights and AdamW state, consolidated offline."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    dcp_to_torch_save(ck / "dcp", ck.parent / f"{ck.name}.pt")
    sd = torch.load(ck.parent / f"{ck.name}.pt", weights_only=False)
    return sd["model"], sd["optimizer"]["state"]


def same_state(dump, ck) -> None:
    model, opt = saved_state(ck)
    got = torch.load(dump, weights_only=False)
    assert got["model"].keys() == model.keys()
    assert all(torch.equal(got["model"][k], model[k]) for k in model), \
        [k for k in model if not torch.equal(got["model"][k], model[k])][:5]
    assert got["optimizer"].keys() == opt.keys()
    for k, st in opt.items():
        assert all(torch.equal(torch.as_tensor(got["optimizer"][k][s]), torch.as_tensor(v)) for s, v in st.items()), k


@pytest.mark.slow
def test_fsdp_resumes_at_another_world_size(runs, tmp_path):
    """2 -> 1 and 1 -> 2 ranks: weights and both AdamW moments come back bit for bit (DCP reshards);
    per-rank drafter state is rebuilt, and the run says so."""
    import shutil
    e2e, _, fsdp = runs
    run = tmp_path / "run"
    shutil.copytree(fsdp, run)
    shutil.rmtree(run / "checkpoints" / "step_000004")
    script = tmp_path / "dump.py"
    script.write_text(DUMP)
    common = e2e.args(run, "--run.sharding=fsdp")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    p = subprocess.run([PY, str(script), *common, f"--dump={tmp_path / 'one.pt'}"], cwd=ROOT,
                       capture_output=True, text=True, timeout=600, env=env)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    assert "written by 2 rank(s), this run has 1" in p.stdout and "rebuilt, not merged" in p.stdout, p.stdout[-3000:]
    same_state(tmp_path / "one.pt", run / "checkpoints" / "step_000002")
    # world 1 trains the last two steps and saves them; 2 ranks resume from that
    p = subprocess.run([PY, "train.py", *common, "--resume"], cwd=ROOT, capture_output=True, text=True,
                       timeout=600, env=env)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    assert [r["step"] for r in metrics(run)] == [0, 1, 2, 3] and len(metrics(run)[3]["rank_busy_time"]) == 1, \
        p.stdout[-3000:]
    log = e2e.launch(run, "--run.sharding=fsdp", f"--dump={tmp_path / 'two.pt'}", script=str(script))
    assert "written by 1 rank(s), this run has 2" in log, log[-3000:]
    same_state(tmp_path / "two.pt", run / "checkpoints" / "step_000004")


@pytest.fixture
def world_one():
    """FSDP at world 1 in this process: shard_policy opens a one-rank gloo group; closed afterwards."""
    yield
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def test_engine_weights_sleep_and_gathered_sync(tmp_path, world_one):
    """Sharded policy, engine with its own copy: level-2 sleep frees the engine's weights, the sync
    after wake-up refills them from the shards in place, and the NF4 self-drafter re-quantizes."""
    from torch.distributed.tensor import DTensor
    from test_grpo import tiny_cfg
    from nanospec import SamplingParams
    from nanospec.engine.cpu_linear import PackedLinear as Linear
    from nanospec.rl.grpo import Trainer
    cfg = tiny_cfg(tmp_path, run__sharding="fsdp", rollout__sleep_level=2,
                   rollout__speculative={"method": "self_nf4", "num_draft_tokens": 4})
    tr = Trainer(cfg, log=lambda *a: None)
    assert all(isinstance(p, DTensor) for p in tr.policy.parameters())
    engine = dict(tr.llm.model.named_parameters())
    ids = {n: id(p) for n, p in engine.items()}
    tr.llm.sleep(2)
    assert all(p.untyped_storage().nbytes() == 0 for p in engine.values())
    with torch.no_grad():
        for p in tr.policy.parameters():
            p.to_local().mul_(1.5)
    tr.llm.wake_up()
    tr.sync_weights()
    assert {n: id(p) for n, p in tr.llm.model.named_parameters()} == ids      # the same tensors, refilled
    for n, p in tr.policy.named_parameters():
        assert torch.equal(engine[n], p.full_tensor()), n
    m = {}
    tr.drafter_health(m)
    assert m["drafter/self_nf4/checksum_ok"] == 1.0
    tr.train()                                  # 2 steps, the engine asleep (level 2) while each learns
    recs = [r for _, r in read_jsonl(tmp_path / "run" / "metrics.jsonl")]
    assert [r["step"] for r in recs] == [0, 1] and all(r["drafter/self_nf4/checksum_ok"] == 1.0 for r in recs)
    # since the first level-2 sleep, a decoder layer's weight is freed once packed: one copy in the engine
    tr.llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2), use_tqdm=False)
    layers = [m.weight for m in tr.llm.model.model.layers.modules() if isinstance(m, Linear)]
    assert layers and all(w.untyped_storage().nbytes() == 0 for w in layers)
    tr.sync_weights()                           # and a sync restores each one it writes
    for n, p in tr.policy.named_parameters():
        assert torch.equal(engine[n], p.full_tensor()), n


def test_activation_checkpointing_gives_the_same_update(tmp_path, world_one, monkeypatch):
    from test_grpo import fixed_samples, tiny_cfg
    from nanospec.models import decoder
    from nanospec.rl.grpo import Trainer
    cfg = lambda **kw: tiny_cfg(tmp_path, run__sharding="fsdp", grpo__learning_rate=1e-2, **kw)
    samples = fixed_samples(Trainer(cfg(), log=lambda *a: None))
    calls, mlp = [], decoder.MLP.forward      # (recomputation runs no module hooks: count the calls)
    monkeypatch.setattr(decoder.MLP, "forward", lambda self, x: calls.append(1) or mlp(self, x))

    def learned(c):       # (parameters, gradients) after one learn step, gathered; MLP forwards
        tr = Trainer(c, log=lambda *a: None)
        calls.clear()
        tr.learn(samples)
        flat = lambda ts: torch.cat([t.full_tensor().flatten() for t in ts])
        return flat(p.detach() for p in tr.policy.parameters()), flat(p.grad for p in tr.policy.parameters()), len(calls)

    (p0, g0, c0), (p1, g1, c1) = learned(cfg()), learned(cfg(run__activation_checkpointing=True))
    assert g0.abs().max() > 1e-3 and torch.equal(g0, g1) and torch.equal(p0, p1)
    assert c1 == 2 * c0 > 0          # each layer runs again in backward: its activations were not kept


def test_sleep_level_2_needs_an_engine_copy():
    from nanospec.config import config_from_dict
    with pytest.raises(ValueError, match="rollout.sleep_level: expected 1 unless the engine holds its own weights"):
        config_from_dict({"rollout": {"sleep_level": 2}})
    with pytest.raises(ValueError, match="run.sharding: expected one of"):
        config_from_dict({"run": {"sharding": "ddp"}})
    assert config_from_dict({"rollout": {"sleep_level": 2}, "run": {"sharding": "fsdp"}}).rollout.sleep_level == 2


def test_simulator_memory_per_rank():
    """16 bytes of fp32 training state per parameter replicated, 16 / W under FSDP; an 8B model on
    8 H100s fits only sharded; sleep level 2 takes the engine copy out of the training peak."""
    from tools.simulate import MODELS, ModelShape, memory_rows
    m = ModelShape.from_config(MODELS["qwen3-8b"], "qwen3-8b")
    rows = {(r["sharding"], r["sleep_level"]): r for r in memory_rows(m, 8, 256 * 1024, 80e9)}
    gib = m.params / 2**30
    none, fsdp1, fsdp2 = rows["none", 1], rows["fsdp", 1], rows["fsdp", 2]
    assert abs(none["weights_gib"] + none["grads_gib"] + none["optimizer_gib"] - 16 * gib) < 1e-6
    assert abs(fsdp1["optimizer_gib"] - none["optimizer_gib"] / 8) < 1e-6
    assert not none["fits"] and fsdp1["fits"] and fsdp2["peak_gib"] <= fsdp1["peak_gib"]
    tiny = {(r["sharding"], r["sleep_level"]): r for r in memory_rows(m, 8, 0, 80e9)}    # no KV: training peaks
    assert tiny["fsdp", 2]["peak_gib"] < tiny["fsdp", 1]["peak_gib"]
