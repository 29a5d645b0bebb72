"""Config: every shipped YAML loads, overrides, YAML round trip, and each validation error's message."""
import re
import warnings
from pathlib import Path

import pytest
import yaml

from nanospec.config import (SECTIONS, Config, config_from_dict, config_to_dict, load_config, save_config, validate_world)

CONFIGS = sorted((Path(__file__).resolve().parents[1] / "configs").glob("*.yaml"))
DEFAULT = str(Path(__file__).resolve().parents[1] / "configs" / "default.yaml")


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_every_config_loads(path):
    cfg = load_config(path)
    assert isinstance(cfg, Config) and set(config_to_dict(cfg)) == set(SECTIONS)
    validate_world(cfg, 1)


def test_default_yaml_sets_only_what_differs_from_the_dataclass_defaults():
    """One source of truth: a default lives in config.py; default.yaml states only departures from it."""
    stated, defaults = yaml.safe_load(Path(DEFAULT).read_text()), config_to_dict(Config())
    same = [f"{sec}.{k}" for sec, keys in stated.items() for k, v in keys.items() if defaults[sec][k] == v]
    assert not same, f"default.yaml restates defaults: {same}"


def test_shipped_configs_content():
    assert {p.name for p in CONFIGS} >= {"default.yaml", "ar.yaml", "gsm8k_qwen3.yaml"}
    d, ar = load_config(DEFAULT), load_config(Path(DEFAULT).with_name("ar.yaml"))
    assert [s["method"] for s in d.rollout.speculative] == ["prior", "suffix"]
    assert d.speculation.bubble_drafting and d.speculation.toggle
    validate_world(d, 2)
    assert ar.rollout.speculative is None and not (ar.speculation.bubble_drafting or ar.speculation.toggle
                                                   or ar.speculation.length_classes)
    # the baseline differs only in speculation, policies and where it writes
    da, aa = config_to_dict(d), config_to_dict(ar)
    assert {s for s in SECTIONS if da[s] != aa[s]} == {"rollout", "speculation", "run"}
    assert da["sft"] == aa["sft"] and da["run"]["seed"] == aa["run"]["seed"]
    q = load_config(Path(DEFAULT).with_name("gsm8k_qwen3.yaml"))
    assert (q.task.name, q.model.path, q.rollout.device, q.rollout.dtype, q.rollout.use_cuda_graphs) == \
        ("dataset", "/path/to/Qwen3-0.6B", "cuda", "bfloat16", True)


def test_overrides_and_yaml_roundtrip(tmp_path):
    cfg = load_config(DEFAULT, ["--grpo.num_steps=3", "rollout.speculative=[{method: ngram, num_draft_tokens: 4}]",
                                "--sft.lr=1e-3", "--speculation.length_classes=[2,4]", "--grpo.epsilon_high=null",
                                "--grpo.temperature=1", "--speculation.length_class_budgets=[0,2,4]"])
    assert cfg.grpo.num_steps == 3 and cfg.sft.lr == 1e-3 and cfg.speculation.length_classes == [2, 4]
    assert cfg.rollout.speculative == [{"method": "ngram", "num_draft_tokens": 4}] and cfg.grpo.epsilon_high is None
    assert isinstance(cfg.grpo.temperature, float)
    # a str field takes the word that YAML 1.1 would read as a bool (tools/seed_table.sh's frozen arm)
    assert load_config(DEFAULT, ["--speculation.head_training=off"]).speculation.head_training == "off"
    save_config(cfg, tmp_path / "run" / "config.yaml")
    assert load_config(tmp_path / "run" / "config.yaml") == cfg
    assert yaml.safe_load(cfg.to_yaml()) == config_to_dict(cfg)
    assert config_from_dict({}) == Config()                 # dataclass defaults are valid too


def _err(overrides, match, path=DEFAULT):
    with pytest.raises(ValueError, match=match):
        load_config(path, overrides)


@pytest.mark.parametrize("override,expected", [
    ("--grpo.num_generations=1", r"grpo\.num_generations: expected an int >= 2"),
    ("--grpo.num_steps=abc", r"grpo\.num_steps: expected int, got str 'abc'"),
    ("--grpo.num_steps=2.5", r"grpo\.num_steps: expected int, got float"),
    ("--sft.lr=fast", r"sft\.lr: expected float"),
    ("--run.resume=1", r"run\.resume: expected bool, got int 1"),
    ("--model.path=3", r"model\.path: expected str or null"),
    ("--speculation.length_classes=3", r"speculation\.length_classes: expected a list of int"),
    ("--model.arch=gpt2", r"model\.arch: expected one of llama, qwen2, qwen3, got 'gpt2'"),
    ("--model.num_kv_heads=3", r"model\.num_kv_heads: expected a divisor of num_heads \(4\), got 3"),
    ("--model.hidden_size=250", r"model\.hidden_size: expected divisible by num_heads \(4\) unless head_dim is set, got 250"),
    ("--task.name=mnist", r"task\.name: expected one of synthetic, arith, dataset"),
    ("--task.reward_weights=[1.0]", r"task\.reward_weights: expected null or 0 weights, one per reward"),
    ("--run.log_to=[tensorboard]", r"run\.log_to: expected a list of jsonl \(metrics\.jsonl"),
    ("--task.max_steps=30", r"task\.max_steps: expected in \[min_steps, 26\]"),
    ("--sft.error_rate=1.5", r"sft\.error_rate: expected in \[0, 1\], got 1.5"),
    ("--grpo.top_p=0", r"grpo\.top_p: expected in \(0, 1\]"),
    ("--grpo.top_k=0", r"grpo\.top_k: expected -1 \(off\) or an int >= 1"),
    ("--grpo.epsilon_high=0.1", r"grpo\.epsilon_high: expected null or >= epsilon \(0.2\)"),
    ("--grpo.loss_type=ppo", r"grpo\.loss_type: expected one of grpo, dapo"),
    ("--grpo.tis_cap=0.5", r"grpo\.tis_cap: expected null \(off\) or a cap >= 1"),
    ("--grpo.tis_mode=clip", r"grpo\.tis_mode: expected one of truncate, mask"),
    ("--grpo.overlong_buffer=112", r"grpo\.overlong_buffer: expected an int in \[0, max_completion_length=112\), got 112"),
    ("--grpo.learning_rate=0", r"grpo\.learning_rate: expected > 0, got 0.0"),
    ("--rollout.block_size=12", r"rollout\.block_size: expected a power of 2, got 12"),
    ("--rollout.dtype=int8", r"rollout\.dtype: expected one of float32"),
    ("--rollout.device=tpu", r"rollout\.device: expected cpu, cuda or cuda:N"),
    ("--rollout.use_cuda_graphs=true", r"rollout\.use_cuda_graphs: expected false unless device is cuda"),
    ("--rollout.gpu_memory_utilization=1.5", r"rollout\.gpu_memory_utilization: expected in \(0, 1\]"),
    ("--rollout.speculative=5", r"rollout\.speculative: expected null, a \{method"),
    ("--rollout.speculative=[]", r"rollout\.speculative: expected null"),
    ("--rollout.speculative={method: magic, num_draft_tokens: 4}", r"rollout\.speculative\.method: expected one of ngram.*got 'magic'"),
    ("--rollout.speculative=[{method: ngram, num_draft_tokens: 4}, {method: suffix, num_draft_tokens: 0}]",
     r"rollout\.speculative\[1\]\.num_draft_tokens: expected an int >= 1, got 0"),
    ("--rollout.speculative=[{method: suffix}]", r"rollout\.speculative\[0\]\.num_draft_tokens: expected an int >= 1, got None"),
    ("--rollout.speculative={method: draft_model, num_draft_tokens: 4}", r"rollout\.speculative\.model: expected a draft model directory"),
    ("--rollout.speculative={method: suffix, num_draft_tokens: 4, lenience: 2}",
     r"rollout\.speculative\.lenience: expected an option of suffix: one of method, num_draft_tokens, depth"),
    ("--speculation.length_classes=[48,96]", r"speculation\.length_classes: expected \[\] unless length_class_budgets gives"),
    ("--speculation.length_class_budgets=[1,2]", r"speculation\.length_class_budgets: expected null or len\(length_classes\) \+ 1 = 1"),
    ("--speculation.length_classes=[48,16]", r"speculation\.length_classes: expected strictly increasing"),
    ("--speculation.toggle_min_speedup=0", r"speculation\.toggle_min_speedup: expected > 0"),
    ("--run.num_threads=0", r"run\.num_threads: expected > 0"),
    ("--grpo.max_completion_length=50", r"grpo\.max_completion_length: expected >= 107"),
    ("--grpo.max_completion_length=300", r"grpo\.max_completion_length: expected < model\.max_position_embeddings"),
    ("--grpo.nope=1", r"unknown key grpo\.nope; expected one of \['num_steps'"),
    ("--foo.x=1", r"unknown section 'foo'"),
    ("grpo.num_steps", r"expected --section\.key=value"),
    ("--grpo.num_steps=[1", r"value is not valid YAML"),
])
def test_validation_errors_name_key_source_and_expectation(override, expected):
    # every message names the file, the override the value came from, the dotted key and what was expected
    _err([override], re.escape(f"{DEFAULT}: override {override!r}: ") + expected)


def test_cross_field_error_names_the_file():
    _err(["--task.name=arith"], re.escape(DEFAULT) + r": model\.path: expected an HF model directory")
    _err(["--task.name=dataset"], re.escape(DEFAULT) + r": task\.dataset: expected a file, folder or hub id")
    _err(["--task.name=dataset", "--task.dataset=x.jsonl"], re.escape(DEFAULT) + r": task\.rewards: expected at least one")


def test_lenience_on_prior_is_allowed_but_warns_lossy():
    with pytest.warns(UserWarning, match="LOSSY"):
        cfg = load_config(DEFAULT, ["--rollout.speculative={method: prior, num_draft_tokens: 4, lenience: 2.0}"])
    assert cfg.rollout.speculative["lenience"] == 2.0
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        load_config(DEFAULT)                                  # the exact default never warns


def test_file_errors(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("grpo:\n  num_generation: 8\n")             # typo
    _err([], re.escape(str(bad)) + r": unknown key grpo\.num_generation", bad)
    bad.write_text("grpo:\n  num_steps: many\n")
    _err([], re.escape(str(bad)) + r": grpo\.num_steps: expected int, got str 'many'", bad)
    bad.write_text("- just\n- a list\n")
    _err([], re.escape(str(bad)) + r": expected a mapping of sections", bad)
    bad.write_text("grpo: 3\n")
    _err([], re.escape(str(bad)) + r": section 'grpo': expected a mapping", bad)
    bad.write_text("grpo: {num_steps: [\n")
    _err([], re.escape(str(bad)) + r": invalid YAML", bad)
    bad.write_text("grpo:\nsft: {steps: 0}\n")                 # an empty section keeps the defaults
    assert load_config(bad).grpo == load_config(bad, ["--grpo.num_steps=20"]).grpo
    with pytest.raises(FileNotFoundError, match="missing.yaml"):
        load_config(tmp_path / "missing.yaml")
    # inheritance: the error names the file that set the bad value, not the child
    (tmp_path / "parent.yaml").write_text("rollout:\n  block_size: 24\n")
    (tmp_path / "child.yaml").write_text("base: parent.yaml\ngrpo:\n  num_steps: 2\n")
    _err([], re.escape(str(tmp_path / "parent.yaml")) + r": rollout\.block_size: expected a power of 2",
         tmp_path / "child.yaml")
    (tmp_path / "child.yaml").write_text("base: parent.yaml\nrollout:\n  block_size: 6\n")
    _err([], re.escape(str(tmp_path / "child.yaml")) + r": rollout\.block_size: expected a power of 2, got 6",
         tmp_path / "child.yaml")
    (tmp_path / "loop.yaml").write_text("base: loop.yaml\n")
    _err([], r"loop\.yaml: `base` chain loops", tmp_path / "loop.yaml")


def test_validate_world():
    cfg = load_config(DEFAULT, ["--grpo.prompts_per_step=6", "--grpo.num_generations=4",
                                "--grpo.gradient_accumulation_steps=4"])
    validate_world(cfg, 3)                                    # 6/3*4 = 8 completions per rank, 4 micro-batches
    with pytest.raises(ValueError, match=r"grpo\.prompts_per_step: expected a multiple of the world size \(4\), got 6"):
        validate_world(cfg, 4)
    cfg = load_config(DEFAULT, ["--grpo.prompts_per_step=6", "--grpo.num_generations=3",
                                "--grpo.gradient_accumulation_steps=4"])
    with pytest.raises(ValueError, match=r"grpo\.gradient_accumulation_steps: expected a divisor .* = 18\), got 4"):
        validate_world(cfg, 1)


def test_removed_speculation_keys_warn_and_are_ignored():
    """The draft-length ladder is gone (engine/controller.py's rule sets draft lengths from measured
    acceptance): its keys in an earlier config or run dir load with one warning each, naming the key."""
    with pytest.warns(UserWarning, match=r"speculation\.draft_ladder is no longer used"):
        cfg = load_config(DEFAULT, ["--speculation.draft_ladder=[2,4]"])
    assert cfg == load_config(DEFAULT)
    for key in ("adaptive_draft_length: false", "ladder_up: 0.9", "ladder_down: 0.5"):
        with pytest.warns(UserWarning, match=key.split(":")[0]):
            config_from_dict({"speculation": yaml.safe_load(key)})


def test_every_entry_point_splits_overrides_alike(capsys):
    """train.py and eval.py share parse_with_overrides: --section.key=value passes through, anything else
    is argparse's one-line error, exit 2."""
    import argparse
    from nanospec.config import parse_with_overrides
    ap = argparse.ArgumentParser(prog="x")
    ap.add_argument("--config")
    args, over = parse_with_overrides(ap, ["--config", "c.yaml", "--grpo.num_steps=3"])
    assert args.config == "c.yaml" and over == ["--grpo.num_steps=3"]
    for bad in (["--grpo.num_steps", "3"], ["--bogus=1"], ["stray"]):
        with pytest.raises(SystemExit) as e:
            parse_with_overrides(ap, bad)
        assert e.value.code == 2 and "config overrides look like --section.key=value" in capsys.readouterr().err
