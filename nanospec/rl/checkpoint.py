"""Atomic, verified training checkpoints: RUN_DIR/checkpoints/step_NNNNNN/

    config.json, model.safetensors, tokenizer files   the policy, HF layout (loader.save_model):
                                                      `AutoModelForCausalLM.from_pretrained` loads it
    trainer_state.pt                                  optimizer, scheduler, step (shared by all ranks)
    rank{r}.pt                                        per rank: RNG states, rollout-worker and drafter state
    dcp/                                              run.sharding fsdp: the sharded policy and AdamW state
                                                      (torch.distributed.checkpoint, one file per rank;
                                                      loads at any world size: DCP reshards), in place of
                                                      trainer_state.pt's optimizer; the HF files above are
                                                      then a consolidated export of the same weights
    COMPLETE.json                                     manifest: size + sha256 of every file above

Why atomic: a run killed mid-save must never leave a directory that looks usable. Every rank
writes into `.tmp_step_NNNNNN`, rank 0 fsyncs the files, writes the manifest last and renames the
directory into place (one rename, atomic on POSIX); older checkpoints are pruned only after that.
So a `step_NNNNNN` directory is complete or absent. Loading re-hashes every file against the
manifest: a file damaged later (truncated, bit rot) raises a ValueError naming it, and resuming
(`resume_point`) falls back to the previous complete checkpoint instead of resuming from garbage.
"""
from __future__ import annotations

import hashlib
import io
import json
import os
import pickle
import random
import re
import shutil
import warnings
from pathlib import Path

import numpy as np
import torch

from nanospec.drafters.chain import members
from nanospec.models.loader import save_model

MANIFEST = "COMPLETE.json"
_STEP = re.compile(r"^step_(\d+)$")


def rng_state() -> dict:
    st = {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()}
    if torch.cuda.is_available():
        st["cuda"] = torch.cuda.get_rng_state_all()
    return st


def set_rng_state(st: dict) -> None:
    torch.set_rng_state(st["torch"])
    random.setstate(st["python"])
    np.random.set_state(st["numpy"])
    if "cuda" in st and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(st["cuda"])


def _sha256(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def save_checkpoint(run_dir, step: int, model, tokenizer, trainer_state: dict, rank_state: dict, *,
                    rank: int = 0, world_size: int = 1, barrier=lambda: None, keep: int = 2,
                    sharded: dict | None = None, extras: dict | None = None) -> Path:
    """Collective (every rank calls it): writes step `step`, keeps the newest `keep` checkpoints.
    `model`: a whole-weight CausalLM, written by rank 0 (HF layout); `sharded`: a state dict of DTensors
    every rank writes its shards of with DCP (dcp/); `extras`: {subdirectory: writer(path)} rank 0 adds
    (the draft head's HF-style export). Four phases; a death in any of them leaves no step_N behind."""
    root = Path(run_dir) / "checkpoints"
    tmp, final = root / f".tmp_step_{step:06d}", root / f"step_{step:06d}"
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    barrier()
    write_rank_part(tmp, rank, rank_state, sharded)                  # 1. every rank: its own state
    barrier()
    if rank == 0:
        write_shared_part(tmp, model, tokenizer, trainer_state, extras)  # 2. the weights, the optimizer
        write_manifest(tmp, step, world_size)                         # 3. vouch for every file
        publish(tmp, final, run_dir, keep)                            # 4. one atomic rename
    barrier()
    return final


def write_rank_part(tmp: Path, rank: int, rank_state: dict, sharded: dict | None) -> None:
    torch.save(rank_state, tmp / f"rank{rank}.pt")
    if sharded is not None:
        import torch.distributed.checkpoint as dcp
        dcp.save(sharded, checkpoint_id=tmp / "dcp")


def write_shared_part(tmp: Path, model, tokenizer, trainer_state: dict, extras: dict | None) -> None:
    save_model(model, tmp, tokenizer)
    torch.save(trainer_state, tmp / "trainer_state.pt")
    for name, write in (extras or {}).items():
        write(tmp / name)


def write_manifest(tmp: Path, step: int, world_size: int) -> None:
    files = {}
    for p in sorted(p for p in tmp.rglob("*") if p.is_file()):
        with open(p, "rb") as f:
            os.fsync(f.fileno())     # on disk before the manifest vouches for it (power loss)
        files[p.relative_to(tmp).as_posix()] = {"size": p.stat().st_size, "sha256": _sha256(p)}
    manifest = {"step": step, "world_size": world_size, "files": files}
    with open(tmp / MANIFEST, "w") as f:
        json.dump(manifest, f, indent=1)
        f.flush()
        os.fsync(f.fileno())


def publish(tmp: Path, final: Path, run_dir, keep: int) -> None:
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    for old in list_checkpoints(run_dir)[:-keep] if keep > 0 else []:
        shutil.rmtree(old, ignore_errors=True)


def list_checkpoints(run_dir) -> list[Path]:
    """Complete checkpoint dirs (manifest present), oldest first. Temp dirs are never listed."""
    root = Path(run_dir) / "checkpoints"
    if not root.is_dir():
        return []
    dirs = [p for p in root.iterdir() if _STEP.match(p.name) and (p / MANIFEST).is_file()]
    return sorted(dirs, key=lambda p: int(_STEP.match(p.name).group(1)))


def verify_checkpoint(path) -> dict:
    """The manifest, after checking every listed file's size and sha256; ValueError naming the file."""
    path = Path(path)
    mf = path / MANIFEST
    if not mf.is_file():
        raise ValueError(f"{path}: incomplete checkpoint (no {MANIFEST}); it was not fully written")
    try:
        manifest = json.loads(mf.read_text())
        files = manifest["files"]
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise ValueError(f"{mf}: corrupt manifest ({e})") from None
    for name, want in files.items():
        f = path / name
        if not f.is_file():
            raise ValueError(f"{f}: missing (listed in {MANIFEST}); checkpoint is corrupt")
        if f.stat().st_size != want["size"]:
            raise ValueError(f"{f}: size {f.stat().st_size} bytes, expected {want['size']} (truncated?); "
                             f"checkpoint is corrupt")
        if _sha256(f) != want["sha256"]:
            raise ValueError(f"{f}: sha256 differs from {MANIFEST}; checkpoint is corrupt")
    return manifest


def latest_checkpoint(run_dir) -> Path | None:
    ckpts = list_checkpoints(run_dir)
    return ckpts[-1] if ckpts else None


def resume_point(run_dir, log=print, quarantine: bool = True) -> Path | None:
    """The newest checkpoint that verifies (None: there is none at all). Newer ones that do not (a
    file truncated or changed since it was written) are skipped, saying why, and with `quarantine`
    (rank 0) renamed step_NNNNNN.corrupt: kept for inspection, never picked or pruned again. If no
    checkpoint verifies, a ValueError says why for each and nothing is renamed."""
    errors = []
    for ck in reversed(list_checkpoints(run_dir)):
        try:
            verify_checkpoint(ck)
        except ValueError as e:
            errors.append((ck, e))
            continue
        for bad, e in errors:
            log(f"[resume] {e}; falling back to {ck.name}" + (f" ({bad.name} -> {bad.name}.corrupt)"
                                                              if quarantine else ""))
            if quarantine:
                os.replace(bad, bad.with_name(bad.name + ".corrupt"))
        return ck
    if errors:
        raise ValueError("no checkpoint to resume from verifies: " + "; ".join(str(e) for _, e in errors))
    return None


def load_checkpoint(path, rank: int = 0, world_size: int = 1, verified: bool = False,
                    reshard: bool = False) -> tuple[dict, dict | None]:
    """-> (trainer_state, this rank's state), verified (`verified`: `resume_point` has just hashed every
    file, so only the manifest is read). Model weights: `loader.load_model(path)`, or `load_sharded`.
    `reshard` (a DCP checkpoint): another world size is allowed; the rank state is then None."""
    path = Path(path)
    manifest = json.loads((path / MANIFEST).read_text()) if verified else verify_checkpoint(path)
    if manifest.get("world_size", world_size) != world_size:
        if reshard and (path / "dcp").is_dir():
            return torch.load(path / "trainer_state.pt", weights_only=False), None
        raise ValueError(f"{path}: written by {manifest['world_size']} ranks, resuming with {world_size}; "
                         f"per-rank state (RNG, drafters) cannot be remapped: use the same world size")
    trainer_state = torch.load(path / "trainer_state.pt", weights_only=False)
    rank_state = torch.load(path / f"rank{rank}.pt", weights_only=False)
    return trainer_state, rank_state


def load_sharded(path, state: dict) -> None:
    """Fill `state` (DTensors, as saved) in place from the checkpoint's dcp/ (collective)."""
    import torch.distributed.checkpoint as dcp
    if not (Path(path) / "dcp").is_dir():
        raise ValueError(f"{path}: no dcp/ directory: written by a run with run.sharding none; resume "
                         f"with the same run.sharding")
    dcp.load(state, checkpoint_id=Path(path) / "dcp")


def flat_dumps(obj) -> bytes:
    """pickle without deep recursion: instances of nanospec classes with __slots__ (suffix-trie nodes,
    prior-cache entries) are stored one at a time in a table and referenced by index, so a linked
    structure of any depth costs no stack (plain pickle recurses once per node and overflows)."""
    table, index = [], {}

    class Flat(pickle.Pickler):
        def persistent_id(self, o):
            if type(o).__module__.startswith("nanospec") and "__slots__" in vars(type(o)):
                if id(o) not in index:
                    index[id(o)] = len(table)
                    table.append(o)
                return index[id(o)]
            return None

    def dump(x) -> bytes:
        buf = io.BytesIO()
        Flat(buf, protocol=pickle.HIGHEST_PROTOCOL).dump(x)
        return buf.getvalue()

    root, states = dump(obj), []
    while len(states) < len(table):   # dumping a state may append more objects to the table
        o = table[len(states)]
        states.append(dump({k: getattr(o, k) for k in type(o).__slots__ if hasattr(o, k)}))
    return pickle.dumps((root, [type(o) for o in table], states))


def flat_loads(data: bytes):
    root, classes, states = pickle.loads(data)
    objs = [cls.__new__(cls) for cls in classes]

    class Flat(pickle.Unpickler):
        def persistent_load(self, pid):
            return objs[pid]

    for o, st in zip(objs, states):
        for k, v in Flat(io.BytesIO(st)).load().items():
            setattr(o, k, v)
    return Flat(io.BytesIO(root)).load()


ENGINE_STATE_VERSION = 11     # 11: the controller prices confident sources by the drafter's yield


def engine_state(llm) -> dict:
    """What shapes the next rollouts besides the weights: history drafters' caches (prior responses,
    suffix tries), the draft controller (acceptance tallies, latency models) and model drafters' RNG.
    Without it a resumed run drafts differently, which consumes the sampler's uniforms differently."""
    drafters = [{"generator": d.generator.get_state()} if d.needs_kv else flat_dumps(dict(vars(d)))
                for d in members(llm.drafter)]
    return {"drafters": drafters, "version": ENGINE_STATE_VERSION,
            "controller": flat_dumps(dict(vars(llm.controller))) if llm.controller is not None else None}


def load_engine_state(llm, state: dict) -> None:
    drafters = members(llm.drafter)
    if len(drafters) != len(state["drafters"]):
        raise ValueError(f"checkpoint has state for {len(state['drafters'])} drafters, rollout.speculative "
                         f"configures {len(drafters)}: resume with the same speculative config")
    for d, st in zip(drafters, state["drafters"]):
        if d.needs_kv:
            d.generator.set_state(st["generator"])
        else:
            vars(d).update(flat_loads(st))
    if state.get("version") != ENGINE_STATE_VERSION:    # the controller's classes moved or changed shape
        warnings.warn("checkpoint: the draft controller's state comes from an earlier nanospec; it starts "
                      "afresh (only learned timings and acceptance rates are lost, never what is sampled)")
    elif state["controller"] is not None and llm.controller is not None:
        vars(llm.controller).update(flat_loads(state["controller"]))
