"""nanospec: exact speculative decoding inside RL rollouts, from scratch.

    from nanospec import LLM, SamplingParams

Layers (each may import only those listed before it): config.py and drafters/registry.py (no torch),
models/, engine/ with drafters/, tasks/, rl/. `LLM` is imported on first use, so that reading a config
or the drafter registry does not import torch.
"""
__all__ = ["LLM", "SamplingParams", "RequestOutput"]


def __getattr__(name):
    if name in __all__:
        from nanospec.engine import llm, sequence
        return getattr(llm if name != "SamplingParams" else sequence, name)
    raise AttributeError(f"module 'nanospec' has no attribute {name!r}")
