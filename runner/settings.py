"""Settings of ``spanrl run``: YAML file, ``--flags`` and ``OTEL_SPANRL_RUN_*`` variables.

Read by ``run_cli`` through ``core/settings_loader.py``; the runner loop (``runner.py``) uses them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from spanrl.errors import SettingError


@dataclass
class RunnerSettings:
    bridge_url: str = field(
        default="http://127.0.0.1:8100", metadata={"help": "the trainer bridge's task API"}
    )
    agent: str | None = field(
        default=None,
        metadata={"help": "the agent as a Python callable 'module:function', called with the task"},
    )
    command: list | None = field(
        default=None,
        metadata={"help": "the agent as a command (JSON list or comma-separated); the task "
                  "arrives as JSON on stdin and in SPANRL_TASK (a task over 96 KiB: in the file SPANRL_TASK_FILE "
                  "names instead)"},
    )
    wrap_command: bool = field(
        default=True, metadata={"help": "run the command under opentelemetry-instrument"}
    )
    concurrency: int = field(default=8, metadata={"help": "agents running at once"})
    otlp_endpoint: str = field(
        default="http://127.0.0.1:4317", metadata={"help": "OTLP/gRPC endpoint of spanrl receive"}
    )
    python_path: list = field(
        default_factory=list,
        metadata={"help": "folders to import the agent module from (in a config file: relative to it; the "
                  "config file's own folder is always one)", "import_folders": True},
    )
    env: dict = field(
        default_factory=dict,
        metadata={"help": "extra environment for the agent (a JSON object on the command line); values "
                  "of keys like *KEY*, *TOKEN*, *SECRET*, *PASSWORD* are printed as ***"},
    )
    bridge_token: str | None = field(
        default=None,
        metadata={"help": "bearer token the bridge asks for (the trainer's bridge_token); none = send none",
                  "secret": True},
    )
    policy_token: str | None = field(
        default=None,
        metadata={"help": "the policy endpoint's bearer token (the trainer's policy_token), given to agents "
                  "as OPENAI_API_KEY; none = OPENAI_API_KEY as set, else 'spanrl'", "secret": True},
    )
    bridge_wait_s: float = field(
        default=120.0, metadata={"help": "give up when the bridge (or, at start, the receiver at otlp_endpoint) "
                                 "cannot be reached this long"}
    )

    max_abandoned_agents: int = field(
        default=16,
        metadata={"help": "an in-process agent (agent: module:function) that outlives its rollout timeout keeps "
                  "running in its thread (it cannot be killed); with this many such threads the runner stops "
                  "claiming and exits with an error"},
    )

    def __post_init__(self) -> None:
        if (self.agent is None) == (self.command is None):
            raise SettingError("set exactly one of 'agent' (module:function) or 'command'")
        if self.agent is not None and ":" not in self.agent:
            raise SettingError(f"agent must look like 'module:function', got {self.agent!r}")
        if self.command is not None and not self.command:
            raise SettingError("command is empty: give the program to run, e.g. [\"python\", \"agent.py\"]")
        if self.concurrency < 1:
            raise SettingError(f"concurrency must be at least 1, got {self.concurrency}")
        if self.max_abandoned_agents < 1:
            raise SettingError(f"max_abandoned_agents must be at least 1, got {self.max_abandoned_agents}")
