"""GRPO with speculative rollouts: parse -> SFT warm-up (embedded default) -> build -> train.

    torchrun --standalone --nproc_per_node=2 train.py --config configs/default.yaml [--section.key=value ...]
    python train.py --config configs/default.yaml --grpo.num_steps=5     # one process (world 1)
    ... --resume                                                         # = --run.resume=true
    ... --config configs/draft.yaml --sft-only        # only the SFT model (here: the draft model)

One process per rank: gloo on CPU, nccl on GPU; each rank uses run.num_threads torch threads
(default 1: two ranks on two cores must not oversubscribe them). Rank 0 prints the summary and
writes RUN_DIR/metrics.jsonl (`python -m tools.report RUN_DIR` plots it) and the checkpoints.

Errors in what the user gave (config, overrides, model directory, data files, reward functions,
checkpoints) are found while setting up, before any step runs: they print one line, `train.py: error:
...` (once, from whichever rank fails first), and exit 2, as argparse does. So does a reward function
that misbehaves on the model's completions mid-run (raises, wrong length, non-finite): every rank
stops in that step, which writes nothing. A traceback means a bug (NANOSPEC_TRACEBACK=1 shows one for
setup errors too). Under torchrun, torchrun adds its own report of the failed ranks after that line.
"""
import argparse
import sys

USER_ERRORS = (ValueError, FileNotFoundError)   # what the input checks raise


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="configs/default.yaml", help="YAML config (may set `base:`)")
    ap.add_argument("--resume", action="store_true", help="continue from the latest complete checkpoint")
    ap.add_argument("--sft-only", action="store_true", help="stop after the SFT warm-up (writes sft.out_dir)")
    from nanospec.config import load_config, parse_with_overrides, validate_world    # no torch yet
    args, overrides = parse_with_overrides(ap, argv)
    if args.resume:
        overrides.append("--run.resume=true")

    import torch
    from nanospec.rl import dist
    try:
        cfg = load_config(args.config, overrides)  # config errors surface before any process group
    except USER_ERRORS as e:
        return dist.user_error(e)
    torch.set_num_threads(cfg.run.num_threads)
    dist.init_distributed("nccl" if cfg.rollout.device.startswith("cuda") else "gloo")
    ok = False
    try:
        from nanospec.rl.grpo import Trainer
        from nanospec.rl.sft import prepare_sft_model
        from nanospec.tasks import RewardError
        log = print if dist.rank() == 0 else (lambda *a: None)
        try:                             # setup reads only the user's inputs; later errors are bugs
            if not args.sft_only:
                validate_world(cfg, dist.world_size())  # before the warm-up spends a minute
            # warm-up: the embedded default (no model.path) starts from its SFT model, reused if current
            warm = prepare_sft_model(cfg, log) if args.sft_only or not cfg.model.path else None
            trainer = None if args.sft_only else Trainer(cfg, log, model_dir=warm)    # build
        except USER_ERRORS as e:
            return dist.user_error(e)
        if args.sft_only:
            log(f"[sft] model in {warm}")
        else:
            try:
                trainer.train()          # train
            except RewardError as e:     # ... but the user's reward functions run in every step
                return dist.user_error(e)
        ok = True
    finally:
        dist.cleanup(sync=ok)
    return 0


if __name__ == "__main__":
    sys.exit(main())
