"""Settings of ``spanrl train``: YAML file, ``--flags`` and ``OTEL_SPANRL_TRAIN_*`` variables."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class TrainSettings:
    tasks: str = field(default="", metadata={"help": "task dataset (JSONL, one task object a line)"})
    model: str = field(default="", metadata={"help": "Hugging Face model directory to train"})
    output_dir: str = field(default="runs/spanrl", metadata={"help": "metrics, plot, checkpoints"})
    store: str = field(default="spanrl.db", metadata={"help": "the receiver's SQLite store"})
    reward: str = field(
        default="events",
        metadata={"help": "'events' (the agent's spanrl.reward events) or 'module:function' "
                  "called with (task, variables)"},
    )
    backend: str = field(default="torch", metadata={"help": "training backend: torch"})
    group_size: int = field(default=8, metadata={"help": "rollouts per task (GRPO group size G)"})
    tasks_per_step: int = field(default=16, metadata={"help": "tasks per GRPO update"})
    steps: int = field(default=20, metadata={"help": "GRPO updates to run"})
    stop_at_reward: float | None = field(
        default=None, metadata={"help": "stop early once reward_mean reaches this for 2 steps"}
    )
    learning_rate: float = field(default=2e-4, metadata={"help": "AdamW learning rate"})
    loss_agg_mode: str = field(default="token-mean", metadata={"help": "GRPO loss aggregation"})
    norm_adv_by_std: bool = field(
        default=True, metadata={"help": "GRPO (divide by group std); off = Dr.GRPO"}
    )
    advantage_level: str = field(
        default="rollout", metadata={"help": "'rollout' (shared per rollout) or 'transition'"}
    )
    kl_coef: float = field(default=0.0, metadata={"help": "KL to the initial policy (0 = off)"})
    agents: list = field(
        default_factory=list,
        metadata={"help": "train only transitions of these agent names (empty = all agents)"},
    )
    rollout_timeout_s: float = field(default=120.0, metadata={"help": "per-rollout time limit"})
    assembly_wait_s: float = field(
        default=30.0, metadata={"help": "wait this long for a finished rollout's spans"}
    )
    checkpoint_every: int = field(default=10, metadata={"help": "checkpoint every N steps (0 = end only)"})
    resume: bool = field(default=False, metadata={"help": "resume from output_dir's checkpoint"})
    policy_host: str = field(default="127.0.0.1", metadata={"help": "embedded policy server host"})
    policy_port: int = field(default=8000, metadata={"help": "embedded policy server port"})
    policy_model_name: str = field(default="policy", metadata={"help": "model name agents use"})
    bridge_host: str = field(default="127.0.0.1", metadata={"help": "task API host for runners"})
    bridge_port: int = field(default=8100, metadata={"help": "task API port for runners"})
    device: str = field(default="auto", metadata={"help": "cpu, cuda or auto"})
    seed: int = field(default=0, metadata={"help": "random seed (task order, sampling)"})
    python_path: list = field(
        default_factory=list, metadata={"help": "folders added to sys.path to import the reward"}
    )

    def __post_init__(self) -> None:
        if not self.tasks:
            raise ValueError("'tasks' is required: a JSONL file of tasks")
        if not self.model:
            raise ValueError("'model' is required: a Hugging Face model directory")
        if self.backend != "torch":
            raise ValueError(f"backend {self.backend!r} is not available here; use 'torch'")
        if self.reward != "events" and ":" not in self.reward:
            raise ValueError(f"reward must be 'events' or 'module:function', got {self.reward!r}")
        if self.group_size < 2:
            raise ValueError("group_size must be at least 2: GRPO needs a group to compare")
        if self.advantage_level not in ("rollout", "transition"):
            raise ValueError("advantage_level must be 'rollout' or 'transition'")
        for name in ("tasks_per_step", "steps"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1")
