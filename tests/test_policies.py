import math
import numpy as np
import pytest

from nanospec.engine.controller import DraftLengthLadder, LengthClasses, SpeculationToggle, best_k, expected_accepted, trim_drafts

from nanospec.engine.latency import LatencyModel

from nanospec.rl.scheduling import LengthPredictor, assign_to_ranks, imbalance, rank_work, round_robin

TRUE = np.array([1e-3, 2e-5, 1e-5, 3e-8, 5e-9, 2e-4])  # const, B, B*Q, B*C, B*Q*C, Q>1


def _grid(noise=0.0, seed=0):
    rng = np.random.default_rng(seed)
    return [(B, C, Q, float(LatencyModel.features(B, C, Q) @ TRUE) * (1 + noise * rng.standard_normal()))
            for B in (1, 4, 16, 64) for C in (16, 128, 512) for Q in (1, 4, 8)]


def test_latency_fit_recovers_coefficients():
    m = LatencyModel().fit(_grid())
    np.testing.assert_allclose(m.coef, TRUE, rtol=1e-6)
    assert m.predict(32, 200, 6) == pytest.approx(float(LatencyModel.features(32, 200, 6) @ TRUE))
    noisy = LatencyModel().fit(_grid(noise=0.02))
    for B, C, Q in [(1, 50, 1), (8, 300, 6), (64, 512, 8)]:
        truth = float(LatencyModel.features(B, C, Q) @ TRUE)
        assert abs(noisy.predict(B, C, Q) / truth - 1) < 0.05


def test_latency_nonnegative_monotone_and_clamped():
    # data where verify looks *cheaper* at large Q (noise / nonsense): weights stay >= 0
    samples = [(B, 100, Q, 1e-3 * B / Q) for B in (1, 8, 32) for Q in (1, 4, 8)]
    m = LatencyModel().fit(samples)
    assert np.all(m.coef >= 0)
    assert m.predict(8, 100, 8) >= m.predict(8, 100, 1) > 0
    assert LatencyModel(coef=[0, 0, 0, 0, 0, 0], min_seconds=1e-6).predict(1, 0, 1) == 1e-6


def test_latency_observe_calibrate_and_errors():
    m = LatencyModel(refit_every=8).fit(_grid())
    before = m.predict(16, 128, 1)
    for _ in range(64):                       # the machine got 2x slower for plain decodes at B=16
        m.observe(16, 128, 1, 2 * float(LatencyModel.features(16, 128, 1) @ TRUE))
    assert m.predict(16, 128, 1) > 1.5 * before
    calls = []
    def time_fn(B, C, Q):
        calls.append((B, C, Q))
        return float(LatencyModel.features(B, C, Q) @ TRUE) * (3.0 if len(calls) % 3 == 1 else 1.0)
    c = LatencyModel()
    samples = c.calibrate(time_fn, [(B, C, Q) for B in (1, 8, 64) for C in (32, 256) for Q in (1, 5)], repeats=3)
    assert len(calls) == 36 and len(samples) == 12
    np.testing.assert_allclose(c.coef, TRUE, rtol=1e-5)  # median drops the slow warm-up call
    with pytest.raises(RuntimeError, match="not fitted"):
        LatencyModel().predict(1, 1, 1)
    with pytest.raises(ValueError, match="seconds"):
        LatencyModel().fit([(1, 10, 1, -1.0)])
    with pytest.raises(ValueError, match="samples"):
        LatencyModel().fit([])


def test_expected_accepted():
    assert expected_accepted(0.0, 5) == 0.0
    assert expected_accepted(1.0, 5) == 5.0
    assert expected_accepted(0.5, 3) == pytest.approx(0.875)
    a, k = 0.8, 6
    assert expected_accepted(a, k) == pytest.approx((1 - a ** (k + 1)) / (1 - a) - 1)
    with pytest.raises(ValueError, match="alpha"):
        expected_accepted(1.5, 3)


def test_toggle_threshold_and_batch_dependence():
    lat = LatencyModel(coef=[1, 0, 1, 0, 0, 0])  # t = 1 + B*Q: B=1 -> t_ar=2, t_verify(k=1)=3
    tog = SpeculationToggle(lat, min_speedup=1.25)
    assert tog.choose(1, 10, 1, 0.875, 0.0) == (1, 1.25)     # (0.875 + 1) * 2 / 3 == 1.25 exactly: on
    k, s = tog.choose(1, 10, 1, 0.87, 0.0)
    assert k == 0 and s < 1.25                               # just below: off
    assert tog.choose(1, 10, 3, 1.0, 0.0) == (3, pytest.approx(1.6))         # pays at batch 1 ...
    assert tog.choose(64, 10, 3, 1.0, 0.0) == (0, pytest.approx(4 * 65 / 257))   # ... not at batch 64
    assert tog.choose(1, 10, 3, 1.0, 2.0)[0] == 0           # a slow drafter turns it off
    st = tog.stats()
    assert st["toggle_steps"] == 5 and st["toggle_on_steps"] == 2 and st["toggle_on_fraction"] == 0.4
    assert best_k(lat, 1, 10, 0.9) == (3, pytest.approx(3.439 * 2 / 5))
    # choose(): the cost-optimal length up to the ladder's rung, 0 where even k=1 does not pay
    assert tog.choose(1, 10, 8, 0.9, 0.0) == (3, pytest.approx(3.439 * 2 / 5))
    assert tog.choose(1, 10, 2, 0.9, 0.0) == (2, pytest.approx(2.71 * 2 / 4))
    assert tog.choose(64, 10, 8, 0.9, 0.0) == (0, pytest.approx(1.9 * 65 / 129))


def test_ladder_hysteresis_and_bounds():
    lad = DraftLengthLadder(window=10)
    assert lad.current("ngram") == 3 and lad.acceptance_rate("ngram") is None
    high = lambda: [lad.update("ngram", 5, 5) for _ in range(2)]   # one window, rate 1.0
    low = lambda: lad.update("ngram", 10, 5)                       # 5 / (5 + 1) = 0.83
    mid = lambda: lad.update("ngram", 10, 9)                       # 9 / 10 = 0.9
    high()
    assert lad.current("ngram") == 3 and lad.acceptance_rate("ngram") == 1.0
    high()
    assert lad.current("ngram") == 5
    high(); mid(); high()                      # streak broken by a middle window
    assert lad.current("ngram") == 5 and lad.acceptance_rate("ngram") == 1.0
    high()
    assert lad.current("ngram") == 7
    low(); mid(); low()
    assert lad.current("ngram") == 7
    low()
    assert lad.current("ngram") == 5 and lad.acceptance_rate("ngram") == pytest.approx(5 / 6)
    for _ in range(20):
        high()
    assert lad.current("ngram") == 11
    for _ in range(20):
        low()
    assert lad.current("ngram") == 3
    assert lad.current("suffix") == 3          # per drafter
    lad.update("suffix", 40, 30, rejected=2)   # summed counts: 30 / 32
    assert lad.acceptance_rate("suffix") == pytest.approx(30 / 32)
    assert DraftLengthLadder(start=2).current("x") == 7
    for bad in [dict(ladder=(5, 3)), dict(up=0.8, down=0.9), dict(window=0), dict(start=5)]:
        with pytest.raises(ValueError):
            DraftLengthLadder(**bad)
    with pytest.raises(ValueError, match="accepted"):
        lad.update("x", 3, 4)


def test_length_predictor_prior_history_and_state():
    p = LengthPredictor(prior=50.0, decay=0.5)
    assert p.predict("a") == 50.0
    p.observe("a", [10, 20, 5], prompt_len=8)  # group max
    assert p.predict("a") == 20.0 and p.predict("new", 30) == 20.0   # one prompt length: the mean
    p.observe("a", [40], prompt_len=8)
    p.observe("b", [100], prompt_len=20)
    assert p.predict("a") == 30.0              # EMA 0.5 * 20 + 0.5 * 40
    # unseen prompts: the least-squares line through (8, 20), (8, 40), (20, 100) passes through the
    # mean at each length, (8, 30) and (20, 100): slope 70/12
    assert p.predict("new", 14) == pytest.approx(30 + 6 * 70 / 12) and p.predict("new", 0) == 0.0
    q = LengthPredictor()
    q.load_state_dict(p.state_dict())
    assert q.predict("a") == 30.0 and q.predict("zz", 11) == p.predict("zz", 11)
    assert LengthPredictor(reduce="mean").predict("x") == 64.0
    m = LengthPredictor(reduce="mean"); m.observe(1, [2, 4])
    assert m.predict(1) == 3.0
    with pytest.raises(ValueError, match="reduce"):
        LengthPredictor(reduce="median")
    with pytest.raises(ValueError, match="prompt_len"):
        m.observe(2, [3], prompt_len=-1)
    with pytest.raises(ValueError, match="state"):
        q.load_state_dict({"prior": 1.0})


def test_length_predictor_balances_new_prompts_by_prompt_length():
    """Embedded task: answer = 4k+2 tokens, prompt = 2k+1 words. After one step of history, *new*
    prompts are predicted from their length, and LPT on those predictions beats a blind split."""
    from nanospec.tasks import SyntheticTask
    task = SyntheticTask(seed=0)
    seen, new = task.train(32), task.train(96)[32:]
    p = LengthPredictor()
    for i, pr in enumerate(seen):
        p.observe(("seen", i), [4 * len(pr.steps) + 2], prompt_len=len(pr.prompt.split()))
    pred = [p.predict(("new", i), len(pr.prompt.split())) for i, pr in enumerate(new)]
    true = [4 * len(pr.steps) + 2 for pr in new]
    assert pred == pytest.approx(true, abs=1e-6)
    contiguous = [list(range(r * 16, r * 16 + 16)) for r in range(4)]
    blind = [imbalance(rank_work(true, split)) for split in (round_robin(64, 4), contiguous)]
    lpt = imbalance(rank_work(true, assign_to_ranks(pred, 4)))
    assert lpt < 1.02 < 1.05 < min(blind)      # measured: 1.011 vs round-robin 1.24, contiguous 1.07


def test_lpt_balances_long_tail_better_than_round_robin():
    rng = np.random.default_rng(0)
    work = list(np.minimum(rng.pareto(1.2, 64) * 8 + 1, 400))   # heavy-tailed lengths
    lpt, rr = assign_to_ranks(work, 4), round_robin(64, 4)
    assert sorted(i for r in lpt for i in r) == list(range(64))
    assert all(len(r) == 16 for r in lpt)
    assert imbalance(rank_work(work, lpt)) < imbalance(rank_work(work, rr))
    assert assign_to_ranks(work, 4) == lpt                       # deterministic
    assert assign_to_ranks([1.0] * 4, 2) == [[0, 2], [1, 3]]     # ties: lower index, lower rank
    # cardinality: one huge prompt must not leave its rank with fewer prompts
    assert [len(r) for r in assign_to_ranks([100, 1, 1, 1, 1, 1], 2)] == [3, 3]
    assert imbalance([2.0, 2.0]) == 1.0 and imbalance([3.0, 1.0]) == 1.5
    with pytest.raises(ValueError, match="divisible"):
        assign_to_ranks([1.0] * 5, 2)


def test_length_classes_mapping_validation_and_cost_model():
    lc = LengthClasses((32, 128), (0, 4, 8))
    assert [lc.class_of(x) for x in (0, 31, 32, 127, 128, 1000)] == [0, 0, 1, 1, 2, 2]
    assert [lc.budget(x) for x in (5, 64, 500)] == [0, 4, 8]
    with pytest.raises(ValueError, match="budgets"):
        LengthClasses([32, 128], [0, 4])
    with pytest.raises(ValueError, match="thresholds"):
        LengthClasses([128, 32], [0, 4, 8])
    with pytest.raises(ValueError, match="budgets"):
        LengthClasses([32], [0, -1])
    # t = 1 + B*Q: at batch 64 no k pays; at batch 4 only k=1 (1.9*5/9 = 1.056); at batch 1 k=3 best
    lat = LatencyModel(coef=[1, 0, 1, 0, 0, 0])
    derived = LengthClasses.from_cost_model(lat, [32, 128], [64, 4, 1], [16, 80, 200], alpha=0.9)
    assert derived.budgets == (0, 1, 3)
    # for_engine: the typical step of each class, batch 64 / 16 / 4 (4x smaller per class)
    assert LengthClasses.for_engine(lat, [32, 128], 64, alpha=0.9).budgets == (0, 0, 1)
    assert LengthClasses.for_engine(lat, [32, 128], 4, alpha=0.9).budgets == (1, 3, 3)
    with pytest.raises(ValueError, match="batch_sizes"):
        LengthClasses.from_cost_model(lat, [32, 128], [64, 1], [16, 200], alpha=0.9)


def test_policy_toggles_each_drafter_on_its_own_acceptance_and_probes_with_backoff():
    """A good and an always-wrong drafter in one batch: the toggle keeps the good one's drafts, cuts
    the bad one's rows to 0 except `probe_rows` rows on probe steps, spaced 2, 4, 8, 8 steps apart;
    once nothing pays, nothing is drafted at all."""
    from nanospec.drafters.base import Proposal
    from nanospec.engine.controller import DraftController
    lat = LatencyModel(coef=[1, 0, 0.01, 0, 0, 0])       # t = 1 + 0.01*B*Q: B=8, k=4 verify 1.32x a decode
    pol = DraftController(toggle=SpeculationToggle(lat, 1.05), probe_every=2, probe_every_max=8, probe_rows=1)
    seqs = [type("S", (), {"num_completion_tokens": 5, "__len__": lambda self: 20})() for _ in range(8)]
    for _ in range(64):    # enough evidence that even the optimistic bound (one standard error up) is off
        pol.observe_acceptance("good", 4, 4)
        pol.observe_acceptance("bad", 4, 0)
    assert pol.alpha("good") == 1.0 and pol.alpha("bad") == 0.0 and pol.alpha("new") == 0.8
    sources = ["good", "bad"] * 4
    kept = []
    for step in range(16):
        ks = pol.budgets(seqs, 4)
        assert ks == [4] * 8
        out = pol.clip(Proposal([[1, 2, 3, 4]] * 8, sources=list(sources)), ks, seqs).tokens
        assert all(len(t) == 4 for t in out[0::2])                    # good drafter untouched
        kept.append(sum(len(t) > 0 for t in out[1::2]))
    assert kept == [0, 1, 0, 0, 0, 1] + [0] * 7 + [1, 0, 0]      # probes after gaps 2, 4, 8, 8 (max)
    assert pol.stats()["spec_on_frac"] == 1.0
    pol = DraftController(toggle=SpeculationToggle(lat, 1.05), sources=["weak"])
    for accepted, rows in ((0, 170), (1, 26), (2, 4)):        # i.i.d. acceptance ~0.15 per position
        for _ in range(rows):
            pol.observe_acceptance("weak", 4, accepted)
    assert pol.acceptance.rates("weak")[:2] == [pytest.approx(0.15, abs=0.02), pytest.approx(0.13, abs=0.03)]
    assert pol.budgets(seqs, 4) == [1] * 8      # one draft token still pays (1.08x), four would not
    pol.toggle.min_speedup = 1.15               # nor does one, even at the optimistic bound (1.11x)
    pol.reset_stats()
    assert pol.budgets(seqs, 4) == [0] * 8 and pol.stats()["spec_on_frac"] == 0.0   # nothing pays: no drafting
    with pytest.raises(ValueError, match="probe_every"):
        DraftController(probe_every=0)


def test_probes_of_a_drafter_with_its_own_kv_wait_for_fresh_rows():
    """An off self-drafter / draft model whose catch-up cannot be priced (no draft latency model here) is
    probed only on rows whose drafter KV is current: catching up on 30 tokens is a forward over all of
    them. A due probe waits for fresh rows (here: requests just prefilled) and then drafts 2 tokens on
    `probe_rows` of them."""
    from nanospec.engine.controller import DraftController
    lat = LatencyModel(coef=[1, 0, 0.01, 0, 0, 0])
    pol = DraftController(toggle=SpeculationToggle(lat, 1.05), probe_every=2, probe_every_max=8,
                          probe_rows=2, sources=["self"], kv_sources=["self"])
    for _ in range(64):
        pol.observe_acceptance("self", 4, 0)
    row = lambda n, done: type("S", (), {"num_completion_tokens": 5, "__len__": lambda self: n,
                                         "num_draft_computed": done})()
    stale = [row(40, 10) for _ in range(6)]
    assert all(pol.budgets(stale, 4) == [0] * 6 for _ in range(12))     # due probes wait
    fresh = stale[:3] + [row(21, 20), row(23, 20), row(21, 20)]
    assert pol.budgets(fresh, 4) == [0, 0, 0, 2, 0, 2]            # the two rows of lag 1, 2 tokens each
    plain = DraftController(toggle=SpeculationToggle(lat, 1.05), probe_every=2, probe_rows=2, sources=["ngram"])
    for _ in range(64):
        plain.observe_acceptance("ngram", 4, 0)
    assert [plain.budgets(stale, 4) for _ in range(2)][-1] == [4, 4, 0, 0, 0, 0]   # no KV: any rows


def test_a_probe_catches_a_kv_drafter_up_within_the_time_it_waited():
    """A due probe may spend 1/probe_every of the target time it waited on catching a KV drafter up on a
    lagging row (at batch 1 no row is ever fresh): a cheap draft model (catch-up 0.04 s) probes the
    stale row when due, a costly one (3.5 s) once the wait has earned it (7 steps of 1.01 s / 2), and
    a postponed probe does not double the gap."""
    from nanospec.engine.controller import DraftController
    lat = LatencyModel(coef=[1, 0, 0.01, 0, 0, 0])

    def probe_steps(draft_coef):
        pol = DraftController(toggle=SpeculationToggle(lat, 1.05), probe_every=2, probe_every_max=64, probe_rows=1,
                              sources=["self"], kv_sources=["self"], draft_latency=LatencyModel(coef=draft_coef))
        for _ in range(200):
            pol.observe_acceptance("self", 4, 0)
        row = type("S", (), {"num_completion_tokens": 5, "__len__": lambda self: 40, "num_draft_computed": 10})()
        return [i for i in range(16) if pol.budgets([row], 4) == [2]]      # a probe drafts 2 tokens
    assert probe_steps([0.01, 0, 0.001, 0, 0, 0]) == [1, 5, 13]     # due after 2, 4, 8 steps
    assert probe_steps([0.5, 0, 0.1, 0, 0, 0]) == [6, 13]           # waits until 7 steps have passed


def test_a_drafter_too_slow_to_pay_even_when_always_right_is_never_probed_nor_prefilled():
    """Probes measure acceptance; a model drafter whose own forwards cost more than verifying could save
    (drafting 1 token costs 3 decodes here) stays off without probes, while a cheap one is probed."""
    from nanospec.engine.controller import DraftController
    lat = LatencyModel(coef=[1, 0, 0.01, 0, 0, 0])
    slow = DraftController(toggle=SpeculationToggle(lat, 1.05), probe_every=2, probe_rows=2, sources=["self"],
                           draft_latency=LatencyModel(coef=[3, 0, 0, 0, 0, 0]))
    cheap = DraftController(toggle=SpeculationToggle(lat, 1.05), probe_every=2, probe_rows=2, sources=["self"],
                            draft_latency=LatencyModel(coef=[0.01, 0, 0, 0, 0, 0]))
    row = lambda: type("S", (), {"num_completion_tokens": 5, "__len__": lambda self: 21, "num_draft_computed": 20})()
    for pol in (slow, cheap):
        for _ in range(64):
            pol.observe_acceptance("self", 4, 0)                 # always wrong so far: toggled off
    assert all(slow.budgets([row() for _ in range(4)], 4) == [0] * 4 for _ in range(16))
    assert any(any(cheap.budgets([row() for _ in range(4)], 4)) for _ in range(16))
    # nor does it keep its own KV for new prompts: that prefill could never be won back
    slow.kv_sources = cheap.kv_sources = {"self"}
    assert not slow.keeps_draft_kv(20, 4) and cheap.keeps_draft_kv(20, 4)


def test_ladder_rungs_never_exceed_num_draft_tokens():
    """num_draft_tokens is the engine's bound on drafts per step: a ladder that has climbed past it
    (or starts above it) drafts at most that many, as vLLM's num_speculative_tokens."""
    from nanospec.drafters.base import Proposal
    from nanospec.engine.controller import DraftController
    pol = DraftController(ladder=DraftLengthLadder((3, 5, 7, 9, 11), start=4), sources=["suffix"])
    seqs = [type("S", (), {"num_completion_tokens": 5, "__len__": lambda self: 20})() for _ in range(4)]
    assert pol.budgets(seqs, 6) == [6] * 4 and pol.budgets(seqs, 12) == [11] * 4
    out = pol.clip(Proposal([list(range(9))] * 4, sources=["suffix"] * 4), pol.budgets(seqs, 6), seqs).tokens
    assert [len(t) for t in out] == [6] * 4


def test_trim_drafts_maximises_expected_tokens_per_second():
    """Against brute force over every choice of per-row prefix: the greedy cut is the E/T optimum."""
    import itertools
    rng = np.random.default_rng(0)
    for _ in range(200):
        B = int(rng.integers(1, 4))
        probs = [list(np.cumprod(rng.uniform(0.2, 1.0, int(rng.integers(0, 4))))) for _ in range(B)]
        E0, T0, c = float(B), float(rng.uniform(0.5, 2)), float(rng.uniform(0.01, 0.6))
        f = float(rng.choice([0.0, rng.uniform(0, 1)]))     # the verify step's fixed overhead
        def rate(ks):
            return (E0 + sum(sum(p[:k]) for p, k in zip(probs, ks))) / (T0 + c * sum(ks) + f * (sum(ks) > 0))
        best = max(rate(ks) for ks in itertools.product(*[range(len(p) + 1) for p in probs]))
        assert rate(trim_drafts(probs, E0, T0, c, f)) == pytest.approx(best, rel=1e-12)
    assert trim_drafts([[0.9, 0.8, 0.3], [0.4]], 2.0, 1.0, 0.2) == [2, 0]   # 0.4 * 1.4 < 0.2 * 3.7
    assert trim_drafts([[0.9, 0.8, 0.3], [0.4]], 2.0, 1.0, 0.0) == [3, 1]   # free verify: keep all
    assert trim_drafts([[0.9]], 1.0, 1.0, 0.1, 1.0) == [0]     # 1.9 tokens in 2.1 s < 1 token in 1 s


def test_policy_trims_confident_drafts_per_token():
    """With a toggle, rows carrying confidence keep only the drafts that pay this step: a full batch
    of a compute-bound machine keeps a sure run and drops a doubtful one; a lone straggler keeps
    both. Greedy rows are not trimmed (their acceptance is the argmax, not p). A confident source is
    not switched off as a whole by its measured rate (budgets keep its rung): its rows decide token
    by token, and a sure-but-always-wrong one is trimmed away once the calibration has learned it."""
    from types import SimpleNamespace
    from nanospec.drafters.base import Proposal
    from nanospec.engine.controller import DraftController
    lat = LatencyModel(coef=[1, 0, 0.02, 0, 0, 0])    # step 1 + 0.02 * tokens: a token is 2% of a decode at B=1
    pol = DraftController(toggle=SpeculationToggle(lat, 1.05), confident_sources=["suffix"])
    for _ in range(8):
        pol.observe_acceptance("suffix", 4, 0)        # measured rate 0: would be toggled off
    sure, doubtful = [0.99] * 4, [0.9, 0.6, 0.6, 0.6]        # cumulative: 0.96 vs 0.9, 0.54, 0.32, 0.19
    for B, want in [(64, [4, 1]), (2, [4, 4])]:
        seqs = [type("S", (), {"num_completion_tokens": 5, "params": SimpleNamespace(temperature=1.0),
                               "__len__": lambda self: 20})() for _ in range(B)]
        ks = pol.budgets(seqs, 4)
        assert ks == [4] * B
        conf = [sure, doubtful] + [None] * (B - 2)
        prop = Proposal([[1, 2, 3, 4]] * 2 + [[]] * (B - 2), sources=["suffix"] * 2 + [""] * (B - 2), confidence=conf)
        assert [len(t) for t in pol.clip(prop, ks, seqs).tokens[:2]] == want
    seqs[1].params = SimpleNamespace(temperature=0.0)
    prop = Proposal([[1, 2, 3, 4]] * 2, sources=["suffix"] * 2, confidence=[sure, [0.01] * 4])
    assert [len(t) for t in pol.clip(prop, pol.budgets(seqs, 4), seqs).tokens] == [4, 4]
    # a drafter sure of itself and always wrong: calibration learns it, a full batch drafts nothing
    for _ in range(100):
        pol.observe_acceptance("suffix", 4, 0, confidence=sure)
    seqs = [type("S", (), {"num_completion_tokens": 5, "params": SimpleNamespace(temperature=1.0),
                           "__len__": lambda self: 20})() for _ in range(64)]
    prop = Proposal([[1, 2, 3, 4]] * 64, sources=["suffix"] * 64, confidence=[sure] * 64)
    assert not any(pol.clip(prop, pol.budgets(seqs, 4), seqs).tokens)


def test_class_budgets_cap_unrated_drafts_and_leave_rated_ones_to_the_toggle():
    """Length-class budgets cap every row without a toggle, and with one the rows of drafters that do
    not rate their tokens; rated drafts (prior, suffix) are cut by the per-token trim instead."""
    from nanospec.engine.controller import LengthClasses, DraftController
    classes = LengthClasses([18], [1, 3])
    seqs = [type("S", (), {"num_completion_tokens": 5, "predicted_len": 10, "__len__": lambda self: 20})()
            for _ in range(2)]
    toggle = lambda: SpeculationToggle(LatencyModel(coef=[1, 0, 0.02, 0, 0, 0]), 1.05)
    assert DraftController(classes=classes, sources=["prior"], confident_sources=["prior"]).budgets(seqs, 8) == [1, 1]
    assert DraftController(classes=classes, toggle=toggle(), sources=["prior", "suffix"],
                           confident_sources=["prior", "suffix"]).budgets(seqs, 8) == [8, 8]
    assert DraftController(classes=classes, toggle=toggle(), sources=["prior", "self"],
                           confident_sources=["prior"]).budgets(seqs, 8) == [1, 1]


def test_confidence_calibration_learns_measured_acceptance_per_position_and_bin():
    """Raw confidence until a cell has data; then the measured acceptance of the tokens that were
    tested (up to the first rejection), per source, draft position and confidence bin."""
    from nanospec.engine.controller import ConfidenceCalibration
    cal = ConfidenceCalibration(bins=10, positions=4, prior_weight=8.0)
    assert cal("suffix", 0, 0.55) == 0.55
    rng = np.random.default_rng(0)
    for _ in range(2000):   # first draft 0.99 accepted 90%, second 0.99 accepted 30%, third 0.55 always
        a = 1 if rng.random() < 0.9 else 0
        a += a == 1 and rng.random() < 0.3
        a += a == 2
        cal.observe("suffix", [0.99, 0.99, 0.55], a)
    assert cal("suffix", 0, 0.98) == pytest.approx(0.9, abs=0.03)
    assert cal("suffix", 1, 0.98) == pytest.approx(0.3, abs=0.05)     # same bin, other position
    assert cal("suffix", 2, 0.52) == pytest.approx(1.0, abs=0.05)     # tested only after 2 accepted
    assert cal("suffix", 7, 0.98) == 0.98 and cal("prior", 0, 0.55) == 0.55   # no data there: raw
    cal.observe("prior", [0.5, 0.5], 2)
    assert cal("prior", 1, 0.5) == pytest.approx((1 + 8 * 0.5) / (1 + 8))


def test_best_k_prices_a_model_drafter_per_draft_token():
    """A drafter with its own model pays one forward per draft token: that shortens the best k."""
    lat = LatencyModel(coef=[1, 0, 0.01, 0, 0, 0])      # B=1: verify of k tokens ~ a decode (overhead-bound)
    assert best_k(lat, 1, 10, 0.9, max_k=8)[0] == 8                                    # free drafts
    k, s = best_k(lat, 1, 10, 0.9, max_k=8, draft_time_per_token=0.25)                 # each 1/4 decode
    assert 1 < k < 8 and s == pytest.approx(max(
        (1 + sum(0.9 ** i for i in range(1, j + 1))) * 1.01 / (0.25 * j + 1 + 0.01 * (j + 1)) for j in range(1, 9)))
    assert best_k(lat, 1, 10, 0.9, max_k=8, draft_time_per_token=2.0)[1] < 1           # too slow: never pays


def test_speedup_guard_suspends_speculation_that_measures_slower_than_plain_decoding():
    from nanospec.engine.controller import SpeedupGuard
    g = SpeedupGuard(min_steps=4, gap=3, max_gap=6, decay=1.0, min_speedup=1.0)
    for _ in range(30):
        g.observe(False, 1.1, 1.0, 1.0)              # plain steps measure 10% above the model
    assert g.ar_bias == pytest.approx(1.1, rel=0.01)
    for _ in range(4):                               # 1.5 tokens per row in 1.5 s: 1.1x plain decoding
        assert g.allows()
        g.observe(True, 1.5, 1.0, 1.5)
    assert g.trips == 0 and g.realized_speedup() == pytest.approx(1.1, rel=0.01)
    g._restart()
    for _ in range(4):                               # 1.2 tokens per row in 1.5 s: slower than plain
        assert g.allows()
        g.observe(True, 1.5, 1.0, 1.2)
    assert g.trips == 1
    assert [g.allows() for _ in range(4)] == [False] * 3 + [True]      # suspended for `gap` steps
    for _ in range(4):
        g.observe(True, 1.5, 1.0, 1.2)
    assert g.trips == 2 and sum(not g.allows() for _ in range(8)) == 6  # the gap doubled (capped at 6)
    g.reset()                                        # a new rollout step: counters reset, backoff kept
    assert g.allows() and g.trips == 0 and g.gap == 6
    with pytest.raises(ValueError, match="gap"):
        SpeedupGuard(gap=0)


def test_llm_is_adaptive_by_default_and_fixed_k_on_request(tmp_path, monkeypatch):
    """LLM(speculative=...) builds the cost-model controller itself (profile cached on disk); with an
    always-wrong drafter it stops drafting after a few verify steps, where controller=None keeps
    drafting k per step. Outputs are the same either way."""
    from conftest import make_hf_model
    from nanospec import LLM, SamplingParams
    from nanospec.drafters.base import Drafter, Proposal
    from nanospec.engine.controller import DraftController
    monkeypatch.setenv("NANOSPEC_CACHE", str(tmp_path / "cache"))
    d, _ = make_hf_model(tmp_path / "m", vocab_size=64, max_pos=128)

    class Wrong(Drafter):                            # drafts the token after the target's argmax: never right
        name = "wrong"

        def propose(self, seqs, ks):
            return Proposal([[(s.last_token + 1) % 64] * k for s, k in zip(seqs, ks)], sources=["wrong"] * len(seqs))
    sp = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    prompts = [[1, 2, 3], [4, 5]]
    ar = [o.token_ids for o in LLM(d, max_model_len=64).generate(prompts, sp, use_tqdm=False)]
    runs = {}
    for controller in ("auto", None):
        llm = LLM(d, max_model_len=64, controller=controller, speculative={"method": "ngram", "num_draft_tokens": 4})
        llm.drafter = Wrong()
        if controller == "auto":    # off the clock: a verify token costs 10% of a decode, each step is what
            llm.controller.toggle.latency = LatencyModel(coef=[1, 0, 0.1, 0, 0, 0.05])  # the model says
            llm.controller.replay = True
        assert [o.token_ids for o in llm.generate(prompts, sp, use_tqdm=False)] == ar
        runs[controller] = llm
    auto, fixed = runs["auto"], runs[None]
    assert isinstance(auto.controller, DraftController) and auto.controller.toggle is not None
    assert auto.controller.ladder is None and auto.controller.classes is None and fixed.controller is None
    # the optimistic bound drafts until the evidence is in: break-even acceptance is 0.21 at k=1 here,
    # and the bound (prior 0.8) falls below it after ~25 rejected drafts (the cheaper a draft, the more
    # evidence it takes)
    assert fixed.stats["proposed_tokens"] >= 4 * 39 and auto.stats["proposed_tokens"] <= 40
    auto.reset_stats()
    assert [o.token_ids for o in auto.generate(prompts, sp, use_tqdm=False)] == ar
    assert auto.stats["proposed_tokens"] <= 16      # then only probes, at gaps that keep doubling
    assert len(list((tmp_path / "cache" / "profiles").glob("*.json"))) == 1
    monkeypatch.setattr(LLM, "time_forward", lambda *a, **k: pytest.fail("profiled again despite the cache"))
    LLM(d, max_model_len=64, speculative={"method": "ngram", "num_draft_tokens": 4})
    with pytest.raises(ValueError, match="controller: expected 'auto', None"):
        LLM(d, max_model_len=64, controller="on", speculative={"method": "ngram", "num_draft_tokens": 4})
    # a checkpoint keeps the controller's state; one from an earlier layout is dropped with a warning
    from nanospec.rl.checkpoint import engine_state, load_engine_state
    auto.drafter = fixed.drafter = fixed.controller = None
    state, rate = engine_state(auto), auto.controller.alpha("wrong")
    auto.controller.reset_stats()
    auto.controller.acceptance.counts.clear()
    load_engine_state(auto, state)
    assert auto.controller.alpha("wrong") == rate < 0.5
    with pytest.warns(UserWarning, match="earlier nanospec"):
        load_engine_state(fixed, {k: v for k, v in state.items() if k != "version"})


def test_a_replayed_profile_makes_the_controller_ignore_the_clock(tmp_path):
    """speculation.latency_profile: the same tokens give the same choices however long steps take."""
    import json
    from nanospec.engine.controller import DraftController
    from nanospec.engine.latency import replayed_profile
    path = tmp_path / "profile.json"
    path.write_text(json.dumps({"samples": _grid(), "draft_seconds_per_seq": 1e-4}))
    seqs = [type("S", (), {"__len__": lambda self: 40, "predicted_len": 0, "num_completion_tokens": 0})()
            for _ in range(2)]

    def run(clock):
        lat, _, per_seq = replayed_profile(path)
        pol = DraftController(toggle=SpeculationToggle(lat, 1.05), sources=["ngram"], probe_every=2,
                              replay=True, draft_time=per_seq)
        for step, seconds in enumerate(clock):
            ks = pol.budgets(seqs, 4)
            pol.observe_draft_time(seconds / 3, 2, 40.0)
            pol.observe_forward(seqs, [[1] + [2] * k for k in ks], seconds, emitted=sum(ks) // 2 + 2)
            pol.observe_acceptance("ngram", max(ks), step % 3)
        return ks, pol.stats(), lat.coef.tolist(), pol.guard.ar_bias
    assert run([0.001] * 40) == run([0.5, 0.0001] * 20)
    assert replayed_profile(path)[0].coef == pytest.approx(TRUE, rel=1e-6)
    path.write_text(json.dumps({"samples": _grid()}))
    with pytest.raises(ValueError, match=r"latency_profile: .*profile.json.*draft_samples"):
        replayed_profile(path, draft=True)


def test_per_position_acceptance_prices_later_drafts_and_thin_evidence_is_retried():
    """Acceptance rising along a draft (a first token often wrong, the rest right once it is) makes long
    drafts pay where one pooled rate would stop early; and a drafter seen rejected only a few times is
    kept drafting (its upper bound pays) until the evidence says off."""
    from nanospec.engine.controller import PositionalAcceptance
    acc = PositionalAcceptance(prior=0.8)
    for accepted in [0] * 20 + [4] * 30:              # position 0: 60%; positions 1-3: always
        acc.observe("model", 4, accepted)
    rates = acc.rates("model")                        # shrunk toward the prior / the position before
    assert rates[0] == pytest.approx(0.6, abs=0.02) and min(rates[1:]) > 0.95
    assert acc.pooled("model") == pytest.approx(120 / 140)
    assert expected_accepted(rates, 4) == pytest.approx(sum(rates[0] * math.prod(rates[1:j]) for j in range(1, 5)))
    lat = LatencyModel(coef=[1, 0, 0, 0, 0, 0])      # verify costs a decode; a draft token 0.3 of one
    assert best_k(lat, 1, 0, rates, max_k=8, draft_time_per_token=0.3)[0] == 8
    assert best_k(lat, 1, 0, acc.pooled("model"), max_k=8, draft_time_per_token=0.3)[0] == 4
    toggle = SpeculationToggle(LatencyModel(coef=[1, 0, 0, 0, 0, 0.5]), 1.0)   # a verify: 1.5 decodes
    for rejections, on in ((6, True), (60, False)):
        acc = PositionalAcceptance(prior=0.8)
        for _ in range(rejections):
            acc.observe("model", 4, 0)
        assert toggle.choose(1, 0, 8, acc.rates("model"), 0.0)[0] == 0      # the mean says off either way
        k, _ = toggle.choose(1, 0, 8, acc.rates("model"), 0.0, optimistic=lambda: acc.rates("model", optimism=1.0))
        assert (k > 0) == on


def test_profile_shapes_fit_the_pool_and_keep_the_full_grid_when_it_fits():
    """The start-up profile's shapes: the whole grid on a pool that holds it (so every bench and run on
    a large pool profiles exactly as before), and only shapes whose B * (C + Q) tokens fit otherwise."""
    from nanospec.engine.latency import profile_shapes
    full = profile_shapes(64, 4096, 10_000, 16, (1, 4, 8))
    assert full == [(B, C, Q) for B in (1, 8, 32) for C in (32, 64) for Q in (1, 4, 8)]
    for blocks, bs, max_len, seqs in [(40, 16, 4096, 32), (8, 16, 128, 64), (200, 4, 4096, 64), (3, 1, 24, 8)]:
        shapes = profile_shapes(seqs, max_len, blocks, bs, (1, 4, 8))
        assert shapes and shapes[0][0] == 1                      # a pool always profiles batch 1
        for B, C, Q in shapes:
            assert B <= seqs and B * -(-(C + Q) // bs) <= blocks, (blocks, bs, B, C, Q)
    # 40 blocks of 16: 32 rows hold one block each, so B = 32 is timed at the longest context that fits
    assert [(B, C) for B, C, Q in profile_shapes(32, 4096, 40, 16, (1, 4, 8)) if B == 32] == [(32, 8)] * 3
