"""The embedded torch backend: model creation, the policy engine and its HTTP server, the trainer.

``engine/`` generates (continuous batching, KV cache, sampling); ``server/`` is the
OpenAI-compatible HTTP front end over it; ``trainer.py`` runs GRPO and SFT updates;
``model_init.py`` creates small models locally. Importing this package does not import torch.
"""
