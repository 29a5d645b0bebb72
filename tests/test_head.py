"""The draft head (drafters/head.py): its engine path is its training path, it is exact (a mutation that
drafts argmax(q) while reporting q is caught), the warm start teaches it, the trainer trains it online
and checkpoints it, and bad input gets one line."""
import json
import shutil
import subprocess
import sys
import warnings

import pytest
import torch

from conftest import ROOT, make_hf_model
from nanospec.drafters.chain import find_drafter
from nanospec.drafters.head import DraftHead, HeadDrafter, completion_mask, head_loss, load_head
from nanospec.engine.llm import LLM
from nanospec.engine.sequence import SamplingParams
from nanospec.models.loader import load_model
from test_exactness import K, check_exact, exact, sample_with, v8   # noqa: F401  (fixtures)
from test_grpo import tiny_cfg

sys.path.insert(0, str(ROOT))
from distill_head import distill   # noqa: E402  (the warm start script's core)


@pytest.fixture(scope="module")
def model(tiny_models):
    return load_model(tiny_models["llama"][0])


@pytest.fixture(scope="module")
def warm_head(model, tmp_path_factory):
    """A head distilled on the tiny model's own greedy text (~20 s): its drafts are often right, which
    the greedy and dense-forward checks need."""
    llm = LLM(model, max_num_seqs=64, max_model_len=96)
    prompts = [[i % 64, (3 * i) % 64, (7 * i + 1) % 64] for i in range(48)]
    head = distill(llm, prompts, samples=1, max_tokens=40, temperature=0.0, epochs=20, lr=3e-3,
                   batch_tokens=256, log=lambda *a: None)
    path = tmp_path_factory.mktemp("head") / "head"
    head.save(path)
    return path


def test_engine_drafts_are_the_dense_forward_argmax(model, warm_head):
    """The engine's catch-up over its paged KV (prompt blocks shared by a group, drafts verified, rows
    ragged) gives the head the same inputs as one plain forward over the whole sequence: every first
    draft it proposes is the argmax of the dense forward at that position."""
    llm = LLM(model, max_num_seqs=8, max_model_len=96, controller=None, block_size=4,
              speculative={"method": "head", "model": str(warm_head), "num_draft_tokens": 3})
    head = llm.drafter.head
    log, orig = [], llm.drafter.propose

    def propose(seqs, budgets):
        p = orig(seqs, budgets)
        log.extend((list(s.token_ids), d[0]) for s, d in zip(seqs, p.tokens) if d)
        return p
    llm.drafter.propose = propose
    outs = llm.generate([[5, 9, 2, 7, 1], [3, 3, 8]], SamplingParams(temperature=0.0, max_tokens=30, n=3),
                        use_tqdm=False)
    assert llm.stats["accepted_tokens"] > 0 and len(log) > 20
    with torch.inference_mode():
        for ids, first in log:
            x = torch.tensor([ids])
            h = model(x)                                                                   # [1, L, D]
            g = head(x[:, 1:], features=h[0, :-1])                                         # [1, L-1, D]
            assert int(head.logits(g[0, -1]).argmax()) == first, ids
    assert len(outs) == 6


class ArgmaxHead(HeadDrafter):
    """The mutation: drafts argmax(q) but reports q (as if sampled)."""
    def propose(self, seqs, num_tokens):
        p = super().propose(seqs, num_tokens)
        # a sampled draft replaced by the mode of its own q: q no longer describes how d was drawn
        tokens = [[int(p.q[i, j].argmax()) for j in range(len(d))] for i, d in enumerate(p.tokens)]
        p.tokens = tokens
        return p


def test_greedy_with_the_head_is_token_identical(model, warm_head):
    """Greedy with a trained head, alone and chained after suffix, a tight KV pool (preemption): the
    tokens and logprobs of greedy AR."""
    prompts = [[i % 64, (3 * i + 1) % 64] * (1 + i % 5) for i in range(16)]
    ar = LLM(model, max_num_seqs=16, max_model_len=64).generate(
        prompts, SamplingParams(temperature=0.0, max_tokens=24), use_tqdm=False)
    for spec in ({"method": "head", "model": str(warm_head), "num_draft_tokens": K},
                 [{"method": "suffix", "num_draft_tokens": K}, {"method": "head", "model": str(warm_head)}]):
        llm = LLM(model, block_size=4, max_model_len=64, max_num_seqs=16, num_kv_blocks=40, controller=None,
                  speculative=spec)
        outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=24), use_tqdm=False)
        for o, r in zip(outs, ar):
            assert o.token_ids == r.token_ids
            assert o.logprobs == pytest.approx(r.logprobs, abs=1e-4)
        st = llm.summary()
        assert st["drafter/head/accepted"] > 0 and llm.scheduler.num_preemptions > 0
        # its forwards, as tools.simulate prices them: its longest draft on each step it drafted
        assert 0 < st["drafter/head/propose_steps"] <= st["target_forwards"]
        cap = find_drafter(llm.drafter, "head").max_draft_tokens
        assert st["drafter/head/propose_steps"] <= st["drafter/head/depth"] <= cap * st["drafter/head/propose_steps"]


def test_the_exactness_test_catches_a_head_that_drafts_argmax(v8, exact):
    from test_exactness import PARAMS
    params, dist = PARAMS["temp1"], exact["temp1"]

    def setup(llm):
        d = llm.drafter
        llm.drafter = ArgmaxHead(d.head, _target(llm), 0)
    with pytest.warns(UserWarning, match="freshly initialised"):
        llm, outs = sample_with(v8, {"method": "head", "num_draft_tokens": K}, params, setup=setup)
    with pytest.raises(AssertionError, match="chi-square"):
        check_exact(llm, outs, dist, "argmax head")


def _target(llm):
    from nanospec.drafters.base import DraftTarget
    return DraftTarget(llm.model, llm.vocab_size, llm.blocks.num_blocks, llm.blocks.block_size, llm.device)


def held_out_loss(model, head):
    """The head's distillation loss per position on the model's own T=1 samples of unseen prompts."""
    llm = LLM(model, max_num_seqs=32, max_model_len=96)
    outs = llm.generate([[i, (5 * i) % 64, 9] for i in range(50, 58)], SamplingParams(temperature=1.0, max_tokens=40,
                                                                                     seed=0, n=2), use_tqdm=False)
    ids = torch.tensor([o.prompt_token_ids + o.token_ids for o in outs])
    with torch.no_grad():
        loss, n = head_loss(head, model(ids), ids, completion_mask([3] * len(outs), [ids.shape[1]] * len(outs),
                                                                   ids.shape[1]))
    return loss.item() / n


def test_warm_start_teaches_the_head(model, warm_head):
    """On prompts it never saw, the distilled head's loss (KL to the model's next-token distribution +
    feature regression) is a fraction of a fresh head's."""
    with torch.random.fork_rng():
        torch.manual_seed(0)
        fresh = DraftHead(model)
    warm, cold = held_out_loss(model, load_head(warm_head, model)), held_out_loss(model, fresh)
    assert warm < 0.5 * cold, (warm, cold)


def test_a_warm_start_can_continue_from_a_head(model, warm_head):
    """`distill_head.py --init DIR`: more epochs on new data start from that head, not a fresh one."""
    llm = LLM(model, max_num_seqs=16, max_model_len=96)
    prompts = [[(5 * i + 2) % 64, (11 * i) % 64] for i in range(8)]
    go = lambda init: distill(llm, prompts, samples=1, max_tokens=24, temperature=0.0, epochs=1, lr=1e-4,
                              batch_tokens=256, log=lambda *a: None, init=init)
    start = load_head(warm_head, model)
    with torch.random.fork_rng():
        torch.manual_seed(0)
        continued, fresh = go(start), go(None)
    assert continued is start
    assert held_out_loss(model, continued) < 0.5 * held_out_loss(model, fresh)


def test_head_loss_masks_and_unrolls(model):
    """Positions outside the mask add nothing; the unrolled pass changes the loss (it reads g, not h)."""
    head = DraftHead(model)
    ids = torch.randint(0, 64, (2, 12))
    with torch.no_grad():
        hidden = model(ids)
    mask = completion_mask([4, 6], [12, 9], 12)
    assert mask.shape == (2, 11) and mask[0, 3] == 1 and mask[0, 2] == 0 and mask[1, 6] == 1 and mask[1, 7] == 0
    loss, n = head_loss(head, hidden, ids, mask, unroll=1)
    assert n == int(mask.sum()) and loss.item() > 0
    changed = hidden.clone()
    changed[0, :2] += 1.0                    # outside row 0's mask (positions < 3 are prompt), but attended
    assert head_loss(head, hidden, ids, torch.zeros_like(mask))[0].item() == 0
    assert head_loss(head, hidden, ids, mask, unroll=2)[0].item() != pytest.approx(loss.item())


def test_head_training_leaves_the_policys_gradients_alone(model):
    """The head reads the target's embedding and LM head, which the trainer's engine may share with the
    policy: its backward fills the head's gradients only, none the size of the vocabulary."""
    head = DraftHead(model)
    ids = torch.randint(0, 64, (2, 12))
    with torch.no_grad():
        hidden = model(ids)
    head_loss(head, hidden, ids, completion_mask([4, 6], [12, 9], 12))[0].backward()
    assert all(p.grad is not None for p in head.parameters())
    assert [n for n, p in model.named_parameters() if p.grad is not None] == []


# ---- bad input: one line naming the field ------------------------------------------------------------
def test_bad_heads_are_refused_with_one_line(model, tmp_path):
    other_dir, _ = make_hf_model(tmp_path / "wide", "llama", vocab_size=64, hidden_size=96, seed=3)
    DraftHead(load_model(other_dir)).save(tmp_path / "wide_head")
    with pytest.raises(ValueError, match=r"head for another model: its hidden_size is 96, the model's is 64"):
        LLM(model, speculative={"method": "head", "model": str(tmp_path / "wide_head")})
    vocab_dir, _ = make_hf_model(tmp_path / "v80", "llama", vocab_size=80, hidden_size=64, seed=4)
    DraftHead(load_model(vocab_dir)).save(tmp_path / "v80_head")
    with pytest.raises(ValueError, match=r"its vocab_size is 80, the model's is 64"):
        LLM(model, speculative={"method": "head", "model": str(tmp_path / "v80_head")})
    with pytest.raises(ValueError, match=r"speculative\[head\].draft_vocab: expected null or an int in \[1, 64\]"):
        LLM(model, speculative={"method": "head", "draft_vocab": 65})
    with pytest.raises(FileNotFoundError, match="not a draft head directory"):
        LLM(model, speculative={"method": "head", "model": str(tmp_path)})


def test_train_py_refuses_a_head_of_another_model_with_exit_2(tmp_path):
    cfg = tiny_cfg(tmp_path)
    other_dir, _ = make_hf_model(tmp_path / "wide", "llama", vocab_size=64, hidden_size=96, seed=3)
    DraftHead(load_model(other_dir)).save(tmp_path / "wide_head")
    spec = json.dumps({"method": "head", "model": str(tmp_path / "wide_head"), "num_draft_tokens": 2})
    r = subprocess.run([sys.executable, str(ROOT / "train.py"), "--config", str(ROOT / "configs/default.yaml"),
                        f"--model.path={cfg.model.path}", f"--rollout.speculative={spec}",
                        f"--run.out_dir={tmp_path / 'run'}", "--task.num_train=32", "--task.num_test=4"],
                       capture_output=True, text=True, cwd=tmp_path, timeout=300)
    lines = [l for l in r.stderr.splitlines() if "error" in l]
    assert r.returncode == 2 and len(lines) == 1, r.stderr[-2000:]
    assert "speculative[head].model" in lines[0] and "hidden_size" in lines[0]
    assert not (tmp_path / "run").exists()


# ---- online training and checkpoints -------------------------------------------------------------------
HEAD = [{"method": "head", "num_draft_tokens": 3}]


def run(cfg):
    from nanospec.rl.grpo import Trainer
    with pytest.warns(UserWarning, match="freshly initialised"):
        tr = Trainer(cfg, log=lambda *a: None)
    tr.train()
    return tr


def test_trainer_trains_the_head_online_and_resumes_it_exactly(tmp_path):
    cfg = tiny_cfg(tmp_path, rollout__speculative=HEAD, grpo__num_steps=3, run__save_every=1)
    tr = run(cfg)
    recs = [json.loads(l) for l in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert all(r["head/positions"] > 0 and r["head/time"] > 0 and "drafter/head/accept_pos1" in r for r in recs)
    before = torch.load(tmp_path / "run/checkpoints/step_000002/trainer_state.pt", weights_only=False)["head"]
    assert not all(torch.equal(a, tr.head.state_dict()[k]) for k, a in before["model"].items())   # it learned
    assert tr.head_drafter.head.fc.weight.equal(tr.head.fc.weight)                # the engine's copy is synced
    export = load_head(tmp_path / "run/checkpoints/step_000003/draft_head", tr.llm.model)
    assert export.fc.weight.equal(tr.head.fc.weight)
    # resume from step 2 in a fresh directory: step 3 again, the same head and optimizer state
    again = tmp_path / "again"
    shutil.copytree(tmp_path / "run/checkpoints/step_000002", again / "run/checkpoints/step_000002")
    cfg2 = tiny_cfg(again, rollout__speculative=HEAD, grpo__num_steps=3, run__resume=True)
    shutil.copytree(tmp_path / "model", again / "model", dirs_exist_ok=True)
    tr2 = run(cfg2)
    for k, v in tr.head.state_dict().items():
        assert torch.equal(v, tr2.head.state_dict()[k]), k
    rec2 = json.loads((again / "run" / "metrics.jsonl").read_text().splitlines()[-1])
    assert rec2["head/loss"] == recs[-1]["head/loss"]


def test_a_frozen_head_is_not_trained(tmp_path):
    cfg = tiny_cfg(tmp_path, rollout__speculative=HEAD, speculation__head_training="off")
    tr = run(cfg)
    assert tr.head is None
    rec = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[-1])
    assert "head/loss" not in rec and "drafter/head/proposed" in rec


def test_ranks_train_the_head_in_their_bubble(tmp_path):
    """head_training: bubble on 2 ranks: the rank that finishes first spends its idle time on head
    gradients from the hidden states its sequences left in the engine; one all-reduced step after the
    sync keeps both ranks' heads identical. Repeatable mode (bubble_token_budget): every rank trains on
    all it recorded, whenever the others finish, so the test does not hang on timing."""
    import torch.multiprocessing as mp
    cfg = tiny_cfg(tmp_path, rollout__speculative=HEAD, speculation__head_training="bubble", grpo__num_steps=3,
                   grpo__prompts_per_step=4, speculation__bubble_token_budget=8)
    mp.spawn(_bubble_rank, args=(str(tmp_path), cfg), nprocs=2, join=True)
    out = [torch.load(tmp_path / f"head{r}.pt") for r in range(2)]
    recs = [json.loads(l) for l in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert all(r["head/positions"] > 0 and all(t > 0 for t in r["rank_bubble_train_time"]) for r in recs)
    assert all(torch.equal(v, out[1][k]) for k, v in out[0].items())    # the ranks' heads: bit for bit


def _bubble_rank(rank, tmp, cfg):
    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo", init_method=f"file://{tmp}/pg", rank=rank, world_size=2)
    from nanospec.rl.dist import cleanup
    from nanospec.rl.grpo import Trainer
    done = False
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            tr = Trainer(cfg, log=lambda *a: None)
            tr.train()
        torch.save(tr.head_drafter.head.state_dict(), f"{tmp}/head{rank}.pt")
        done = True
    finally:
        cleanup(sync=done)


def test_the_head_learns_from_at_most_head_positions_per_step():
    """speculation.head_positions caps the head's online cost: whole sequences, drawn by (seed, step, rank),
    up to the cap and never past it."""
    from types import SimpleNamespace
    from nanospec.config import config_from_dict
    from nanospec.rl.grpo import Trainer
    cfg = config_from_dict({"speculation": {"head_positions": 200}})
    me = SimpleNamespace(cfg=cfg, step=3, rank=1)
    # 4 micro-batches of 16 rows (row id in every position), 39 positions each: 2,496 positions
    batches = [(torch.arange(16 * b, 16 * b + 16)[:, None].expand(16, 40), torch.zeros(16, 40, 8), torch.ones(16, 39))
               for b in range(4)]
    kept = Trainer._head_sample(me, batches)
    n = sum(int(m.sum()) for _, _, m in kept)
    assert n == 195 and all(len(i) == len(h) == len(m) for i, h, m in kept)      # 5 whole rows: a 6th passes 200
    chosen = [int(i[r, 0]) for i, _, _ in kept for r in range(len(i))]
    assert len(set(chosen)) == 5 and all(bool((i == i[:, :1]).all()) for i, _, _ in kept)
    assert chosen == [int(i[r, 0]) for i, _, _ in Trainer._head_sample(me, batches) for r in range(len(i))]
    other = Trainer._head_sample(SimpleNamespace(cfg=cfg, step=3, rank=0), batches)
    assert chosen != [int(i[r, 0]) for i, _, _ in other for r in range(len(i))]     # each rank its own draw
    under = config_from_dict({"speculation": {"head_positions": 624}})     # one batch's 16 x 39: all kept
    assert Trainer._head_sample(SimpleNamespace(cfg=under, step=3, rank=1), batches[:1]) == batches[:1]
