"""The training loop's settings: every top-level key of ``train.yaml`` and the ``warm_start:`` block.

``LoopSettings`` is what the loop reads (tasks, rounds, scoring, advantages, validation,
asynchronous training, the bridge and endpoint addresses, the algorithm's top-level keys); the
command's ``TrainSettings`` (``train_settings.py``) extends it with the backends' own blocks
(``trainer:``, ``engine:``, ``verl:``), which the loop never reads. Torch-free and backend-free.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field

from spanrl.errors import SettingError

from .algorithm import ADVANTAGE_LEVELS, ALGORITHMS, LOSS_AGG_MODES, LOSS_WEIGHTINGS
from .apo.config import ApoConfig
from .backend import BACKENDS, EndpointConfig
from .judge.config import JudgeConfig
from .warm_start import WARM_START_FROM_TOP_LEVEL, WarmStartConfig

CHECKPOINTS_FOLDER = "checkpoints"  # <output_dir>/checkpoints: every backend's resumable checkpoints


@dataclass
class LoopSettings:
    """Every top-level key of ``train.yaml`` and the ``warm_start:`` block."""

    tasks: str = field(default="", metadata={"help": "task dataset (JSONL, one task object a line)"})
    model: str = field(default="", metadata={"help": "Hugging Face model directory to train"})
    output_dir: str = field(default="runs/spanrl", metadata={"help": "metrics, plot, checkpoints"})
    store: str = field(default="spanrl.db", metadata={"help": "the receiver's SQLite store"})
    reward: str = field(
        default="events",
        metadata={"help": "'events' (the agent's spanrl.reward events), 'module:function' "
                  "called with (task, variables), or 'judge' (a judge model scores each group: the judge: block)"},
    )
    trust_agent_rewards: bool = field(
        default=True,
        metadata={"help": "with reward 'events', score a rollout by every reward its spans carry; off = only "
                  "the receiver's AIR rule rewards count (an agent cannot award itself)"},
    )
    hidden_task_fields: list = field(
        default_factory=list,
        metadata={"help": "task fields (e.g. the gold answer) that reach the reward function but never the agent: "
                  "runners get each task without them, so they are in no agent's environment, stdin or spans"},
    )
    backend: str = field(
        default="torch",
        metadata={"help": "training backend: torch (embedded, one machine), verl (verl's workers train, vLLM "
                  "serves; the verl: block) or endpoint (an endpoint spanrl does not train, at endpoint_url: "
                  "algorithm apo only)"},
    )
    endpoint_url: str = field(
        default="",
        metadata={"help": "backend endpoint: the OpenAI base URL (.../v1) of the endpoint the agents call, which "
                  "spanrl neither starts nor trains (spanrl proxy in front of a hosted model, a running spanrl "
                  "serve); APO sets its prompts"},
    )
    group_size: int = field(default=8, metadata={"help": "rollouts per task (GRPO group size G)"})
    tasks_per_step: int = field(default=16, metadata={"help": "tasks per GRPO update"})
    steps: int = field(default=20, metadata={"help": "GRPO updates to run"})
    stop_at_reward: float | None = field(
        default=None, metadata={"help": "stop early once reward_mean reaches this for 2 steps"}
    )
    learning_rate: float = field(default=2e-4, metadata={"help": "GRPO AdamW learning rate"})
    loss_agg_mode: str = field(
        default="token-mean",
        metadata={"help": "GRPO loss aggregation: token-mean, seq-mean-token-mean or seq-mean-token-sum-norm"},
    )
    loss_weighting: str = field(
        default="token",
        metadata={"help": "'token' (every response token weighs the same) or 'rollout' (every rollout "
                  "weighs the same whatever its number of calls and tokens; needs loss_agg_mode token-mean)"},
    )
    norm_adv_by_std: bool = field(
        default=True, metadata={"help": "GRPO (divide by group std); off = Dr.GRPO"}
    )
    advantage_estimator: str = field(
        default="grpo",
        metadata={"help": "'grpo' (each task's group is the baseline) or 'reinforce_plus_plus' (the whole "
                  "batch is: a task whose rollouts all succeeded is still pushed up; verl's REINFORCE++; "
                  "docs/algorithms.md)"},
    )
    drop_uniform_groups: bool = field(
        default=False,
        metadata={"help": "GRPO: leave out of the update the groups whose rollouts all got the same reward "
                  "(their advantages are 0: they teach nothing and only dilute token-mean; DAPO's group "
                  "filter, without its resampling; docs/algorithms.md)"},
    )
    negative_advantage_scale: float = field(
        default=1.0,
        metadata={"help": "GRPO: multiply negative advantages by this (1 = GRPO; 0 = learn from the better rollouts "
                  "only; between: a failed rollout's tokens, most of them shared with the successes, are pushed "
                  "down less; docs/algorithms.md)"},
    )
    positive_advantage_scale: float = field(
        default=1.0,
        metadata={"help": "GRPO: multiply positive advantages by this (1 = GRPO; 0.1 = mostly push the failed "
                  "rollouts down, W-REINFORCE's weighting; 0 = learn from the failures only; docs/algorithms.md)"},
    )
    advantage_level: str = field(
        default="rollout",
        metadata={"help": "'rollout' (every call gets its rollout's score) or 'transition' (each call its own "
                  "return: the agent's reward events after credit, or a reward function's value plus the AIR "
                  "rewards of that call)"},
    )
    kl_coef: float = field(default=0.0, metadata={"help": "KL to the initial policy (0 = off)"})
    merge_trajectories: bool = field(
        default=False,
        metadata={"help": "train each rollout's consecutive calls as one row when the next prompt starts with the "
                  "previous prompt + response; the tokens in between are masked out of the loss (docs/algorithms.md)"},
    )
    async_training: bool = field(
        default=False,
        metadata={"help": "update on the groups that finished while others still run (off-policy, bounded by "
                  "max_staleness; docs/algorithms.md)"},
    )
    max_staleness: int = field(
        default=1, metadata={"help": "async_training: rollouts generated more than this many policy versions "
                             "before the update are dropped"},
    )
    off_policy_rollouts: str = field(
        default="correct",
        metadata={"help": "async_training: rollouts generated by an older policy are 'correct'ed by truncated "
                  "importance sampling or 'drop'ped"},
    )
    is_truncation: float = field(
        default=2.0, metadata={"help": "async_training with off_policy_rollouts correct: the cap of the per-token "
                               "importance ratio exp(old logprob - engine logprob)"},
    )
    agents: list = field(
        default_factory=list,
        metadata={"help": "train only transitions of these agent names (empty = all agents)"},
    )
    rollout_timeout_s: float = field(default=120.0, metadata={"help": "per-rollout time limit"})
    relaunch_attempts: int = field(
        default=1, metadata={"help": "relaunch an attempt lost with its runner, timed out or failed by the runner "
                             "itself up to this many times, keeping its group whole (0 = never; docs/algorithms.md)"},
    )
    assembly_wait_s: float = field(
        default=30.0, metadata={"help": "wait this long for a finished rollout's spans"}
    )
    checkpoint_every: int = field(default=10, metadata={"help": "checkpoint every N steps (0 = end only)"})
    resume: bool = field(default=False, metadata={"help": "resume from output_dir's checkpoint"})
    policy_host: str = field(default="127.0.0.1", metadata={"help": "embedded policy server host"})
    policy_port: int = field(default=8000, metadata={"help": "embedded policy server port"})
    policy_model_name: str = field(default="policy", metadata={"help": "model name agents use"})
    policy_model_names: list = field(
        default_factory=lambda: ["*"],
        metadata={"help": "other model names the policy endpoint answers to ('*': any name, the default: agents "
                  "keep the names they hard-code); an empty list answers only policy_model_name"},
    )
    policy_token: str | None = field(
        default=None,
        metadata={"help": "bearer token agents must send to the policy endpoint (their OPENAI_API_KEY); "
                  "none = no check", "secret": True},
    )
    prompts: str = field(default="", metadata={
        "help": "a YAML/JSON file of prompt candidates the policy endpoint serves in place of the agents' "
        "instructions (docs/proxy.md, \"Prompt resources\")"})
    bridge_host: str = field(default="127.0.0.1", metadata={"help": "task API host for runners"})
    bridge_port: int = field(default=8100, metadata={"help": "task API port for runners"})
    bridge_token: str | None = field(
        default=None,
        metadata={"help": "bearer token runners must send to the task API; none = no check", "secret": True},
    )
    tls_cert: str | None = field(
        default=None,
        metadata={"help": "PEM certificate (chain) file: the policy endpoint (or verl's gateway) and the task API "
                  "serve HTTPS only (with tls_key); none = plain HTTP"},
    )
    tls_key: str | None = field(default=None, metadata={"help": "PEM private key file of tls_cert"})
    from_traffic: bool = field(
        default=False,
        metadata={"help": "train on served traffic instead of tasks: no task list, no runner; each step takes "
                  "tasks_per_step rollouts whose feedback arrived (docs/algorithms.md, 'Training from traffic')"},
    )
    traffic_window: int = field(default=1024, metadata={"help": "from_traffic: rollouts kept waiting for feedback"})
    traffic_max_age_s: float = field(
        default=3600.0, metadata={"help": "from_traffic: a rollout without feedback this long leaves the window"})
    traffic_prefix_tokens: int = field(
        default=0, metadata={"help": "from_traffic: group rollouts by their first call's first N prompt tokens "
                             "(0: the whole first prompt); a rollout alone uses its agent's running mean"})
    traffic_baseline_decay: float = field(
        default=0.9, metadata={"help": "from_traffic: decay of each agent's running mean of rewards"})
    traffic_wait_s: float = field(
        default=600.0, metadata={"help": "from_traffic: a step waits at most this long for tasks_per_step judged "
                                 "rollouts, then trains on those it has"})
    max_empty_steps: int = field(
        default=3,
        metadata={"help": "stop with an error after this many steps in a row trained on nothing (0 = never)"},
    )
    device: str = field(
        default="auto", metadata={"help": "device of the trainer and the policy engine: auto | cpu | cuda | cuda:N"}
    )
    seed: int = field(default=0, metadata={"help": "random seed (task order, sampling)"})
    python_path: list = field(
        default_factory=list,
        metadata={"help": "folders to import the reward module from (in a config file: relative to it; the "
                  "config file's own folder is always one)", "import_folders": True},
    )
    report_to: list = field(
        default_factory=list,
        metadata={"help": "experiment trackers that also get every metrics row: tensorboard, wandb, mlflow "
                  "(metrics.jsonl and reward_curve.png are always written)"},
    )
    tracking_project: str = field(
        default="spanrl", metadata={"help": "W&B project and MLflow experiment of report_to's runs"}
    )
    receiver_wait_s: float = field(
        default=10.0, metadata={"help": "at start, wait this long for `spanrl receive` to be writing the store, "
                                "seconds; then stop with an error saying so"}
    )
    runner_wait_warn_s: float = field(
        default=30.0, metadata={"help": "say 'waiting for runners' (and the URL to give `spanrl run`) when "
                                "no runner claimed a task for this long, seconds (0 = never)"}
    )
    algorithm: str = field(
        default="grpo",
        metadata={"help": "'grpo' (RL on group advantages), 'sft' (rejection-sampling fine-tuning: learn the "
                  "calls of rollouts rewarded at least sft_min_reward, by plain NLL) or 'apo' (automatic prompt "
                  "optimization of the agents' instructions, weights frozen: the apo: block, docs/apo.md)"},
    )
    sft_min_reward: float = field(
        default=1.0, metadata={"help": "with algorithm sft, learn only rollouts whose reward is at least this"}
    )
    val_tasks: str = field(
        default="", metadata={"help": "held-out task file (JSONL, as tasks) scored every val_every steps as "
                              "val_reward; its rollouts are never trained on (empty = no validation)"}
    )
    val_reward_fn: str = field(
        default="", metadata={"help": "what held-out rollouts are scored by (val_reward is their mean): 'events' or "
                              "'module:function' (empty = reward). Train on a shaped reward, validate on your metric"}
    )
    val_every: int = field(
        default=5, metadata={"help": "validate after every N-th step and after the last one"}
    )
    val_attempts: int = field(default=1, metadata={"help": "attempts per validation task"})
    val_temperature: float | None = field(
        default=None, metadata={"help": "the temperature validation rollouts are sampled at, whatever the agent asks "
                                         "(0: greedy); unset: the agent's own"})
    val_only: bool = field(
        default=False,
        metadata={"help": "score val_tasks with the model (or, with --resume, the run's newest checkpoint), "
                  "print val_reward and exit: no training"},
    )
    warm_start: WarmStartConfig = field(
        default_factory=WarmStartConfig,
        metadata={"help": "supervised fine-tuning before the first step, as `spanrl sft` does (off unless "
                  "demonstrations or store is set; reward, tasks, python_path, seed and device are top-level "
                  "keys); the warm model goes to <output_dir>/warm-start", "exclude": WARM_START_FROM_TOP_LEVEL},
    )

    judge: JudgeConfig = field(
        default_factory=JudgeConfig,
        metadata={"help": "reward: judge: the judge model scoring each group's rollouts together in one request "
                  "(url, model, api_key_env, rubric, combine_with, weight; docs/judge.md)"},
    )

    apo: ApoConfig = field(
        default_factory=ApoConfig,
        metadata={"help": "automatic prompt optimization (algorithm: apo): the starting prompts, the beam search, "
                  "the optimizer model (docs/apo.md)"},
    )

    def __post_init__(self) -> None:
        if not self.tasks and not self.from_traffic:
            raise SettingError("'tasks' is required: a JSONL file of tasks (or from_traffic: train on served traffic)")
        if self.from_traffic:
            self._check_traffic()
        if not self.model and self.backend != "endpoint":
            raise SettingError("'model' is required: a Hugging Face model directory")
        if self.backend not in BACKENDS:
            raise SettingError(f"unknown backend {self.backend!r}; use one of {sorted(BACKENDS)}")
        if self.reward not in ("events", "judge") and ":" not in self.reward:
            raise SettingError(f"reward must be 'events', 'judge' or 'module:function', got {self.reward!r}")
        if self.reward == "judge":
            self._check_judge()
        if self.val_reward_fn and self.val_reward_fn != "events" and ":" not in self.val_reward_fn:
            raise SettingError(f"val_reward_fn must be 'events' or 'module:function', got {self.val_reward_fn!r}")
        if self.algorithm not in ALGORITHMS:
            raise SettingError(f"algorithm must be one of {ALGORITHMS}, got {self.algorithm!r}")
        if self.group_size < (2 if self.runs_grpo else 1):
            raise SettingError("group_size must be at least 2: GRPO needs a group to compare")
        if self.algorithm == "apo":
            self._check_apo()
        if self.backend == "endpoint":
            self._check_endpoint_backend()
        if self.val_every < 1 or self.val_attempts < 1:
            raise SettingError("val_every and val_attempts must be at least 1")
        if self.val_temperature is not None and self.val_temperature < 0:
            raise SettingError(f"val_temperature must be 0 (greedy) or more, got {self.val_temperature}")
        if self.val_only and not self.val_tasks:
            raise SettingError("--val-only scores the held-out tasks: give val_tasks (a task JSONL file)")
        if not 0.0 <= self.negative_advantage_scale <= 1.0:
            raise SettingError(f"negative_advantage_scale must be from 0 to 1, got {self.negative_advantage_scale}")
        if not 0.0 <= self.positive_advantage_scale <= 1.0:
            raise SettingError(f"positive_advantage_scale must be from 0 to 1, got {self.positive_advantage_scale}")
        if self.positive_advantage_scale == 0.0 and self.negative_advantage_scale == 0.0:
            raise SettingError("positive_advantage_scale and negative_advantage_scale are both 0: GRPO would "
                               "learn nothing; keep at least one above 0")
        self._check_advantage_estimator()
        if self.advantage_level not in ADVANTAGE_LEVELS:
            raise SettingError(f"advantage_level must be one of {ADVANTAGE_LEVELS}, got {self.advantage_level!r}")
        if self.loss_weighting not in LOSS_WEIGHTINGS:
            raise SettingError(f"loss_weighting must be one of {LOSS_WEIGHTINGS}, got {self.loss_weighting!r}")
        if self.loss_agg_mode not in LOSS_AGG_MODES:
            raise SettingError(f"loss_agg_mode must be one of {LOSS_AGG_MODES}, got {self.loss_agg_mode!r}")
        if self.loss_weighting == "rollout" and self.loss_agg_mode != "token-mean":
            raise SettingError(f"loss_weighting 'rollout' needs loss_agg_mode 'token-mean' (got "
                               f"{self.loss_agg_mode!r}): set loss_agg_mode: token-mean or loss_weighting: token")
        self._check_async()
        for name in ("tasks_per_step", "steps"):
            if getattr(self, name) < 1:
                raise SettingError(f"{name} must be at least 1")
        if self.max_empty_steps < 0:
            raise SettingError(f"max_empty_steps must be 0 (never stop) or more, got {self.max_empty_steps}")
        from spanrl.trainer_bridge.trackers import check_report_to

        check_report_to(self.report_to)
        shared = {name: getattr(self, name) for name in WARM_START_FROM_TOP_LEVEL}
        if self.reward == "judge":  # the warm start learns demonstrations only (_check_judge): no reward
            shared["reward"] = "events"
        self.warm_start = dataclasses.replace(self.warm_start, **shared)

    @property
    def checkpoint_dir(self) -> str:
        """Where the run's resumable checkpoints go: ``<output_dir>/checkpoints``."""
        return os.path.join(self.output_dir, CHECKPOINTS_FOLDER)

    @property
    def endpoint(self) -> EndpointConfig:
        """The policy endpoint agents call, as every backend serves it."""
        return EndpointConfig(host=self.policy_host, port=self.policy_port, model_name=self.policy_model_name,
                              model_names=tuple(self.policy_model_names), token=self.policy_token,
                              validation_temperature=self.val_temperature, prompts=self.prompts or None,
                              tls_cert=self.tls_cert, tls_key=self.tls_key)

    @property
    def runs_grpo(self) -> bool:
        """Whether the run makes GRPO updates (``grpo``, or ``apo`` with ``apo.then_grpo``)."""
        return self.algorithm == "grpo" or (self.algorithm == "apo" and self.apo.then_grpo)

    def _check_apo(self) -> None:
        if not self.apo.prompts and self.prompts:  # the candidates the endpoint serves are the starting pool
            self.apo = dataclasses.replace(self.apo, prompts=self.prompts)
        self.apo.check_for_apo()
        if self.resume:
            raise SettingError("algorithm apo runs its search from the start: --resume continues GRPO and SFT runs "
                               "only (start the search again with another output_dir)")
        if self.async_training:
            raise SettingError("algorithm apo runs its rounds itself: turn async_training off")

    def _check_judge(self) -> None:
        self.judge.check_for_judge()
        if self.algorithm == "apo":
            raise SettingError("reward: judge scores GRPO groups; algorithm apo scores each rollout alone: "
                               "use a reward function or events with apo")
        if self.warm_start.store:
            raise SettingError("warm_start.store picks rollouts by a reward function or events, not by the judge: "
                               "remove warm_start.store, or warm-start from demonstrations")

    def _check_endpoint_backend(self) -> None:
        if self.algorithm != "apo" or self.apo.then_grpo:
            raise SettingError("backend endpoint trains no weights (spanrl neither starts nor trains that endpoint): "
                               "use algorithm: apo without apo.then_grpo, or backend torch / verl")
        if not self.endpoint_url:
            raise SettingError("backend endpoint needs endpoint_url: the OpenAI base URL (.../v1) of the endpoint "
                               "the agents call (e.g. `spanrl proxy --upstream ...`)")

    def _check_advantage_estimator(self) -> None:
        estimators = ("grpo", "reinforce_plus_plus")
        if self.advantage_estimator not in estimators:
            raise SettingError(f"advantage_estimator must be one of {estimators}, got {self.advantage_estimator!r}")
        if self.advantage_estimator == "grpo":
            return
        if not self.norm_adv_by_std:
            raise SettingError("norm_adv_by_std: false is Dr.GRPO's (advantage_estimator grpo); reinforce_plus_plus "
                               "always divides by the batch's std")
        if self.drop_uniform_groups:
            raise SettingError("drop_uniform_groups leaves out the groups without signal under GRPO; under "
                               "reinforce_plus_plus those groups have a signal (the batch is their baseline): "
                               "turn one of them off")
        if self.from_traffic:
            raise SettingError("from_traffic computes its own baselines (GRPO groups and each agent's running mean): "
                               "advantage_estimator must be grpo there")

    def _check_traffic(self) -> None:
        if self.algorithm != "grpo" or self.async_training or self.val_tasks or self.backend == "endpoint":
            raise SettingError("from_traffic trains GRPO on served traffic: algorithm grpo, backend torch or verl, "
                               "without async_training or val_tasks (score a held-out set through the endpoint)")
        if self.traffic_window < 1 or self.traffic_max_age_s <= 0 or self.traffic_prefix_tokens < 0 \
                or not 0 <= self.traffic_baseline_decay < 1 or self.traffic_wait_s <= 0:
            raise SettingError("from_traffic needs traffic_window >= 1, traffic_max_age_s > 0, traffic_prefix_tokens"
                               " >= 0, 0 <= traffic_baseline_decay < 1 and traffic_wait_s > 0")

    def _check_async(self) -> None:
        if self.relaunch_attempts < 0:
            raise SettingError(f"relaunch_attempts must be 0 or more, got {self.relaunch_attempts}")
        if self.max_staleness < 0:
            raise SettingError(f"max_staleness must be 0 or more, got {self.max_staleness}")
        if self.off_policy_rollouts not in ("correct", "drop"):
            raise SettingError(f"off_policy_rollouts must be 'correct' or 'drop', got {self.off_policy_rollouts!r}")
        if self.is_truncation <= 0:
            raise SettingError(f"is_truncation must be positive, got {self.is_truncation}")
        if self.async_training and self.off_policy_rollouts == "correct" and self.backend not in ("torch", "verl"):
            raise SettingError("async_training with off_policy_rollouts 'correct' (importance sampling) runs on the "
                               f"torch and verl backends; with backend {self.backend} set off_policy_rollouts: drop")
