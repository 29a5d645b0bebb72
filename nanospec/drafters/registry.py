"""Every drafting method, declared once: its name, its builder and the options a config may set.

Config validation (config.py), the engine (`LLM(speculative=...)`) and the scripts all read this table;
importing it needs no torch (a builder is named by its import path and loaded only when built). Option
defaults live in one place too: the builder's signature (tests/test_layout.py checks the two agree).

    build({"method": "suffix", "num_draft_tokens": 8, "depth": 16})        -> SuffixDrafter(depth=16)
    build([{"method": "prior"}, {"method": "suffix"}])                      -> ChainDrafter([prior, suffix])
    build({"method": "self_nf4"}, target=DraftTarget(...))                  -> the nf4 self-drafter

To add a drafter: subclass drafters.base.Drafter in its own file, then add one line here.
"""
from __future__ import annotations

import importlib
import warnings
from dataclasses import dataclass


@dataclass(frozen=True)
class Method:
    builder: str                   # "module:callable" -> a Drafter, called with the options given
    options: tuple[str, ...]       # keyword arguments a config may set (defaults: the builder's)
    needs_target: bool = False     # the builder's first argument is the target (base.DraftTarget)
    own_kv: bool = False           # keeps a KV cache of its own over the target's blocks (Drafter.needs_kv)


METHODS = {
    "ngram": Method("nanospec.drafters.ngram:NgramDrafter", ("n_max", "n_min")),
    "suffix": Method("nanospec.drafters.suffix:SuffixDrafter",
                     ("depth", "window", "min_prob", "alpha", "max_nodes", "use_global", "global_max_nodes",
                      "global_depth", "own_prefix", "shrink", "max_total_nodes")),
    "prior": Method("nanospec.drafters.prior:PriorRolloutDrafter", ("max_per_prompt", "lenience", "max_prompts")),
    "self_nf4": Method("nanospec.drafters.model_drafter:self_nf4_drafter", ("seed",), needs_target=True,
                       own_kv=True),
    "draft_model": Method("nanospec.drafters.model_drafter:draft_model_drafter", ("model", "seed"),
                          needs_target=True, own_kv=True),
    "head": Method("nanospec.drafters.head:head_drafter", ("model", "draft_vocab", "seed"), needs_target=True,
                   own_kv=True),
    "suffix_mlp": Method("nanospec.drafters.suffix_mlp:suffix_mlp_drafter",
                         ("model", "override", "min_mlp_prob", "min_path_prob", "learn_epochs", "learn_lr",
                          "buffer", "seed"), needs_target=True),
}
ALIASES = {"self": "self_nf4"}     # the name earlier configs used
ENGINE_KEYS = ("method", "num_draft_tokens")    # read by the engine, not passed to the drafter
DEFAULT_DRAFT_TOKENS = 5


def canonical(method):
    return ALIASES.get(method, method)


def rules(spec, default_k: int | None = DEFAULT_DRAFT_TOKENS, warn: bool = False) -> list[tuple]:
    """(dotted key, ok, expected, value) for a speculative spec: None, a method dict or a list of them.
    default_k=None requires num_draft_tokens (config files state it). warn: say so when an option is
    lossy (prior-rollout lenience > 1); the drafter itself warns again when it is built."""
    if spec is None:
        return []
    specs = spec if isinstance(spec, list) else [spec]
    if not specs or not all(isinstance(s, dict) for s in specs):
        return [("speculative", False, "null, a {method, num_draft_tokens, ...} dict or a non-empty list of them",
                 spec)]
    out = []
    for i, s in enumerate(specs):
        at = f"speculative[{i}]" if isinstance(spec, list) else "speculative"
        m, k = canonical(s.get("method")), s.get("num_draft_tokens", default_k)
        out.append((f"{at}.method", m in METHODS, f"one of {', '.join(METHODS)}", s.get("method")))
        out.append((f"{at}.num_draft_tokens", isinstance(k, int) and not isinstance(k, bool) and k >= 1,
                    "an int >= 1", k))
        if m not in METHODS:
            continue
        unknown = sorted(set(s) - set(ENGINE_KEYS) - set(METHODS[m].options))
        out.append((f"{at}.{unknown[0] if unknown else 'options'}", not unknown,
                    f"an option of {m}: one of {', '.join(ENGINE_KEYS + METHODS[m].options)}", unknown))
        if m == "draft_model":
            out.append((f"{at}.model", isinstance(s.get("model"), str),
                        "a draft model directory (method draft_model needs `model`)", s.get("model")))
        if m == "head":
            dv = s.get("draft_vocab")
            out.append((f"{at}.draft_vocab", dv is None or (isinstance(dv, int) and not isinstance(dv, bool) and dv >= 1),
                        "null or an int >= 1 (at most the model's vocabulary)", dv))
        lenience = s.get("lenience", 1.0)
        number = isinstance(lenience, (int, float)) and not isinstance(lenience, bool)
        out.append((f"{at}.lenience", number and lenience >= 1, "1 (exact) or > 1 (LOSSY, method prior only)",
                    lenience))
        if warn and m == "prior" and number and lenience > 1:
            warnings.warn(f"{at}.lenience={lenience} is LOSSY: rollouts no longer follow the policy's "
                          f"distribution exactly (SPEC-RL lenient acceptance)", stacklevel=3)
    return out


def check(spec) -> None:
    for field, ok, expected, value in rules(spec):
        if not ok:
            raise ValueError(f"{field}: expected {expected}, got {value!r}")


def load(method: str):
    """The builder of `method` (imports its module)."""
    module, name = METHODS[canonical(method)].builder.split(":")
    return getattr(importlib.import_module(module), name)


def build(spec, target=None):
    """speculative spec -> Drafter (None: plain AR). A list is tried in order per sequence (a ChainDrafter).
    Methods with `needs_target` get `target`, the engine's base.DraftTarget."""
    if spec is None:
        return None
    check(spec)
    members = [_build_one(s, target) for s in (spec if isinstance(spec, list) else [spec])]
    if len(members) == 1:
        return members[0]
    from nanospec.drafters.chain import ChainDrafter
    return ChainDrafter(members)


def _build_one(spec: dict, target):
    """One checked method dict -> its Drafter."""
    method = METHODS[canonical(spec["method"])]
    opts = {k: v for k, v in spec.items() if k not in ENGINE_KEYS}
    if method.needs_target and target is None:
        raise ValueError(f"speculative method {spec['method']!r} drafts with a model: it needs the engine's target")
    drafter = load(spec["method"])(*([target] if method.needs_target else []), **opts)
    drafter.max_draft_tokens = spec.get("num_draft_tokens", DEFAULT_DRAFT_TOKENS)
    return drafter
