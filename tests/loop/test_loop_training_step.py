"""One training step through the real parts: what the loop hands to the torch backend.

Rollouts are sent with the real OTel SDK and OTLP/gRPC exporter to an in-process receiver,
which stores and assembles them into a real SQLite store; ``TrainingLoop.run_step`` opens a
round, waits for the attempts (played by a thread that claims them from the dispatcher, as a
runner would), collects and scores the rollouts and calls ``update`` on the real torch
backend (tiny model, policy server in a child process). The backend is wrapped only to
remember the samples it was given.

Checked: selective optimisation (``agents: [writer]``), transition-level advantages from
intermediate rewards, a reward function that raises, and what ``spanrl inspect`` shows of the
rewards and returns a step trained with.
"""

from __future__ import annotations

import json
import logging
import os
import statistics
import time
from concurrent.futures import Future, ThreadPoolExecutor

import pytest
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor

from spanrl.errors import SettingError
from spanrl.instrumentation import semconv
from spanrl.otlp_receiver.server import ReceiverServer
from spanrl.otlp_receiver.settings import ReceiverSettings
from spanrl.trainer_bridge.advantages import GRPO_EPSILON
from spanrl.trainer_bridge.backend import PolicyBackend, TrainingSample, UpdateStats
from spanrl.trainer_bridge.task_dispatch import Attempt
from spanrl.trainer_bridge.train_settings import TrainSettings
from spanrl.trainer_bridge.training_loop import TrainingLoop

# where models run in these tests: cpu, or cuda on a GPU machine (docs/gpu.md)
TEST_DEVICE = os.environ.get("SPANRL_TEST_DEVICE", "cpu")

AGENTS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "agents")
AGENT_CODES = {"planner": 0, "writer": 1, "critic": 2, "solver": 3}

# One LLM call of a played rollout: (agent name, its own reward event or None)
Call = tuple[str, float | None]


class RecordingBackend:
    """The real torch backend; remembers the samples of each ``update`` the loop made."""

    def __init__(self, backend: PolicyBackend) -> None:
        self.backend = backend
        self.updates: list[list[TrainingSample]] = []

    @property
    def policy_version(self) -> int:
        return self.backend.policy_version

    @property
    def endpoint_url(self) -> str:
        return self.backend.endpoint_url

    def update(self, samples) -> UpdateStats:
        self.updates.append(list(samples))
        return self.backend.update(samples)

    def save_checkpoint(self, root: str) -> str:
        return self.backend.save_checkpoint(root)

    def close(self) -> None:
        self.backend.close()


@pytest.fixture(scope="module")
def torch_backend(tmp_path_factory):
    """The torch backend on a fresh tiny model (one for the module: its policy server takes a
    few seconds to start). Tests compare policy versions before and after their steps."""
    import torch

    from spanrl.trainer_bridge.torch_backend.backend import start_backend
    from spanrl.trainer_bridge.torch_backend.model_init import create_model_dir

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("backend")
    model_dir = create_model_dir(root / "model", preset="tiny", seed=0)
    settings = TrainSettings(tasks=str(root / "unused.jsonl"), model=str(model_dir), device=TEST_DEVICE,
                             output_dir=str(root), policy_port=0, checkpoint_every=0, learning_rate=1e-3)
    backend = start_backend(settings.backend_run())
    assert isinstance(backend, PolicyBackend)
    try:
        yield backend
    finally:
        backend.close()
        torch.set_num_threads(threads)


@pytest.fixture
def receiver(tmp_path):
    """Start an in-process receiver (credit assignment as asked) and a tracer exporting to it."""
    started: list[tuple[ReceiverServer, TracerProvider]] = []

    def start(credit: str = "identical"):
        server = ReceiverServer(ReceiverSettings(
            grpc_port=0, http_port=0, db=str(tmp_path / "spanrl.db"), grace_s=0.2, poll_s=0.05,
            idle_timeout_s=0, credit=credit)).start()
        provider = TracerProvider(resource=Resource.create({"service.name": "loop-test-agent"}))
        provider.add_span_processor(SimpleSpanProcessor(
            OTLPSpanExporter(endpoint=f"127.0.0.1:{server.grpc_port}", insecure=True, timeout=10)))
        started.append((server, provider))
        return server, provider.get_tracer("loop-test-agent")

    yield start
    for server, provider in started:
        provider.shutdown()
        server.stop()


def prompt_ids(task_number: int, attempt: int, call: int) -> tuple[int, ...]:
    """Token ids that say which call of which rollout a sample came from."""
    return (1, 10 + task_number, 30 + attempt, 40 + call)


def emit_rollout(tracer, attempt: Attempt, calls: list[Call], answer: str | None = None) -> None:
    """The spans an instrumented agent sends for one attempt: the rollout span, one LLM span per
    call (token ids, agent name, its reward), the answer as a semantic variable."""
    identity = {semconv.ROLLOUT_ID: attempt.rollout_id, semconv.TASK_ID: attempt.task_id,
                semconv.ATTEMPT: attempt.attempt}
    with tracer.start_as_current_span(semconv.ROLLOUT_SPAN_NAME, attributes=identity) as root:
        for index, (agent_name, reward) in enumerate(calls):
            attributes = {
                **identity, "openinference.span.kind": "LLM", semconv.AGENT_NAME: agent_name,
                semconv.LLM_PROMPT_TOKEN_IDS: list(prompt_ids(attempt.task["number"], attempt.attempt, index)),
                semconv.llm_response_token_ids(0): [60 + AGENT_CODES[agent_name], 70 + index, 2],
            }
            with tracer.start_as_current_span(f"llm-{index}", attributes=attributes) as span:
                if reward is not None:
                    span.add_event(semconv.REWARD_EVENT, {semconv.REWARD_VALUE: reward})
        if answer is not None:
            root.set_attribute(semconv.variable("answer"), answer)


def play_round(loop: TrainingLoop, tracer, count: int, play) -> Future:
    """Claim ``count`` attempts from the loop's dispatcher in a thread, send each one's spans
    (``play(tracer, attempt)``) and report it ok; a failure is reported, never left waiting."""
    def work() -> list[str]:
        errors: list[str] = []
        served = 0
        deadline = time.monotonic() + 60
        while served < count and time.monotonic() < deadline:
            attempt = loop.dispatcher.claim()
            if attempt is None:
                time.sleep(0.01)
                continue
            try:
                play(tracer, attempt)
                loop.dispatcher.finish(attempt.rollout_id, "ok")
            except Exception as exc:  # reported so the step ends; the test fails on it
                errors.append(f"{attempt.rollout_id}: {exc!r}")
                loop.dispatcher.finish(attempt.rollout_id, "failed", repr(exc))
            served += 1
        return errors

    executor = ThreadPoolExecutor(max_workers=1)
    future = executor.submit(work)
    executor.shutdown(wait=False)
    return future


def run_one_step(loop: TrainingLoop, tracer, backend: RecordingBackend, play, step: int = 0) -> dict:
    settings = loop.settings
    played = play_round(loop, tracer, settings.tasks_per_step * settings.group_size, play)
    row = loop.run_step(step, backend)
    assert played.result(timeout=30) == []
    return row


def make_settings(tmp_path, tasks: list[dict], **overrides) -> TrainSettings:
    path = tmp_path / f"tasks-{tasks[0]['id']}.jsonl"
    path.write_text("".join(json.dumps({**task, "number": n}) + "\n" for n, task in enumerate(tasks)))
    values = dict(tasks=str(path), model="unused-by-the-loop", store=str(tmp_path / "spanrl.db"),
                  group_size=2, tasks_per_step=len(tasks), rollout_timeout_s=20.0, assembly_wait_s=20.0)
    return TrainSettings(**{**values, **overrides})


def test_only_the_selected_agents_calls_reach_the_update(tmp_path, receiver, torch_backend):
    _, tracer = receiver()
    settings = make_settings(tmp_path, [{"id": "mixed-a"}, {"id": "mixed-b"}, {"id": "critic-only"}],
                             agents=["writer"])
    loop = TrainingLoop(settings)
    backend = RecordingBackend(torch_backend)
    version = backend.policy_version

    def play(tracer, attempt: Attempt) -> None:
        if attempt.task_id == "critic-only":
            calls: list[Call] = [("critic", None), ("critic", None)]
        else:  # planner, writer, writer; the rollout's reward differs between the two attempts
            calls = [("planner", None), ("writer", None), ("writer", float(attempt.attempt))]
        emit_rollout(tracer, attempt, calls)

    row = run_one_step(loop, tracer, backend, play)
    loop.dispatcher.close()

    assert len(backend.updates) == 1
    samples = backend.updates[0]
    expected = {prompt_ids(n, a, call) for n in (0, 1) for a in (0, 1) for call in (1, 2)}
    assert {tuple(s.prompt_token_ids) for s in samples} == expected
    assert len(samples) == len(expected)
    assert {s.response_token_ids[0] for s in samples} == {60 + AGENT_CODES["writer"]}
    # the two critic-only rollouts have no call to train: left out and counted
    assert row["rollout/left_out"] == {"no_selected_agent": 2}
    assert row["rollout/count"] == 6 and row["rollout/used"] == 4 and row["actor/transitions"] == 8
    assert row["actor/policy_version"] == backend.policy_version == version + 1


def test_transition_level_advantages_from_intermediate_rewards(tmp_path, receiver, torch_backend):
    """Each call carries its own reward; the receiver's ``discounted`` credit (gamma 1) makes
    reward-to-go returns; ``advantage_level: transition`` normalises them over all transitions
    of the task's group, as verl's GRPO does with one score per sample."""
    _, tracer = receiver(credit="discounted")
    settings = make_settings(tmp_path, [{"id": "t0"}, {"id": "t1"}], group_size=3,
                             advantage_level="transition")
    loop = TrainingLoop(settings)
    backend = RecordingBackend(torch_backend)
    # rewards[(task number, attempt)] = the reward of each call, in call order
    rewards = {
        (0, 0): [0.5, 0.0, 1.0], (0, 1): [0.0, -0.25], (0, 2): [0.125, 0.25, 0.0, 2.0],
        (1, 0): [1.0], (1, 1): [0.0, 0.0, 0.75], (1, 2): [-1.0, 0.5],
    }

    def play(tracer, attempt: Attempt) -> None:
        values = rewards[(attempt.task["number"], attempt.attempt)]
        emit_rollout(tracer, attempt, [("solver", value) for value in values])

    row = run_one_step(loop, tracer, backend, play)
    loop.dispatcher.close()

    expected: dict[tuple[int, ...], float] = {}
    for task_number in (0, 1):
        returns = {}
        for attempt in range(3):
            values = rewards[(task_number, attempt)]
            for call in range(len(values)):
                returns[prompt_ids(task_number, attempt, call)] = sum(values[call:])  # reward-to-go
        mean, std = statistics.mean(returns.values()), statistics.stdev(returns.values())
        expected.update({key: (value - mean) / (std + GRPO_EPSILON) for key, value in returns.items()})

    assert len(backend.updates) == 1
    given = {tuple(s.prompt_token_ids): s.advantage for s in backend.updates[0]}
    assert set(given) == set(expected)
    for key, advantage in expected.items():
        assert given[key] == pytest.approx(advantage, rel=1e-5, abs=1e-6), key
    # transition-level: calls of one rollout get different advantages
    assert given[prompt_ids(0, 0, 0)] != pytest.approx(given[prompt_ids(0, 0, 2)])
    assert row["actor/transitions"] == sum(len(v) for v in rewards.values()) and row["rollout/left_out"] == {}
    # `spanrl inspect` shows the reward-to-go each call was trained with, and the rollout's events
    shown = json.loads(spanrl_inspect(settings.store, "transitions", "--json"))
    for t in shown:
        task_number, attempt = int(t["rollout_id"].split("-t")[1][0]), int(t["rollout_id"].split("-a")[1][0])
        assert t["trained_return"] == t["return"] == pytest.approx(
            sum(rewards[(task_number, attempt)][t["index"]:])), t["rollout_id"]
    table = spanrl_inspect(settings.store, "rollouts")
    assert table.count("events: spanrl.reward (step 1)") == 6, table


def test_a_raising_reward_function_leaves_the_rollout_out_and_training_goes_on(
        tmp_path, receiver, torch_backend, caplog):
    _, tracer = receiver()
    reward = "picky_reward:reward"
    mixed = TrainingLoop(make_settings(
        tmp_path, [{"id": "good-1", "answer": "7"}, {"id": "good-2", "answer": "9"},
                   {"id": "buggy", "answer": "3", "reward": "raise"}],
        reward=reward, python_path=[AGENTS_DIR]))
    backend = RecordingBackend(torch_backend)
    version = backend.policy_version

    def play(tracer, attempt: Attempt) -> None:  # attempt 0 answers right, attempt 1 wrong
        answer = attempt.task["answer"] if attempt.attempt == 0 else "0"
        emit_rollout(tracer, attempt, [("solver", None)], answer=answer)

    with caplog.at_level(logging.ERROR, logger="spanrl.trainer_bridge.training_loop"):
        row = run_one_step(mixed, tracer, backend, play)
    failures = [r for r in caplog.records if "reward function" in r.getMessage()]
    assert len(failures) == 2 and all("task buggy" in r.getMessage() for r in failures)
    assert all(r.exc_info and "no grading rule for task buggy" in str(r.exc_info[1]) for r in failures)
    assert row["rollout/left_out"] == {"reward_error": 2}
    assert row["rollout/used"] == 4 and row["rollout/reward_mean"] == pytest.approx(0.5)
    trained = {tuple(s.prompt_token_ids)[1] - 10 for s in backend.updates[0]}
    assert trained == {0, 1}  # task numbers of good-1 and good-2; nothing of the buggy task
    assert row["actor/policy_version"] == version + 1

    # A step where the reward function raised on every rollout: no update (the policy version
    # stays), the row says why, reward_mean is reported as 0.0, and the next step trains again.
    caplog.clear()
    all_buggy = TrainingLoop(make_settings(
        tmp_path, [{"id": "buggy-1", "answer": "1", "reward": "raise"},
                   {"id": "buggy-2", "answer": "2", "reward": "raise"}],
        reward=reward, python_path=[AGENTS_DIR]))
    with caplog.at_level(logging.ERROR, logger="spanrl.trainer_bridge.training_loop"):
        empty = run_one_step(all_buggy, tracer, backend, play)
    assert len(backend.updates) == 1
    assert empty["rollout/left_out"] == {"reward_error": 4}
    assert empty["actor/transitions"] == 0 and empty["rollout/used"] == 0 and empty["rollout/reward_mean"] == 0.0
    assert empty["actor/policy_version"] == version + 1 and "actor/loss" not in empty
    assert len([r for r in caplog.records if "reward function" in r.getMessage()]) == 4

    again = run_one_step(mixed, tracer, backend, play, step=1)
    assert again["rollout/left_out"] == {"reward_error": 2}
    assert len(backend.updates) == 2 and again["actor/policy_version"] == version + 2
    for loop in (mixed, all_buggy):
        loop.dispatcher.close()


def spanrl_inspect(store: str, *argv: str) -> str:
    import subprocess
    import sys

    result = subprocess.run([sys.executable, "-m", "spanrl", "inspect", *argv, "--db", store],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    return result.stdout


def test_inspect_shows_the_reward_a_reward_function_gave_and_the_returns_trained_with(
        tmp_path, receiver, torch_backend):
    """With a reward function the receiver has no reward (total_reward None): ``spanrl inspect``
    shows the one the trainer trained with, its source and step, and each transition's return."""
    _, tracer = receiver()
    settings = make_settings(tmp_path, [{"id": "q1", "answer": "7"}, {"id": "q2", "answer": "9"}],
                             reward="picky_reward:reward", python_path=[AGENTS_DIR])
    loop = TrainingLoop(settings)

    def play(tracer, attempt: Attempt) -> None:  # attempt 0 answers right, attempt 1 wrong; two calls
        answer = attempt.task["answer"] if attempt.attempt == 0 else "0"
        emit_rollout(tracer, attempt, [("solver", None), ("solver", None)], answer=answer)

    run_one_step(loop, tracer, RecordingBackend(torch_backend), play)
    loop.dispatcher.close()

    rollouts = json.loads(spanrl_inspect(settings.store, "rollouts", "--json"))
    assert len(rollouts) == 4
    for item in rollouts:
        assert item["assembled"]["total_reward"] is None  # no reward event: the receiver has none
        attempt = int(item["rollout_id"].split("-a")[1].split("-")[0])
        expected = 1.0 if attempt == 0 else 0.0
        assert item["trained"] == {"step": 1, "reward": expected, "used": True,
                                   "reward_source": "reward function picky_reward:reward",
                                   "returns": {"0": expected, "1": expected}}
    right = next(r["rollout_id"] for r in rollouts if r["trained"]["reward"] == 1.0)
    table = spanrl_inspect(settings.store, "rollouts")
    assert "reward function picky_reward:reward (step 1)" in table and "None" not in table
    one = spanrl_inspect(settings.store, "rollout", right)
    assert "reward 1 (reward function picky_reward:reward (step 1))" in one
    transitions = json.loads(spanrl_inspect(settings.store, "transitions", "--json", "--rollout", right))
    assert [(t["index"], t["return"], t["trained_return"], t["trained_step"]) for t in transitions] == [
        (0, 0.0, 1.0, 1), (1, 0.0, 1.0, 1)]
    assert all("return_" not in t for t in transitions)


def test_drop_uniform_groups_trains_only_the_groups_whose_rewards_differ(tmp_path, receiver, torch_backend):
    """``drop_uniform_groups``: a task whose attempts all scored the same (all solved, all failed)
    has advantages of 0; its rollouts are left out of the update, counted and shown unused, and
    the rollout loss weights are those of what is kept."""
    _, tracer = receiver()
    tasks = [{"id": "mixed"}, {"id": "all-solved"}, {"id": "all-failed"}]
    settings = make_settings(tmp_path, tasks, drop_uniform_groups=True, loss_weighting="rollout")
    loop = TrainingLoop(settings)
    backend = RecordingBackend(torch_backend)
    version = backend.policy_version
    scores = {"mixed": (1.0, 0.0), "all-solved": (1.0, 1.0), "all-failed": (0.0, 0.0)}

    def play(tracer, attempt: Attempt) -> None:  # two calls; the second carries the rollout's reward
        emit_rollout(tracer, attempt, [("solver", None), ("solver", scores[attempt.task_id][attempt.attempt])])

    row = run_one_step(loop, tracer, backend, play)
    loop.dispatcher.close()

    (samples,) = backend.updates
    assert {s.group_id for s in samples} == {"mixed"} and len(samples) == 4
    assert sorted(s.group_advantage for s in samples) == pytest.approx([-0.5 / (0.5 ** 0.5 + GRPO_EPSILON)] * 2
                                                                       + [0.5 / (0.5 ** 0.5 + GRPO_EPSILON)] * 2)
    assert [s.loss_weight for s in samples] == pytest.approx([1.0] * 4)  # two rollouts of equal length kept
    assert row["rollout/uniform_groups_dropped"] == 2 and row["rollout/groups_of_one_dropped"] == 0
    # the groups GRPO gets no signal from, by the score all their rollouts got, whatever drop_uniform_groups says
    assert row["rollout/groups"] == 3 and row["rollout/groups_without_signal"] == {"1": 1, "0": 1}
    assert loop.task_scores.without_signal() == {"0": ["all-failed"], "1": ["all-solved"]}
    assert row["rollout/count"] == 6 and row["rollout/used"] == 2 and row["actor/transitions"] == 4
    assert row["actor/policy_version"] == version + 1
    used = sorted((item["rollout_id"], item["trained"]["used"])
                  for item in json.loads(spanrl_inspect(settings.store, "rollouts", "--json")))
    assert len(used) == 6 and all(flag is ("-mixed-" in rollout_id) for rollout_id, flag in used), used


def test_the_advantage_scales_reach_the_update(tmp_path, receiver, torch_backend):
    """``positive_advantage_scale`` / ``negative_advantage_scale`` from the settings scale the
    advantages the backend trains on: the success's by one factor, the failure's by the other."""
    _, tracer = receiver()
    settings = make_settings(tmp_path, [{"id": "mixed"}], positive_advantage_scale=0.1,
                             negative_advantage_scale=0.5)
    loop = TrainingLoop(settings)
    backend = RecordingBackend(torch_backend)

    def play(tracer, attempt: Attempt) -> None:  # attempt 0 solves the task, attempt 1 fails it
        emit_rollout(tracer, attempt, [("solver", None), ("solver", 1.0 - attempt.attempt)])

    run_one_step(loop, tracer, backend, play)
    loop.dispatcher.close()

    (samples,) = backend.updates
    grpo = 0.5 / (0.5 ** 0.5 + GRPO_EPSILON)  # GRPO's advantage of a 1-of-2 group
    assert len(samples) == 4 and {s.reward for s in samples} == {1.0, 0.0}
    for sample in samples:
        expected = 0.1 * grpo if sample.reward == 1.0 else -0.5 * grpo
        assert sample.group_advantage == pytest.approx(expected, rel=1e-6), sample


def test_reinforce_plus_plus_pushes_groups_that_all_scored_the_same(tmp_path, receiver, torch_backend):
    """``advantage_estimator: reinforce_plus_plus``: the whole batch is the baseline, so a task
    whose attempts all succeeded is pushed up and one whose attempts all failed down, where GRPO
    gives both 0; every rollout reaches the update, with its advantage on all of its calls."""
    _, tracer = receiver()
    tasks = [{"id": "mixed"}, {"id": "all-solved"}, {"id": "all-failed"}]
    settings = make_settings(tmp_path, tasks, advantage_estimator="reinforce_plus_plus")
    loop = TrainingLoop(settings)
    backend = RecordingBackend(torch_backend)
    scores = {"mixed": (1.0, 0.0), "all-solved": (1.0, 1.0), "all-failed": (0.0, 0.0)}
    played: dict[str, float] = {}

    def play(tracer, attempt: Attempt) -> None:
        played[attempt.rollout_id] = scores[attempt.task_id][attempt.attempt]
        emit_rollout(tracer, attempt, [("solver", None), ("solver", played[attempt.rollout_id])])

    row = run_one_step(loop, tracer, backend, play)
    loop.dispatcher.close()

    (samples,) = backend.updates
    assert len(samples) == 12 and row["rollout/used"] == 6
    scale = 1 / (statistics.variance(played.values()) + 1e-8) ** 0.5  # 3 of 6 solved: mean 0.5
    for sample in samples:
        assert sample.group_advantage == pytest.approx((played[sample.rollout_id] - 0.5) * scale, abs=1e-6)
    by_group = {task: sorted(s.group_advantage for s in samples if s.group_id == task) for task in scores}
    assert by_group["all-solved"] == pytest.approx([0.5 * scale] * 4)  # GRPO: 0
    assert by_group["all-failed"] == pytest.approx([-0.5 * scale] * 4)  # GRPO: 0
    with pytest.raises(SettingError, match="drop_uniform_groups"):
        make_settings(tmp_path, tasks, advantage_estimator="reinforce_plus_plus", drop_uniform_groups=True)
    with pytest.raises(SettingError, match="Dr.GRPO"):
        make_settings(tmp_path, tasks, advantage_estimator="reinforce_plus_plus", norm_adv_by_std=False)
    with pytest.raises(SettingError, match="advantage_estimator must be one of"):
        make_settings(tmp_path, tasks, advantage_estimator="ppo")


def test_groups_without_signal_are_logged_and_shown_by_inspect_metrics(tmp_path, caplog):
    import subprocess
    import sys

    from spanrl.trainer_bridge.session import say_groups_without_signal

    rows = [{"step": 1, "rollout/reward_mean": 0.5, "rollout/groups": 8, "rollout/groups_without_signal": {"0": 3}},
            {"step": 2, "rollout/reward_mean": 0.6, "rollout/groups": 8, "rollout/groups_without_signal": {}}]
    with caplog.at_level(logging.INFO, logger="spanrl.trainer_bridge.session"):
        for row in rows:
            say_groups_without_signal(row)
    said = [r.getMessage() for r in caplog.records]
    assert said == ["step 1: 3 of 8 task groups scored the same in every rollout (3 all 0): nothing to compare there"]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    shown = subprocess.run([sys.executable, "-m", "spanrl", "inspect", "metrics", str(tmp_path)],
                           capture_output=True, text=True, timeout=60)
    assert shown.returncode == 0, shown.stderr
    header, *lines = [line for line in shown.stdout.splitlines() if line.strip() and not set(line) <= set("- ")]
    start = header.index("flat_groups")
    assert [line[start:start + len("flat_groups")].strip() for line in lines] == ["3/8", "0/8"]


def test_the_summary_names_the_tasks_no_update_could_learn_from():
    from spanrl.schema.scored import ScoredRollout
    from spanrl.trainer_bridge.samples import TaskScores
    from spanrl.trainer_bridge.train_cli import training_summary

    def scored(task_id: str, attempt: int, score: float) -> ScoredRollout:
        return ScoredRollout(Attempt(f"{task_id}-{attempt}", task_id, attempt, {"id": task_id}, 0), score, ())

    scores = TaskScores()
    for task_id, values in {"hard": (0.0, 0.0), "mixed": (0.0, 1.0), "alone": (0.0,), "easy": (1.0, 1.0)}.items():
        scores.add([scored(task_id, i, score) for i, score in enumerate(values)])
    scores.add([scored("hard", 2, 0.0)])  # a later step: still nothing
    flat = {**scores.without_signal(), "0": [f"t{i}" for i in range(7)]}
    assert scores.without_signal() == {"0": ["hard"], "1": ["easy"]}
    summary = {"steps": 2, "policy_version": 2, "first_reward": 0.1, "last_reward": 0.4, "best_reward": 0.4,
               "best_step": 2, "checkpoints": "c", "checkpoint": "c/2", "metrics": "m", "plot": "p",
               "tasks_without_signal": flat}
    last = training_summary(summary).splitlines()[-1]
    assert last == ("  tasks whose rollouts all scored the same, nothing to learn from: "
                    "7 scored 0 (t0, t1, t2, t3, t4, +2 more); 1 scored 1 (easy)")
    assert "nothing to learn" not in training_summary({**summary, "tasks_without_signal": {}})


def test_a_step_whose_groups_were_all_uniform_says_why_it_trained_on_nothing():
    from spanrl.trainer_bridge.empty_steps import empty_step_reason

    row = {"step": 3, "rollout/count": 8, "rollout/left_out": {}, "actor/transitions": 0,
           "rollout/groups_of_one_dropped": 0, "rollout/uniform_groups_dropped": 4}
    reason = empty_step_reason(row)
    assert reason is not None and reason.startswith("step 3 trained on nothing: 8 rollouts (none left out)")
    assert "drop_uniform_groups" in reason and "same reward" in reason
    assert "drop_uniform_groups" not in (empty_step_reason({**row, "rollout/uniform_groups_dropped": 0}) or "")
