"""Every command's settings through the real CLI: precedence, nested blocks, masking, errors.

``spanrl.cli.settings_from_args`` parses argv with the real parser and builds the settings
object a command would run with; subprocess tests run ``python -m spanrl ... --print-settings``
and the error paths end to end.
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import fields

import pytest

from spanrl import cli
from spanrl.trainer_bridge.torch_backend.config import EngineConfig, TrainerConfig
from spanrl.trainer_bridge.train_settings import (
    ENGINE_FROM_TOP_LEVEL,
    TRAINER_DERIVED,
    TRAINER_FROM_TOP_LEVEL,
)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(autouse=True)
def no_spanrl_variables(monkeypatch):
    for name in list(os.environ):
        if name.startswith("OTEL_SPANRL_"):
            monkeypatch.delenv(name)


def spanrl(*argv: str, env: dict | None = None, cwd: str | None = None) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_SPANRL_")}
    return subprocess.run([sys.executable, "-m", "spanrl", *argv], capture_output=True, text=True,
                          timeout=120, env={**clean, **(env or {})}, cwd=cwd or REPO)


# command argv (before the config file), how the file is given, what the file must hold, the
# variable prefix, then four settings: (field, flag text, variable text, file value, default, flag/env/file result)
COMMANDS = {
    "receive": (["receive"], "--config", {}, "RECEIVER",
                ("grpc_port", "grpc_port", "http_port", "workers", "poll_s"),
                ("1111", "2222", 3333, 0.2), (1111, 2222, 3333)),
    "serve": (["serve", "model-dir"], "--config", {}, "SERVE",
              ("port", "port", "max_batch_size", "threads", "batch_wait_ms"),
              ("9001", "7", 3, 20.0), (9001, 7, 3)),
    "train": (["train"], "positional", {"tasks": "t.jsonl", "model": "m"}, "TRAIN",
              ("steps", "steps", "group_size", "tasks_per_step", "seed"),
              ("5", "4", 3, 0), (5, 4, 3)),
    "run": (["run"], "positional", {"agent": "pkg.mod:solve"}, "RUN",
            ("concurrency", "concurrency", "bridge_wait_s", "bridge_url", "otlp_endpoint"),
            ("3", "9.5", "http://file:1", "http://127.0.0.1:4317"), (3, 9.5, "http://file:1")),
    "demo": (["demo"], "--config", {}, "DEMO",
             ("steps", "steps", "group_size", "concurrency", "seed"),
             ("11", "6", 5, 0), (11, 6, 5)),
    "model init": (["model", "init", "out-dir"], "--config", {}, "MODEL_INIT",
                   ("seed", "seed", "vocab_size", "preset", "force"),
                   ("7", "500", "small", False), (7, 500, "small")),
    "proxy": (["proxy"], "--config", {"upstream": "https://api.example.com/v1"}, "PROXY",
              ("port", "port", "request_timeout_s", "upstream_model", "host"),
              ("9100", "30.5", "from-file", "127.0.0.1"), (9100, 30.5, "from-file")),
    "prompts export": (["prompts", "export"], "--config", {}, "PROMPTS_EXPORT",
                       ("url", "url", "output", "active_only", "force"),
                       ("http://flag:1", "out.yaml", True, False), ("http://flag:1", "out.yaml", True)),
}


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_flag_beats_variable_beats_file_beats_default_for_every_command(command, tmp_path, monkeypatch):
    import yaml

    argv, config_style, required, prefix, names, values, expected = COMMANDS[command]
    _, flagged, env_only, file_only, untouched = names
    flag_text, env_text, file_value, default = values
    config = tmp_path / "settings.yaml"
    # the flagged setting is also in the variables and the file; the variable one also in the file
    config.write_text(yaml.safe_dump({**required, flagged: 1, env_only: 2, file_only: file_value}))
    monkeypatch.setenv(f"OTEL_SPANRL_{prefix}_{flagged.upper()}", "999")
    monkeypatch.setenv(f"OTEL_SPANRL_{prefix}_{env_only.upper()}", env_text)
    file_args = [str(config)] if config_style == "positional" else ["--config", str(config)]
    settings = cli.settings_from_args([*argv, *file_args, "--" + flagged.replace("_", "-"), flag_text])
    assert getattr(settings, flagged) == expected[0]
    assert getattr(settings, env_only) == expected[1]
    assert getattr(settings, file_only) == expected[2]
    assert getattr(settings, untouched) == default
    # without the file and the variables, the defaults
    monkeypatch.delenv(f"OTEL_SPANRL_{prefix}_{env_only.upper()}")
    monkeypatch.delenv(f"OTEL_SPANRL_{prefix}_{flagged.upper()}")
    if required:
        for key, value in required.items():
            monkeypatch.setenv(f"OTEL_SPANRL_{prefix}_{key.upper()}", value)
    settings = cli.settings_from_args(argv)
    defaults = {f.name: f.default for f in fields(type(settings))}
    assert getattr(settings, env_only) == defaults[env_only]
    assert getattr(settings, file_only) == defaults[file_only]


def test_positional_settings_come_from_variables_too(monkeypatch):
    monkeypatch.setenv("OTEL_SPANRL_SERVE_MODEL_DIR", "from-env")
    assert cli.settings_from_args(["serve"]).model_dir == "from-env"
    assert cli.settings_from_args(["serve", "from-arg"]).model_dir == "from-arg"
    result = spanrl("serve", "--print-settings")
    assert result.returncode == 2
    assert result.stderr.strip() == ("spanrl serve: model_dir is required: give it as an argument, as "
                                     "OTEL_SPANRL_SERVE_MODEL_DIR or in the config file")


def test_nested_trainer_and_engine_blocks_from_yaml_variables_and_flags(tmp_path, monkeypatch):
    config = tmp_path / "train.yaml"
    config.write_text(
        "tasks: t.jsonl\nmodel: m\nlearning_rate: 0.01\ndevice: cpu\noutput_dir: out\n"
        "trainer:\n  clip_ratio_low: 0.1\n  clip_ratio_high: 0.3\n  ppo_epochs: 2\n"
        "  lora_target_modules: [q_proj, v_proj]\n  betas: [0.8, 0.95]\n"
        "engine:\n  max_batch_size: 4\n  batch_wait_ms: 5\n"
    )
    monkeypatch.setenv("OTEL_SPANRL_TRAIN_TRAINER_CLIP_RATIO_HIGH", "0.28")  # variable over the file
    monkeypatch.setenv("OTEL_SPANRL_TRAIN_TRAINER_PPO_EPOCHS", "3")
    monkeypatch.setenv("OTEL_SPANRL_TRAIN_ENGINE_DTYPE", "bfloat16")
    settings = cli.settings_from_args([
        "train", str(config), "--trainer-ppo-epochs", "4", "--trainer-kl-estimator", "k1",
        "--engine-threads", "2", "--trainer-micro-batch-tokens", "1024",
    ])
    trainer, engine = settings.trainer, settings.engine
    assert trainer.clip_ratio_low == 0.1  # file
    assert trainer.clip_ratio_high == 0.28  # variable
    assert trainer.ppo_epochs == 4  # flag over variable and file
    assert trainer.kl_estimator == "k1" and trainer.micro_batch_tokens == 1024
    assert trainer.lora_target_modules == ("q_proj", "v_proj") and trainer.betas == (0.8, 0.95)
    assert trainer.grad_clip == 1.0  # default
    # the top-level keys own their trainer/engine settings
    assert trainer.learning_rate == 0.01 and trainer.device == "cpu" and engine.device == "cpu"
    assert trainer.checkpoint_dir == os.path.join("out", "checkpoints")
    assert trainer.checkpoint_every == settings.checkpoint_every == 10
    assert (engine.max_batch_size, engine.batch_wait_ms, engine.dtype, engine.threads) == (4, 5.0, "bfloat16", 2)
    # a list flag: comma-separated, JSON or repeated
    for flags in (["--trainer-lora-target-modules", "q_proj,k_proj"],
                  ["--trainer-lora-target-modules", '["q_proj", "k_proj"]'],
                  ["--trainer-lora-target-modules", "q_proj", "--trainer-lora-target-modules", "k_proj"]):
        assert cli.settings_from_args(["train", str(config), *flags]).trainer.lora_target_modules == (
            "q_proj", "k_proj")


def test_every_trainer_and_engine_setting_has_exactly_one_name():
    result = spanrl("train", "--help")
    assert result.returncode == 0, result.stderr
    text = result.stdout
    for block, config, top_level, derived in (("trainer", TrainerConfig, TRAINER_FROM_TOP_LEVEL, TRAINER_DERIVED),
                                             ("engine", EngineConfig, ENGINE_FROM_TOP_LEVEL, ())):
        for field in fields(config):
            nested = f"--{block}-{field.name.replace('_', '-')} "
            top = f"--{field.name.replace('_', '-')} "
            if field.name in top_level:
                assert top in text and nested not in text, field.name
            elif field.name in derived:
                assert nested not in text, field.name
            else:
                assert nested in text, field.name
                assert f"OTEL_SPANRL_TRAIN_{block.upper()}_{field.name.upper()}" in text.replace("\n", "").replace(
                    " ", ""), field.name


def test_a_setting_given_under_the_wrong_name_is_refused(tmp_path):
    config = tmp_path / "train.yaml"
    config.write_text("tasks: t.jsonl\nmodel: m\ntrainer:\n  learning_rate: 0.1\n")
    result = spanrl("train", str(config), "--print-settings")
    assert result.returncode == 2
    assert result.stderr.strip() == (f"spanrl train: config file {config}: trainer.learning_rate is set by the "
                                     "top-level key 'learning_rate', not inside 'trainer:'")
    config.write_text("tasks: t.jsonl\nmodel: m\ntrainer:\n  clip_ratio_lo: 0.1\n")
    result = spanrl("train", str(config), "--print-settings")
    assert result.returncode == 2 and "trainer.clip_ratio_lo" in result.stderr
    assert spanrl("train", str(config), "--trainer-learning-rate", "0.1").returncode == 2  # no such flag


def test_printed_settings_mask_secrets(tmp_path):
    receive = spanrl("receive", "--print-settings", env={"OTEL_SPANRL_RECEIVER_TOKEN": "tok-receive"})
    assert receive.returncode == 0, receive.stderr
    assert "token = ***" in receive.stdout and "tok-receive" not in receive.stdout + receive.stderr
    assert "OTEL_SPANRL_RECEIVER_TOKEN" in receive.stdout

    serve = spanrl("serve", "m", "--token", "tok-serve", "--print-settings")
    assert serve.returncode == 0, serve.stderr
    assert "token = ***" in serve.stdout and "tok-serve" not in serve.stdout

    config = tmp_path / "run.yaml"
    config.write_text("agent: pkg.mod:solve\nenv:\n  OPENAI_API_KEY: sk-file\n  MY_FLAG: visible\n")
    run = spanrl("run", str(config), "--print-settings",
                 env={"OTEL_SPANRL_RUN_ENV": '{"HF_TOKEN": "hf-env", "DB_PASSWORD": "pw", "MODE": "fast"}'})
    assert run.returncode == 0, run.stderr
    printed = run.stdout
    assert "hf-env" not in printed and "pw'" not in printed and "'HF_TOKEN': '***'" in printed
    assert "'DB_PASSWORD': '***'" in printed and "'MODE': 'fast'" in printed  # the variable beats the file
    assert "sk-file" not in printed
    # the runner still gets the real value
    settings = cli.settings_from_args(["run", str(config)])
    assert settings.env == {"OPENAI_API_KEY": "sk-file", "MY_FLAG": "visible"}


def test_serve_reads_its_old_model_name_variable_with_a_warning(monkeypatch, caplog):
    monkeypatch.setenv("OTEL_SPANRL_SERVE_MODEL_NAME", "old-name")
    with caplog.at_level("WARNING"):
        assert cli.settings_from_args(["serve", "m"]).served_model_name == ["old-name"]  # now a list of names
    assert "OTEL_SPANRL_SERVE_MODEL_NAME is deprecated" in caplog.text
    assert "OTEL_SPANRL_SERVE_SERVED_MODEL_NAME" in caplog.text
    monkeypatch.setenv("OTEL_SPANRL_SERVE_SERVED_MODEL_NAME", "new-name")
    assert cli.settings_from_args(["serve", "m"]).served_model_name == ["new-name"]


@pytest.mark.parametrize("argv, message", [
    (["train", "no-such-file.yaml"], "spanrl train: config file not found: no-such-file.yaml"),
    (["receive", "--sync", "sometimes"], "spanrl receive: sync must be full, normal or extra, got 'sometimes'"),
    (["run", "--agent", "no_colon"], "spanrl run: agent must look like 'module:function', got 'no_colon'"),
    (["model", "init", "out", "--preset", "huge", "--print-settings"],
     "spanrl model init: preset must be one of ['small', 'tiny'], got 'huge'"),
    (["demo", "--steps", "many"], "spanrl demo: --steps: invalid value 'many': invalid literal for int() "
                                  "with base 10: 'many'"),
    (["inspect", "rollouts", "--db", "no-such.db"], "spanrl inspect: no span store at no-such.db (use --db PATH)"),
])
def test_a_user_error_is_one_line_and_exit_2(argv, message, tmp_path):
    result = spanrl(*argv, cwd=str(tmp_path))
    assert result.returncode == 2
    assert result.stderr.strip() == message
    assert "Traceback" not in result.stderr


def test_a_user_error_raised_while_running_is_one_line(tmp_path):
    (tmp_path / "tasks.jsonl").write_text("")
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    result = spanrl("train", "--tasks", str(tmp_path / "tasks.jsonl"), "--model", str(model),
                    "--output-dir", str(tmp_path / "run"), "--device", "cpu")
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [f"spanrl train: task file {tmp_path / 'tasks.jsonl'} holds no tasks"]


BUG = """
import sys
import spanrl.otlp_receiver.receive_cli as receive_cli
from spanrl.cli import main

def handle(settings):
    raise ValueError("internal invariant broken")  # a bug, even though it is a ValueError

receive_cli.handle = handle
sys.exit(main(["receive", "--grpc-port", "0"]))
"""


def test_a_bug_shows_its_traceback_and_exits_1():
    result = subprocess.run([sys.executable, "-c", BUG], capture_output=True, text=True, timeout=60, cwd=REPO)
    assert result.returncode == 1
    assert "Traceback (most recent call last)" in result.stderr
    assert "ValueError: internal invariant broken" in result.stderr
    assert "spanrl receive: internal error" in result.stderr


def test_ctrl_c_exits_130(monkeypatch):
    import spanrl.otlp_receiver.receive_cli as receive_cli

    def interrupted(settings):
        raise KeyboardInterrupt

    monkeypatch.setattr(receive_cli, "handle", interrupted)
    assert cli.main(["receive", "--grpc-port", "0"]) == 130


BROKEN_COMMAND = """
import sys
from spanrl import cli

cli.COMMAND_MODULES["broken"] = "broken_command_module"
sys.exit(cli.main(sys.argv[1:]))
"""


@pytest.mark.parametrize("argv", [["--help"], ["receive", "--print-settings"]])
def test_a_command_module_that_fails_to_import_stops_spanrl(argv, tmp_path):
    (tmp_path / "broken_command_module.py").write_text("import a_dependency_that_is_not_installed\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}
    result = subprocess.run([sys.executable, "-c", BROKEN_COMMAND, *argv], capture_output=True, text=True,
                            timeout=60, cwd=REPO, env=env)
    assert result.returncode == 1
    assert "the 'broken' command's module broken_command_module failed to import" in result.stderr
    assert "No module named 'a_dependency_that_is_not_installed'" in result.stderr
    assert "Traceback" in result.stderr


def test_spanrl_help_does_not_import_torch():
    code = "import sys\nfrom spanrl.cli import build_parser\nbuild_parser()\nprint('torch' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=REPO)
    assert result.stdout.strip() == "False", result.stderr
