"""The ``apo:`` block of ``train.yaml``: how automatic prompt optimization searches (``algorithm: apo``).

Read by the settings loader as a nested block of ``LoopSettings`` (flags ``--apo.beam-width``,
variables ``OTEL_SPANRL_TRAIN_APO_BEAM_WIDTH``, YAML ``apo: {beam_width: ...}``) and used by
``apo/run.py`` (the rounds), ``apo/search.py`` (the beam) and ``apo/optimizer.py`` (the optimizer
model's client). Torch-free.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from spanrl.errors import SettingError


@dataclass
class ApoConfig:
    """Beam search over each selected agent's instructions (docs/apo.md)."""

    prompts: str = field(default="", metadata={
        "help": "the starting candidates: a prompts file (YAML/JSON, the format of `spanrl prompts export`: "
        "resource -> {candidates, active} or resource -> instructions); every candidate starts in the search "
        "(empty: the top-level prompts file)"})
    resources: list = field(default_factory=list, metadata={
        "help": "the prompt resources (agent or model names) to optimize, one after the other (empty: every "
        "resource of prompts)"})
    rounds: int = field(default=3, metadata={"help": "search rounds per resource after the starting pool's"})
    beam_width: int = field(default=2, metadata={"help": "candidates kept after each round"})
    branch_factor: int = field(default=2, metadata={
        "help": "new candidates the optimizer writes from each kept one per round (0: select from the pool only)"})
    batch_tasks: int = field(default=8, metadata={"help": "training tasks every candidate runs on in a round"})
    attempts: int = field(default=1, metadata={"help": "attempts per task and candidate in a round"})
    gradient_batch: int = field(default=4, metadata={
        "help": "the lowest-reward rollouts of a candidate the optimizer reads to critique it"})
    optimizer_url: str = field(default="", metadata={
        "help": "the optimizer model's OpenAI-compatible base URL (empty: no optimizer; the search selects "
        "among the starting candidates)"})
    optimizer_model: str = field(default="", metadata={"help": "the optimizer model's name"})
    optimizer_key_env: str = field(default="OPENAI_API_KEY", metadata={
        "help": "the environment variable holding the optimizer endpoint's API key (never logged)"})
    optimizer_temperature: float = field(default=1.0, metadata={"help": "the optimizer's sampling temperature"})
    optimizer_max_tokens: int = field(default=1024, metadata={"help": "at most this many tokens per optimizer answer"})
    optimizer_timeout_s: float = field(default=120.0, metadata={"help": "time limit of one optimizer call"})
    max_prompt_chars: int = field(default=4000, metadata={
        "help": "an edited prompt longer than this is unusable (dropped, with the reason logged)"})
    rollout_chars: int = field(default=2000, metadata={
        "help": "at most this many characters of each rollout's text go into the critique"})
    then_grpo: bool = field(default=False, metadata={
        "help": "after the search, serve the best prompts and run `steps` GRPO updates in the same run"})

    def __post_init__(self) -> None:
        for name in ("beam_width", "batch_tasks", "attempts", "gradient_batch", "optimizer_max_tokens",
                     "max_prompt_chars", "rollout_chars"):
            if getattr(self, name) < 1:
                raise SettingError(f"apo.{name} must be at least 1, got {getattr(self, name)}")
        for name in ("rounds", "branch_factor"):
            if getattr(self, name) < 0:
                raise SettingError(f"apo.{name} must be 0 or more, got {getattr(self, name)}")
        if self.optimizer_timeout_s <= 0 or self.optimizer_temperature < 0:
            raise SettingError("apo.optimizer_timeout_s must be positive and apo.optimizer_temperature 0 or more")
        if self.optimizer_url and not self.optimizer_model:
            raise SettingError("apo.optimizer_url is set: name the optimizer model too (apo.optimizer_model)")
        if not self.optimizer_key_env or not self.optimizer_key_env.replace("_", "").isalnum():
            raise SettingError(f"apo.optimizer_key_env must name an environment variable, got "
                               f"{self.optimizer_key_env!r} (the key itself goes in that variable, not here)")

    @property
    def proposes(self) -> bool:
        """Whether the search writes new candidates (an optimizer model and a branch factor)."""
        return bool(self.optimizer_url) and self.branch_factor > 0

    def check_for_apo(self) -> None:
        """What ``algorithm: apo`` needs of the block (called by ``LoopSettings``)."""
        if not self.prompts:
            raise SettingError("algorithm apo needs the starting prompts: apo.prompts (or prompts), a prompts file "
                               "(YAML: resource -> instructions, or resource -> {candidates: {name: text}, "
                               "active: name})")
