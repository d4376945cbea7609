"""The reward judge (``reward: judge``): a model behind an OpenAI-compatible endpoint scores the
members of each GRPO group together (``config.py``, ``answer.py``, ``group_judge.py``; docs/judge.md)."""
