"""HF directory <-> CausalLM: config.json + (sharded) safetensors in, the same layout out.

Files hold HF names (q_proj, k_proj, ...); the model fuses q|k|v and gate|up (decoder.py), so both go
through `to_hf`'s split views: loading copies into them, saving writes them. Errors name the file and
the HF key, because a wrong checkpoint directory is the most common first bug.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from nanospec.models.decoder import CausalLM, ModelArgs

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {list(DTYPES)}, got {dtype!r}")
    return DTYPES[dtype]


def read_args(path: str | Path) -> ModelArgs:
    cfg_file = Path(path) / "config.json"
    if not cfg_file.is_file():
        raise FileNotFoundError(f"{cfg_file}: missing (expected an HF model directory with config.json)")
    try:
        cfg = json.loads(cfg_file.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{cfg_file}: invalid JSON ({e})") from None
    return ModelArgs.from_hf(cfg, where=str(cfg_file))


def read_state_dict(path: str | Path) -> dict[str, torch.Tensor]:
    path = Path(path)
    index = path / "model.safetensors.index.json"
    if (path / "model.safetensors").is_file():
        files = [path / "model.safetensors"]
    elif index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        files = [path / s for s in shards]
    else:
        raise FileNotFoundError(f"{path}: no model.safetensors or model.safetensors.index.json")
    state = {}
    for f in files:
        if not f.is_file():
            raise FileNotFoundError(f"{f}: shard listed in {index.name} is missing")
        try:
            state.update(load_file(str(f)))
        except Exception as e:  # safetensors raises its own error types for truncated/corrupt files
            raise ValueError(f"{f}: cannot read safetensors ({e})") from None
    return state


# our fused module -> the HF modules it concatenates, in row order (decoder.Attention / decoder.MLP)
FUSED = {"self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
         "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj")}


def _split_sizes(args: ModelArgs, fused: str) -> list[int]:
    if fused == "self_attn.qkv_proj":
        return [args.num_heads * args.head_dim] + [args.num_kv_heads * args.head_dim] * 2
    return [args.intermediate_size] * 2


def _fused_parts(name: str):
    """'model.layers.3.self_attn.qkv_proj.weight' -> ('model.layers.3.', fused, HF parts, '.weight') or None."""
    for fused, parts in FUSED.items():
        pre, hit, post = name.partition(f".{fused}.")
        if hit:
            return pre + ".", fused, parts, "." + post
    return None


def to_hf(state: dict, args: ModelArgs) -> dict:
    """Our names -> HF names: split the fused projections (views, no copy)."""
    out = {}
    for name, t in state.items():
        f = _fused_parts(name)
        if f is None:
            out[name] = t
            continue
        pre, fused, parts, post = f
        for part, piece in zip(parts, t.split(_split_sizes(args, fused), 0)):
            out[pre + part + post] = piece
    return out


def check_state_dict(model: torch.nn.Module, state: dict, where: str) -> None:
    """Every parameter present (HF names) with the right shape (tied lm_head may be absent)."""
    expected = to_hf(model.state_dict(), model.args)
    for name, t in expected.items():
        if name not in state:
            if name == "lm_head.weight" and model.args.tie_word_embeddings:
                continue
            raise ValueError(f"{where}: missing tensor {name!r} (shape {tuple(t.shape)})")
        if tuple(state[name].shape) != tuple(t.shape):
            raise ValueError(f"{where}: tensor {name!r} has shape {tuple(state[name].shape)}, "
                             f"expected {tuple(t.shape)} from config.json")
    extra = [k for k in state if k not in expected and "rotary_emb" not in k]
    if extra:
        raise ValueError(f"{where}: unexpected tensors {extra[:5]} (architecture mismatch?)")


def load_model(path: str | Path, dtype="float32", device="cpu") -> CausalLM:
    args = read_args(path)
    with torch.device("meta"):
        model = CausalLM(args)
    state = read_state_dict(path)
    check_state_dict(model, state, str(path))
    model = model.to_empty(device=device)
    if args.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    with torch.no_grad():     # into HF-named views of our fused tensors, one at a time: no fused copies
        for name, view in to_hf(model.state_dict(), args).items():   # built beside the model (its peak
            if name in state:                                        # memory is one model, not ~1.6)
                view.copy_(state[name])
    return model.to(resolve_dtype(dtype)).eval()


def save_model(model: CausalLM, path: str | Path, tokenizer=None) -> None:
    """Write config.json + model.safetensors (+ tokenizer): loadable by AutoModelForCausalLM."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().to("cpu", torch.float32).contiguous()
             for k, v in to_hf(model.state_dict(), model.args).items()}
    if model.args.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    tmp = path / "model.safetensors.tmp"
    save_file(state, str(tmp), metadata={"format": "pt"})
    os.replace(tmp, path / "model.safetensors")
    (path / "config.json").write_text(json.dumps(model.args.to_hf(), indent=2))
    if tokenizer is not None:
        tokenizer.save_pretrained(str(path))


def chat_prompt_ids(tokenizer, conversation: list[dict], **template_kwargs) -> list[int]:
    """Token ids of a conversation + the generation prompt, for any tokenizer with a chat template.
    `template_kwargs` go to the template (e.g. `enable_thinking=False` for Qwen3)."""
    rendered = tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True,
                                             **template_kwargs)
    # The template already holds bos where the model wants one: never add special tokens twice.
    return tokenizer.encode(rendered, add_special_tokens=False)
