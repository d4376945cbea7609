"""``adapters:`` in train.yaml (one LoRA per agent): read through the settings mechanism, bad input
refused with an error naming what is wrong."""

from __future__ import annotations

import pytest

from spanrl.errors import SettingError
from spanrl.settings_loader import load_settings
from spanrl.trainer_bridge.adapter_specs import AdapterSpec, adapter_of_agent
from spanrl.trainer_bridge.torch_backend.config import TrainerConfig
from spanrl.trainer_bridge.train_settings import TrainSettings


def train_settings(tmp_path, adapters_yaml: str, extra: str = "", environ: dict | None = None) -> TrainSettings:
    config = tmp_path / "train.yaml"
    config.write_text(f"model: {tmp_path}\ntasks: {tmp_path / 't.jsonl'}\n{extra}adapters:\n{adapters_yaml}")
    return load_settings(TrainSettings, "TRAIN", str(config), None, environ=environ or {})


def test_adapters_are_read_from_train_yaml_with_defaults(tmp_path):
    settings = train_settings(tmp_path, "  writer: {rank: 4}\n"
                                        "  fixers: {agents: [rewriter, checker], rank: 8, alpha: 4,"
                                        " target_modules: [q_proj, v_proj], learning_rate: 0.001}\n")
    writer, fixers = settings.trainer.adapter_specs
    assert writer == AdapterSpec("writer", ("writer",), rank=4, alpha=8)
    assert fixers == AdapterSpec("fixers", ("rewriter", "checker"), 8, 4, ("q_proj", "v_proj"), 0.001)
    assert fixers.scaling == 0.5
    assert adapter_of_agent(settings.trainer.adapter_specs) == {"writer": "writer", "rewriter": "fixers",
                                                                "checker": "fixers"}


def test_adapters_from_a_variable_override_the_file(tmp_path):
    settings = train_settings(tmp_path, "  writer: {rank: 4}\n",
                              environ={"OTEL_SPANRL_TRAIN_ADAPTERS": '{"solver": {"rank": 2}}'})
    assert [spec.name for spec in settings.trainer.adapter_specs] == ["solver"]


@pytest.mark.parametrize(("adapters", "message"), [
    ({"writer": {"rnak": 4}}, "adapters.writer: unknown keys ['rnak']"),
    ({"writer": {"rank": 0}}, "adapters.writer.rank must be a positive whole number, got 0"),
    ({"writer": {"rank": 2.5}}, "adapters.writer.rank must be a whole number"),
    ({"writer": {"alpha": -1}}, "adapters.writer.alpha must be a positive whole number"),
    ({"writer": {"agents": []}}, "adapters.writer.agents: list at least one agent"),
    ({"writer": {"learning_rate": "fast"}}, "adapters.writer.learning_rate must be a number"),
    ({"a": {"agents": ["writer"]}, "b": {"agents": ["writer", "x"]}}, "the agent 'writer' is in two adapters"),
    ({"bad name": {}}, "adapters.bad name: an adapter name is"),
    ({"default": {}}, "an adapter name is"),
    ({"writer": 3}, "adapters.writer: must be a mapping"),
])
def test_bad_adapters_are_refused_naming_the_mistake(adapters, message):
    with pytest.raises(SettingError, match=message.replace("[", r"\[").replace("]", r"\]")):
        TrainerConfig(adapters=adapters)


def test_adapters_and_the_whole_model_lora_conflict():
    with pytest.raises(SettingError, match="adapters: and trainer.lora_rank both set"):
        TrainerConfig(adapters={"writer": {}}, lora_rank=4)


def test_adapters_need_grpo(tmp_path):
    with pytest.raises(SettingError, match="trains with algorithm grpo only, not 'sft'"):
        train_settings(tmp_path, "  writer: {}\n", extra="algorithm: sft\n")


def test_verl_trains_every_adapter_with_one_lora_config(tmp_path):
    """verl's actor trains one LoRA config: adapters that differ in it are refused before verl starts."""
    settings = train_settings(tmp_path, "  writer: {rank: 4}\n  fixers: {agents: [rewriter], rank: 4}\n",
                              extra="backend: verl\n")
    assert [spec.name for spec in settings.backend_run().adapters] == ["writer", "fixers"]
    with pytest.raises(SettingError, match="every adapter has the same rank .*'writer' has 4, 'fixers' has 8"):
        train_settings(tmp_path, "  writer: {rank: 4}\n  fixers: {agents: [rewriter], rank: 8}\n",
                       extra="backend: verl\n")
    with pytest.raises(SettingError, match="every adapter has the same target_modules"):
        train_settings(tmp_path, "  writer: {}\n  fixers: {agents: [rewriter], target_modules: [q_proj]}\n",
                       extra="backend: verl\n")
    with pytest.raises(SettingError, match="adapters train at the run's learning_rate"):
        train_settings(tmp_path, "  writer: {learning_rate: 0.01}\n", extra="backend: verl\n")
    with pytest.raises(SettingError, match="adapters: and verl.lora_rank"):
        train_settings(tmp_path, "  writer: {}\n", extra="backend: verl\nverl: {lora_rank: 8}\n")


def test_an_adapter_of_every_agent_takes_what_no_other_adapter_claims():
    from spanrl.trainer_bridge.adapter_specs import choose_adapter, names_an_adapter, samples_by_adapter
    from spanrl.trainer_bridge.backend import TrainingSample

    adapters = {"writer": ("writer",), "rest": ("*",)}
    assert choose_adapter(adapters, "writer", None) == "writer"
    assert choose_adapter(adapters, "policy", "writer") == "writer"
    assert choose_adapter(adapters, "policy", "planner") == "rest"
    assert choose_adapter(adapters, "policy", None) == "rest"  # a call that names no agent
    assert choose_adapter(adapters, "*", None) == "rest" and not names_an_adapter(adapters, "*")
    assert choose_adapter({"writer": ("writer",)}, "policy", "planner") is None  # no such adapter: the base
    specs = (AdapterSpec("writer", ("writer",)), AdapterSpec("rest", ("*",)))
    samples = [TrainingSample(prompt_token_ids=[1], response_token_ids=[2], advantage=1.0, group_id="g",
                              agent_name=agent) for agent in ("writer", "planner", None)]
    groups = samples_by_adapter(specs, samples)
    assert [s.agent_name for s in groups["writer"]] == ["writer"]
    assert [s.agent_name for s in groups["rest"]] == ["planner", None]


def test_verl_lora_rank_is_one_adapter_of_every_agent(tmp_path):
    """verl's own LoRA sync never reaches vLLM's HTTP server, where the agents call: ``verl.lora_rank``
    trains and serves one adapter of every agent instead (verl_backend/adapters.py)."""
    from spanrl.trainer_bridge.verl_backend.config import LORA_PROJECTIONS

    config = tmp_path / "train.yaml"
    config.write_text(f"model: {tmp_path}\ntasks: {tmp_path / 't.jsonl'}\nbackend: verl\n"
                      "verl: {lora_rank: 16, lora_alpha: 32}\n")
    run = load_settings(TrainSettings, "TRAIN", str(config), None, environ={}).backend_run()
    assert run.adapters == (AdapterSpec("lora", ("*",), 16, 32, LORA_PROJECTIONS),)
    assert run.options.lora_rank == 0  # verl's own LoRA keys come from the adapter
    config.write_text(f"model: {tmp_path}\ntasks: {tmp_path / 't.jsonl'}\nbackend: verl\nalgorithm: sft\n"
                      "verl: {lora_rank: 16}\n")
    with pytest.raises(SettingError, match="verl.lora_rank trains with algorithm grpo only on backend verl"):
        load_settings(TrainSettings, "TRAIN", str(config), None, environ={})
