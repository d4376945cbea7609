"""Settings of ``spanrl eval``: the run config of ``spanrl train`` plus what to evaluate and how.

``EvalSettings`` is ``TrainSettings`` (the same ``train.yaml``: tasks, reward, the judge, the
runner's bridge and the policy endpoint's port) with eval's own keys: ``k``, ``samples``, ``out``,
``success_threshold`` and ``greedy``. What is evaluated is named on the command line: ``--model DIR``
(a model directory, served by the embedded torch backend) or ``--endpoint URL`` (an OpenAI-compatible
endpoint already serving, which spanrl neither starts nor trains; ``endpoint_url`` in the file), exactly
one of them (``EvalCommandSettings.from_args`` checks the flags and variables). Read by ``eval_cli``
through ``core/settings_loader.py`` (variables ``OTEL_SPANRL_EVAL_*``).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from spanrl.errors import SettingError
from spanrl.settings_loader import CommandSettings, env_name
from spanrl.trainer_bridge.backend import EndpointConfig
from spanrl.trainer_bridge.train_settings import TrainSettings

EVAL_PREFIX = "EVAL"
RESULT_FILE = "eval.json"  # in output_dir when --out is not given
GREEDY_TEMPERATURE = 0.0


@dataclass
class EvalSettings(TrainSettings):
    """``spanrl eval``'s settings: ``spanrl train``'s and eval's own (module docstring)."""

    k: int = field(default=1, metadata={"help": "pass@k: the k of the estimator (k <= samples)"})
    samples: int | None = field(
        default=None, metadata={"help": "sampled rollouts per task for pass@k, at the temperature the agent asks "
                                "for (unset: k; 0: no sampled round, greedy only)"})
    out: str = field(default="", metadata={
        "help": f"the JSON summary file (per-task results; default <output_dir>/{RESULT_FILE})"})
    success_threshold: float = field(
        default=1.0, metadata={"help": "a rollout succeeds when its reward is at least this (greedy accuracy, "
                               "pass@k)"})
    greedy: bool = field(default=True, metadata={
        "help": "run the greedy round (one rollout per task at temperature 0) for greedy accuracy"})

    def __post_init__(self) -> None:
        if self.endpoint_url:  # --endpoint: an endpoint spanrl neither starts nor trains
            self.backend = "endpoint"
        self.resume = False  # the model named is what is served, never a run's newest checkpoint
        super().__post_init__()
        if self.samples is None:
            self.samples = self.k
        if self.k < 1:
            raise SettingError(f"k must be at least 1, got {self.k}")
        if self.samples < 0 or (self.samples and self.samples < self.k):
            raise SettingError(f"samples ({self.samples}) must be at least k ({self.k}): pass@k draws k of them "
                               "(or 0: greedy only)")
        if not self.samples and not self.greedy:
            raise SettingError("nothing to evaluate: --no-greedy and samples 0")
        if self.endpoint_url and not self.endpoint_url.startswith(("http://", "https://")):
            raise SettingError(f"--endpoint must be an http(s) URL ending in /v1, got {self.endpoint_url!r}")

    @property
    def target(self) -> str:
        """What is evaluated: the endpoint's URL or the model directory."""
        return self.endpoint_url or self.model

    @property
    def out_path(self) -> str:
        return self.out or os.path.join(self.output_dir, RESULT_FILE)

    @property
    def endpoint(self) -> EndpointConfig:
        """The embedded server samples the greedy round (validation rollouts) at temperature 0."""
        return dataclasses.replace(super().endpoint, validation_temperature=GREEDY_TEMPERATURE)

    def _check_endpoint_backend(self) -> None:
        """Eval only serves from the endpoint: any algorithm's config evaluates there."""

    def _check_async(self) -> None:
        """Eval runs its own rounds: async_training and its checks do not apply."""
        self.async_training = False


@dataclass(frozen=True)
class EvalCommandSettings(CommandSettings):
    """The settings of ``spanrl eval``: refuses both or neither of ``--model`` and ``--endpoint``."""

    def add_to(self, parser: argparse.ArgumentParser) -> None:
        super().add_to(parser)
        parser.add_argument("--endpoint", dest="endpoint_url", default=None, metavar="URL",
                            help="evaluate the OpenAI-compatible endpoint at URL (.../v1), already serving "
                            "(same as --endpoint-url); give this or --model")

    def from_args(self, args: argparse.Namespace, environ: Mapping[str, str] | None = None) -> Any:
        environ = os.environ if environ is None else environ
        named = {flag: getattr(args, name, None) or environ.get(env_name(self.prefix, name))
                 for flag, name in (("--model", "model"), ("--endpoint", "endpoint_url"))}
        given = [flag for flag, value in named.items() if value]
        if len(given) != 1:
            raise SettingError("spanrl eval needs exactly one of --model DIR (a model directory, served here) and "
                               f"--endpoint URL (an endpoint already serving); got {' and '.join(given) or 'neither'}")
        settings = super().from_args(args, environ)
        if settings.endpoint_url:
            settings = dataclasses.replace(settings, model="")  # train.yaml's model is not what is evaluated
        return settings
