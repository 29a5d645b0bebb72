"""nanospec: exact speculative decoding inside RL rollouts, from scratch."""
from .engine import LLM, RequestOutput
from .sequence import SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput"]
