"""The inference engine: `LLM` (llm.py) over a paged KV cache, continuous batching and exact verification.

One step: scheduler.py picks sequences; block_manager.py gives them KV blocks; controller.py decides how
much to draft (latency.py prices it); the drafter proposes; runner.py (cuda_graphs.py on GPU) runs one
forward; verify.py accepts drafts exactly and sampler.py samples the next token.
May import: nanospec.models, nanospec.drafters, nanospec.config; never nanospec.rl.
"""
