"""HF-format Llama / Qwen2 / Qwen3 checkpoints: the decoder (decoder.py), loading and saving
(loader.py), and fetching a real model (hub.py: `python -m nanospec.models.hub smollm2`).
Imports nothing else from nanospec.
"""
