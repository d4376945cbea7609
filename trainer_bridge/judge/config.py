"""The ``judge:`` block of ``train.yaml``: the judge model, its rubric, and how its score is combined.

Read by ``LoopSettings`` (``loop_settings.py``) through the settings loader; used by
``group_judge.GroupJudge`` when ``reward: judge``. The API key is never a setting: ``api_key_env``
names the environment variable that holds it, and the key is never logged. Torch-free.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from spanrl.errors import SettingError

DEFAULT_RUBRIC = ("Score how well each run solved its task: 1 for a correct, complete final answer reached "
                  "sensibly, 0 for a wrong or missing one, in between for partial success.")


@dataclass(frozen=True)
class JudgeConfig:
    """Where the judge is, what it is told, and how its score becomes the reward."""

    url: str = field(default="", metadata={
        "help": "the judge model's OpenAI-compatible base URL (.../v1): a hosted API, vLLM, spanrl serve"})
    model: str = field(default="", metadata={"help": "the judge model's name"})
    api_key_env: str = field(default="OPENAI_API_KEY", metadata={
        "help": "the environment variable holding the judge endpoint's API key (the key itself never goes in a "
        "setting and is never logged)"})
    rubric: str = field(default=DEFAULT_RUBRIC, metadata={
        "help": "what the judge scores: the rubric text of its prompt"})
    combine_with: str = field(default="", metadata={
        "help": "a 'module:function' reward (called with task, variables) combined with the judge's score: "
        "reward = weight * judge + (1 - weight) * function (empty: the judge's score alone)"})
    weight: float = field(default=0.5, metadata={
        "help": "with combine_with: the judge's share of the reward, in [0, 1]"})
    max_chars: int = field(default=4000, metadata={
        "help": "each member's text (its calls, tool results, variables) is cut to this many characters "
        "(start and end kept)"})
    temperature: float = field(default=0.0, metadata={"help": "the judge's sampling temperature"})
    max_tokens: int = field(default=1024, metadata={"help": "at most this many tokens per judge answer"})
    timeout_s: float = field(default=120.0, metadata={"help": "time limit of one judge request"})
    concurrency: int = field(default=4, metadata={"help": "judge requests (one per group) sent at once"})

    def check_for_judge(self) -> None:
        """What ``reward: judge`` needs: a URL, a model, sane numbers."""
        if not self.url or not self.model:
            raise SettingError("reward: judge needs the judge's endpoint and model: set judge.url (an OpenAI-"
                               "compatible base URL, .../v1) and judge.model")
        if not self.url.startswith(("http://", "https://")):
            raise SettingError(f"judge.url must be an http(s) URL ending in /v1, got {self.url!r}")
        if not self.api_key_env or not self.api_key_env.replace("_", "").isalnum():
            raise SettingError(f"judge.api_key_env must name an environment variable, got {self.api_key_env!r} "
                               "(the key itself goes in that variable, not here)")
        if self.combine_with and ":" not in self.combine_with:
            raise SettingError(f"judge.combine_with must be 'module:function', got {self.combine_with!r}")
        if not (math.isfinite(self.weight) and 0.0 <= self.weight <= 1.0):
            raise SettingError(f"judge.weight must be in [0, 1], got {self.weight}")
        if not self.rubric.strip():
            raise SettingError("judge.rubric is empty: say what the judge scores")
        for name in ("max_chars", "max_tokens", "concurrency"):
            if getattr(self, name) < 1:
                raise SettingError(f"judge.{name} must be at least 1, got {getattr(self, name)}")
        if self.timeout_s <= 0 or self.temperature < 0:
            raise SettingError("judge.timeout_s must be positive and judge.temperature 0 or more")

    def combined(self, judge_score: float, function_score: float | None) -> float:
        """The reward of a member the judge scored ``judge_score`` (``function_score``: combine_with's value)."""
        if function_score is None or not self.combine_with:
            return judge_score
        return self.weight * judge_score + (1.0 - self.weight) * function_score
