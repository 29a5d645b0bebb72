"""Run configuration: one small dataclass per YAML section, validated, with CLI overrides.

    cfg = load_config("configs/default.yaml", ["--grpo.num_steps=5", "--rollout.speculative=null"])
    cfg.grpo.num_generations, cfg.rollout.speculative, ...

A YAML file may start with `base: other.yaml` (relative to itself) and then override only what
differs. Override values are parsed as YAML scalars/flow values (`=null`, `=[3,5]`, `={method: ngram,
num_draft_tokens: 4}`). Any unknown key, wrong type or impossible value raises ValueError naming the
dotted key, the file (or override) it came from and what was expected: a typo must not silently run
the default. Names of `grpo` knobs follow TRL's GRPOConfig.
"""
from __future__ import annotations

import json
import numbers
import types
import typing
import warnings
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import yaml

from nanospec.drafters import registry

# Allowed values, defined once; the modules that act on them import these.
ARCHS = ("llama", "qwen2", "qwen3")                  # models/decoder.py
DTYPES = ("float32", "bfloat16", "float16")          # models/loader.py
SHARDINGS = ("none", "fsdp")                         # rl/sharding.py
# Every task, declared once: name -> its class's import path (loaded by tasks.get_task; no torch here).
TASKS = {"synthetic": "nanospec.tasks.synthetic:SyntheticTask", "arith": "nanospec.tasks.arith:ArithTask",
         "dataset": "nanospec.tasks.dataset:DatasetTask"}
LOSS_TYPES = ("grpo", "dapo")                        # rl/loss.py
TIS_MODES = ("truncate", "mask")                     # rl/loss.py
HEAD_TRAINING = ("step", "bubble", "off")                      # rl/grpo.py: the draft head's online updates


@dataclass
class ModelConfig:
    arch: str = "llama"                 # llama | qwen2 | qwen3 (the tiny default is built, not loaded)
    hidden_size: int = 256
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int | None = None         # null: hidden_size // num_heads
    intermediate_size: int = 704        # a multiple of 64: nf4 blocks of the self_nf4 drafter align
    max_position_embeddings: int = 256
    rope_theta: float = 10000.0
    tie_word_embeddings: bool = True
    path: str | None = None             # an HF model dir to load instead of the embedded tiny model

    def rules(self):
        hd = self.head_dim or (self.hidden_size // self.num_heads if self.num_heads > 0 else 0)
        return [("arch", self.arch in ARCHS, _one_of(ARCHS)),
                *_pos(self, "hidden_size", "num_layers", "num_heads", "num_kv_heads", "intermediate_size"),
                ("num_kv_heads", self.num_kv_heads > 0 and self.num_heads % self.num_kv_heads == 0,
                 f"a divisor of num_heads ({self.num_heads})"),
                ("hidden_size", self.head_dim is not None or self.hidden_size % max(self.num_heads, 1) == 0,
                 f"divisible by num_heads ({self.num_heads}) unless head_dim is set"),
                ("head_dim", hd > 0 and hd % 2 == 0, "an even per-head size >= 2 (RoPE rotates pairs)"),
                ("max_position_embeddings", self.max_position_embeddings >= 2, "an int >= 2"),
                ("rope_theta", self.rope_theta > 0, "> 0"),
                ("path", self.path is None or self.path.strip() != "", "null or a model directory")]


@dataclass
class TaskConfig:
    name: str = "synthetic"             # synthetic | arith (word problems, for real models) | dataset (yours)
    dataset: str | None = None          # dataset: json/jsonl/parquet/csv file or folder, or a hub id (tasks/dataset.py)
    dataset_config: str | None = None   # dataset: the hub dataset's config name
    prompt: str = "prompt"              # dataset: the prompt column, or a format template over the columns
    rewards: list[str] = field(default_factory=list)   # dataset: module.path:function, TRL's signature
    reward_weights: list[float] | None = None         # dataset: null = 1 each
    train_split: str = "train"
    test_split: str | None = "test"     # null: a seeded cut of test_fraction of the train split
    seed: int = 0
    num_train: int = 4096               # size of the training prompt pool
    num_test: int = 256
    min_steps: int = 1                  # synthetic knobs (see tasks/synthetic.py)
    max_steps: int = 26
    zipf_alpha: float = 1.0
    modulus: int = 10
    test_fraction: float = 0.2
    final_weight: float = 0.5
    format_credit: float = 0.1          # arith: reward for a wrong number stated after '####'

    def rules(self):
        ds = self.name == "dataset"
        return [("name", self.name in TASKS, _one_of(tuple(TASKS))),
                ("dataset", not ds or bool(self.dataset), "a file, folder or hub id for task.name dataset"),
                ("rewards", not ds or len(self.rewards) > 0, "at least one 'module.path:function' for task.name dataset"),
                ("reward_weights", self.reward_weights is None or len(self.reward_weights) == len(self.rewards),
                 f"null or {len(self.rewards)} weights, one per reward"),
                *_pos(self, "num_train", "min_steps"),
                ("num_test", self.num_test >= 0, ">= 0"),
                ("max_steps", self.min_steps <= self.max_steps <= 26, "in [min_steps, 26]"),
                ("zipf_alpha", self.zipf_alpha >= 0, ">= 0"),
                ("modulus", 2 <= self.modulus <= 10, "in [2, 10]"),
                ("test_fraction", 0 < self.test_fraction < 1, "in (0, 1)"),
                ("final_weight", 0 <= self.final_weight <= 1, "in [0, 1]"),
                ("format_credit", 0 <= self.format_credit < 1, "in [0, 1)")]


@dataclass
class SFTConfig:
    steps: int = 1000                   # 0: no SFT warm-up
    batch_size: int = 32
    lr: float = 2e-3
    error_rate: float = 0.1             # fraction of traces with one injected slip (imperfect SFT)
    out_dir: str = "runs/sft"           # reused when it already holds a model
    bf16_autocast: bool | None = None   # null: on where the CPU has native bf16 (sft.native_bf16)

    def rules(self):
        return [("steps", self.steps >= 0, ">= 0"), *_pos(self, "batch_size", "lr"),
                ("error_rate", 0 <= self.error_rate <= 1, "in [0, 1]"),
                ("out_dir", self.out_dir.strip() != "", "a non-empty path")]


@dataclass
class GRPOConfig:
    num_steps: int = 20
    prompts_per_step: int = 8           # global, across ranks
    num_generations: int = 8            # G, completions per prompt
    max_completion_length: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1                     # -1: off
    learning_rate: float = 1e-4
    beta: float = 0.0                   # KL coefficient (k3 estimator); 0 = no reference model
    epsilon: float = 0.2
    epsilon_high: float | None = None   # null: = epsilon (DAPO's clip-higher when larger)
    loss_type: str = "grpo"             # grpo (per-sequence mean) | dapo (token mean over the batch)
    scale_rewards: bool = True
    num_iterations: int = 1             # mu: optimizer passes per rollout batch
    gradient_accumulation_steps: int = 1
    max_grad_norm: float | None = 1.0   # null: no clipping
    weight_decay: float = 0.0
    warmup_steps: int = 0
    tis_cap: float | None = None        # truncated importance sampling cap (null: off)
    tis_mode: str = "truncate"          # truncate | mask
    max_staleness: int = 0              # 1: one-step off-policy, step t+1's rollouts run while t trains
    mask_truncated_completions: bool = False   # responses cut at max_completion_length leave the loss (TRL, DAPO)
    overlong_buffer: int = 0            # DAPO's soft overlong punishment over the last N tokens (0: off)
    overlong_penalty: float = 1.0       # the reward a response at max_completion_length loses

    def rules(self):
        return [*_pos(self, "num_steps", "prompts_per_step", "max_completion_length", "temperature",
                      "learning_rate", "epsilon", "num_iterations", "gradient_accumulation_steps"),
                ("num_generations", self.num_generations >= 2, "an int >= 2 (a group of one has no advantage)"),
                ("top_p", 0 < self.top_p <= 1, "in (0, 1]"),
                ("top_k", self.top_k == -1 or self.top_k >= 1, "-1 (off) or an int >= 1"),
                ("beta", self.beta >= 0, ">= 0"),
                ("epsilon_high", self.epsilon_high is None or self.epsilon_high >= self.epsilon,
                 f"null or >= epsilon ({self.epsilon})"),
                ("loss_type", self.loss_type in LOSS_TYPES, _one_of(LOSS_TYPES)),
                ("max_grad_norm", self.max_grad_norm is None or self.max_grad_norm > 0, "null or > 0"),
                ("weight_decay", self.weight_decay >= 0, ">= 0"),
                ("warmup_steps", self.warmup_steps >= 0, ">= 0"),
                ("tis_cap", self.tis_cap is None or self.tis_cap >= 1, "null (off) or a cap >= 1"),
                ("tis_mode", self.tis_mode in TIS_MODES, _one_of(TIS_MODES)),
                ("max_staleness", self.max_staleness in (0, 1), "0 (synchronous) or 1 (one-step off-policy)"),
                ("overlong_buffer", is_int(self.overlong_buffer)
                 and 0 <= self.overlong_buffer < self.max_completion_length,
                 f"an int in [0, max_completion_length={self.max_completion_length})"),
                ("overlong_penalty", self.overlong_penalty >= 0, ">= 0"),
                ("tis_cap", not self.max_staleness or self.tis_cap is not None,
                 "a cap >= 1 with max_staleness 1 (rollout logprobs come from the previous policy)")]


@dataclass
class RolloutConfig:
    dtype: str = "float32"              # float32 | bfloat16 | float16
    device: str = "cpu"                 # cpu | cuda | cuda:N
    max_num_seqs: int = 64
    block_size: int = 16
    num_kv_blocks: int | None = None    # null: from memory (kv_cache_gib on CPU, gpu_memory_utilization on GPU)
    max_num_batched_tokens: int | None = None
    prefix_caching: bool = True
    speculative: Any = None             # null | {method, num_draft_tokens, ...} | list of such dicts
    use_cuda_graphs: bool = False
    gpu_memory_utilization: float = 0.5
    kv_cache_gib: float | None = None   # CPU KV pool in GiB (null: 2, at most 1/4 of available RAM)
    sleep_level: int = 1                # while training: 1 frees the KV pool, 2 the engine's weights too

    def rules(self):
        return [("dtype", self.dtype in DTYPES, _one_of(DTYPES)),
                ("device", self.device == "cpu" or self.device.split(":")[0] == "cuda", "cpu, cuda or cuda:N"),
                *_pos(self, "max_num_seqs", "num_kv_blocks", "max_num_batched_tokens"),
                ("block_size", self.block_size >= 1 and self.block_size & (self.block_size - 1) == 0,
                 "a power of 2"),
                ("use_cuda_graphs", not self.use_cuda_graphs or self.device.startswith("cuda"),
                 "false unless device is cuda (CUDA graphs need a GPU)"),
                ("gpu_memory_utilization", 0 < self.gpu_memory_utilization <= 1, "in (0, 1]"),
                ("kv_cache_gib", self.kv_cache_gib is None or self.kv_cache_gib > 0, "null or a size in GiB > 0"),
                ("sleep_level", self.sleep_level in (1, 2), "1 (KV pool) or 2 (KV pool and engine weights)"),
                *registry.rules(self.speculative, default_k=None, warn=True)]


@dataclass
class SpeculationConfig:
    bubble_drafting: bool = True        # idle fast ranks pre-draft for slow ranks (BubbleSpec)
    length_aware_assignment: bool = True  # balance predicted rollout length across ranks (DAS)
    length_classes: list[int] = field(default_factory=list)  # answer lengths splitting DAS classes; [] : off
    length_class_budgets: list[int] | None = None  # the draft cap per class (needed with length_classes)
    toggle: bool = True                 # draft only where the cost model predicts a speedup (false: the cap)
    toggle_min_speedup: float = 1.05    # the one threshold of engine/controller.py's rule
    # Repeatable runs (tests, exact resume checks): the two choices made from wall-clock time, fixed
    latency_profile: str | None = None  # a profile JSON whose cost model replaces the clock (latency.py)
    bubble_token_budget: int | None = None  # null: bubble work until the last rank ends; N: N draft tokens
                                            # (and a `bubble` head trained on all it recorded)
    # a `head` drafter (drafters/head.py): where it learns from the rollouts, and how fast
    head_training: str = "step"         # step: after each weight sync, on the trainer's hidden states | bubble:
                                        # in the rollout's idle time, on the engine's (TLT) | off: frozen
    head_lr: float = 3e-4
    head_positions: int = 384           # per rank and step, at most: the head's cost stays a small share of the step

    def rules(self):
        c, b = self.length_classes, self.length_class_budgets
        p, n = self.latency_profile, self.bubble_token_budget
        return [("head_training", self.head_training in HEAD_TRAINING, _one_of(HEAD_TRAINING)),
                ("head_lr", self.head_lr > 0, "> 0"),
                ("head_positions", is_int(self.head_positions) and self.head_positions >= 1, "an int >= 1"),
                ("latency_profile", p is None or Path(p).is_file(), "null or an existing profile JSON file"),
                ("bubble_token_budget", n is None or (is_int(n) and n >= 1), "null or an int >= 1"),
                ("length_classes", all(t > 0 for t in c) and all(x < y for x, y in zip(c, c[1:])),
                 "strictly increasing lengths > 0 ([] = off)"),
                ("length_classes", not c or b is not None, "[] unless length_class_budgets gives each class "
                 "its draft cap (the controller prices every step itself)"),
                ("length_class_budgets", b is None or len(b) == len(c) + 1,
                 f"null or len(length_classes) + 1 = {len(c) + 1} draft caps"),
                ("length_class_budgets", b is None or all(x >= 0 for x in b), "draft budgets >= 0"),
                ("toggle_min_speedup", self.toggle_min_speedup > 0, "> 0")]


@dataclass
class RunConfig:
    out_dir: str = "runs/default"
    seed: int = 0
    save_every: int = 0                 # optimizer steps between checkpoints (0: only at the end)
    resume: bool = False
    eval_every: int = 0                 # 0: eval only at the start and the end
    num_threads: int = 1                # torch threads per rank
    sharding: str = "none"              # none (replicated) | fsdp (FSDP2: params, grads, AdamW sharded)
    activation_checkpointing: bool = False  # fsdp: recompute each decoder layer in backward
    log_to: list[str] = field(default_factory=lambda: ["jsonl"])   # + tensorboard (RUN_DIR/tensorboard)

    def rules(self):
        import importlib.util
        return [("out_dir", self.out_dir.strip() != "", "a non-empty path"),
                ("sharding", self.sharding in SHARDINGS, _one_of(SHARDINGS)),
                ("activation_checkpointing", not self.activation_checkpointing or self.sharding == "fsdp",
                 "false unless sharding is fsdp"),
                ("log_to", "jsonl" in self.log_to and set(self.log_to) <= {"jsonl", "tensorboard"},
                 "a list of jsonl (metrics.jsonl, the run's record: always) and tensorboard"),
                ("log_to", "tensorboard" not in self.log_to or importlib.util.find_spec("tensorboard") is not None,
                 "no tensorboard without the tensorboard package (pip install tensorboard)"),
                ("save_every", self.save_every >= 0, ">= 0"), ("eval_every", self.eval_every >= 0, ">= 0"),
                *_pos(self, "num_threads")]


SECTIONS = {"model": ModelConfig, "task": TaskConfig, "sft": SFTConfig, "grpo": GRPOConfig,
            "rollout": RolloutConfig, "speculation": SpeculationConfig, "run": RunConfig}


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    task: TaskConfig = field(default_factory=TaskConfig)
    sft: SFTConfig = field(default_factory=SFTConfig)
    grpo: GRPOConfig = field(default_factory=GRPOConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    speculation: SpeculationConfig = field(default_factory=SpeculationConfig)
    run: RunConfig = field(default_factory=RunConfig)

    def to_yaml(self) -> str:
        return yaml.safe_dump(config_to_dict(self), sort_keys=False)


def check(ok: bool, field: str, expected: str, got) -> None:
    """The one argument check of the library: a ValueError naming the field, what it expected, what came."""
    if not ok:
        raise ValueError(f"{field}: expected {expected}, got {got!r}")


def read_jsonl(path) -> list[tuple[int, Any]]:
    """(1-based line number, value) of each non-blank line of a JSON-lines file; a line that is not
    JSON is a ValueError naming the file and the line (datasets' loader names neither)."""
    rows = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if line.strip():
                try:
                    rows.append((n, json.loads(line)))
                except json.JSONDecodeError as e:
                    raise ValueError(f"{path}: line {n}: invalid JSON ({e.msg})") from None
    return rows


def is_int(x) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def _one_of(values) -> str:
    return "one of " + ", ".join(values)


def _pos(sec, *keys):
    """Rules 'key > 0' (None passes: those keys mean 'auto')."""
    return [(k, getattr(sec, k) is None or getattr(sec, k) > 0, "> 0") for k in keys]


def _type_name(tp) -> str:
    args = typing.get_args(tp)
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        return " or ".join("null" if a is type(None) else _type_name(a) for a in args)
    if typing.get_origin(tp) is list:
        return f"a list of {_type_name(args[0])}"
    return getattr(tp, "__name__", str(tp))


def _coerce(v, tp):
    """v as type tp, or raise TypeError. ints pass as floats; '1e-3' too (YAML 1.1 reads it as a string)."""
    if tp is Any:
        return v
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        if v is None and type(None) in typing.get_args(tp):
            return None
        return _coerce(v, next(a for a in typing.get_args(tp) if a is not type(None)))
    if typing.get_origin(tp) is list:
        if not isinstance(v, list):
            raise TypeError
        return [_coerce(x, typing.get_args(tp)[0]) for x in v]
    if tp is float and isinstance(v, (int, float, str)) and not isinstance(v, bool):
        return float(v)  # a non-numeric string raises ValueError -> reported as a type error
    if tp is int and isinstance(v, bool) or not isinstance(v, tp):
        raise TypeError
    return v


def _read(path: Path, raw: dict, origin: dict, chain: tuple = ()) -> None:
    """Merge YAML file `path` (after its `base`, if any) into raw[section][key]; origin[dotted] = file."""
    if not path.is_file():
        raise FileNotFoundError(f"config file {path} not found")
    if path.resolve() in chain:
        raise ValueError(f"{path}: `base` chain loops: {' -> '.join(map(str, chain + (path,)))}")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as e:
        raise ValueError(f"{path}: invalid YAML: {e}") from e
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a mapping of sections {list(SECTIONS)}, got {type(data).__name__}")
    if "base" in data:
        _read(path.parent / str(data.pop("base")), raw, origin, chain + (path.resolve(),))
    _merge(data, raw, origin, str(path))


def _merge(d: dict, raw: dict, origin: dict, src: str, keep_origin: bool = False) -> None:
    for sec, values in d.items():
        values = {} if values is None else values
        for key, v in (values.items() if isinstance(values, dict) else [(None, values)]):
            _set(raw, origin, sec, key, v, origin.get(f"{sec}.{key}", src) if keep_origin else src)


def _set(raw, origin, sec, key, v, src) -> None:
    sec = {"policies": "speculation"}.get(sec, sec)     # the section's name in earlier configs
    if (sec, key) == ("run", "log_every"):                # a key earlier run dirs hold; it did nothing
        return
    key = {("task", "data_path"): "dataset"}.get((sec, key), key)   # its name in earlier run dirs
    if sec == "speculation" and key in ("adaptive_draft_length", "draft_ladder", "ladder_up", "ladder_down"):
        warnings.warn(f"{src}: speculation.{key} is no longer used and is ignored: draft lengths follow the "
                      f"measured per-position acceptance (engine/controller.py), capped by num_draft_tokens")
        return
    if sec not in SECTIONS:
        raise ValueError(f"{src}: unknown section {sec!r}; expected one of {list(SECTIONS)}")
    if key is None:
        raise ValueError(f"{src}: section {sec!r}: expected a mapping of keys, got {v!r}")
    names = [f.name for f in fields(SECTIONS[sec])]
    if key not in names:
        raise ValueError(f"{src}: unknown key {sec}.{key}; expected one of {names}")
    raw.setdefault(sec, {})[key] = v
    origin[f"{sec}.{key}"] = src


def config_from_dict(d: dict, source: str = "<dict>", origin: dict | None = None) -> Config:
    """Build and validate a Config from {section: {key: value}} (missing keys keep their defaults)."""
    raw, origin = {}, dict(origin or {})
    _merge(d or {}, raw, origin, source, keep_origin=True)
    sections = {}
    for sec, cls in SECTIONS.items():
        hints, kw = typing.get_type_hints(cls), {}
        for key, v in raw.get(sec, {}).items():
            try:
                kw[key] = _coerce(v, hints[key])
            except (TypeError, ValueError):
                raise ValueError(f"{origin[f'{sec}.{key}']}: {sec}.{key}: expected {_type_name(hints[key])}, "
                                 f"got {type(v).__name__} {v!r}") from None
        obj = sections[sec] = cls(**kw)
        for key, ok, expected, *val in obj.rules():
            if not ok:
                field_name = key.split("[")[0].split(".")[0]
                val = val[0] if val else getattr(obj, field_name)
                raise ValueError(f"{origin.get(f'{sec}.{field_name}', source)}: {sec}.{key}: expected "
                                 f"{expected}, got {val!r}")
    cfg = Config(**sections)
    for key, ok, expected in _cross_rules(cfg):
        if not ok:
            raise ValueError(f"{origin.get(key, source)}: {key}: expected {expected}, got "
                             f"{getattr(getattr(cfg, key.split('.')[0]), key.split('.')[1])!r}")
    return cfg


def _cross_rules(cfg: Config):
    return [("grpo.max_completion_length", cfg.model.path is not None
             or cfg.grpo.max_completion_length < cfg.model.max_position_embeddings,
             f"< model.max_position_embeddings ({cfg.model.max_position_embeddings}), leaving room for the prompt"),
            ("grpo.max_completion_length", cfg.task.name != "synthetic"
             or cfg.grpo.max_completion_length >= 4 * cfg.task.max_steps + 3,
             f">= {4 * cfg.task.max_steps + 3}, the longest synthetic answer + eos (task.max_steps="
             f"{cfg.task.max_steps}): truncated answers can never be right"),
            ("rollout.sleep_level", cfg.rollout.sleep_level == 1 or (not cfg.grpo.max_staleness and (
                cfg.run.sharding == "fsdp" or cfg.rollout.dtype != "float32" or cfg.rollout.use_cuda_graphs)),
             "1 unless the engine holds its own weights (run.sharding fsdp, a rollout dtype other than "
             "float32 or CUDA graphs) and sleeps while training (grpo.max_staleness 0)"),
            ("model.path", cfg.task.name == "synthetic" or cfg.model.path is not None,
             f"an HF model directory (with its tokenizer) for task {cfg.task.name}: the embedded tokenizer "
             f"only covers the synthetic task")]


def parse_with_overrides(ap, argv=None):
    """-> (ap's own arguments, the rest as `--section.key=value` config overrides): what every entry
    point takes. Anything else is argparse's one-line error, exit 2."""
    args, overrides = ap.parse_known_args(argv)
    bad = [o for o in overrides if not (o.startswith("--") and "." in o.split("=")[0] and "=" in o)]
    if bad:
        ap.error(f"unrecognized arguments {' '.join(bad)}: config overrides look like --section.key=value")
    return args, overrides


def load_config(path, overrides=()) -> Config:
    """Config from a YAML file (with `base` inheritance) + `--section.key=value` overrides."""
    raw, origin = {}, {}
    _read(Path(path), raw, origin)
    for o in overrides:
        key, eq, value = o.removeprefix("--").partition("=")
        sec, dot, name = key.partition(".")
        if not (eq and dot and name and "." not in name):
            raise ValueError(f"{path}: override {o!r}: expected --section.key=value")
        try:
            v = yaml.safe_load(value)
        except yaml.YAMLError as e:
            raise ValueError(f"{path}: override {o!r}: value is not valid YAML: {e}") from e
        if isinstance(v, bool) and typing.get_type_hints(SECTIONS.get(sec, object)).get(name) is str:
            v = value       # YAML 1.1 reads off / yes / no as bools; a str field means the word
        _set(raw, origin, sec, name, v, f"{path}: override {o!r}")
    return config_from_dict(raw, str(path), origin)


config_to_dict = asdict     # Config -> {section: {key: value}}: its YAML, a checkpoint's copy


def save_config(cfg: Config, path) -> None:
    """Write the resolved config (defaults filled in) as YAML, e.g. into the run directory."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(cfg.to_yaml())


def validate_world(cfg: Config, world_size: int) -> None:
    """Checks that need the number of ranks (known only at launch)."""
    g = cfg.grpo
    if world_size < 1 or g.prompts_per_step % world_size:
        raise ValueError(f"grpo.prompts_per_step: expected a multiple of the world size ({world_size}), "
                         f"got {g.prompts_per_step}")
    per_rank = g.prompts_per_step // world_size * g.num_generations
    if per_rank % g.gradient_accumulation_steps:
        raise ValueError(f"grpo.gradient_accumulation_steps: expected a divisor of the completions per rank "
                         f"(prompts_per_step / world_size * num_generations = {per_rank}), got "
                         f"{g.gradient_accumulation_steps}")
    if world_size > 1 and cfg.rollout.device.startswith("cuda") and cfg.rollout.device != "cuda":
        raise ValueError(f"rollout.device: expected 'cuda' (one GPU per rank, chosen by LOCAL_RANK) with "
                         f"{world_size} ranks, got {cfg.rollout.device!r}")
