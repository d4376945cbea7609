"""``reward: judge`` through real processes: a judge model scores each GRPO group in one request.

``spanrl receive``, ``spanrl train`` (tiny model, embedded torch backend) and ``spanrl run`` with the
calculator agent. The judge is first a small real HTTP server of this test answering as a judge does
(the real ``openai`` client of the trainer calls it): it scores run 1 of each group 1 and the others
0, answers not-JSON for task t-1 and too few scores for task t-2; its score is combined with a
reward function (``judge.combine_with``, ``judge.weight``). Checked: one request per group,
holding every member's run; the judged groups are trained on (scores recorded in the store as
``gen_ai.evaluation.result`` events with the explanation, which ``spanrl inspect rollout ID`` shows,
and as the trained reward); the two failed groups are left out as ``judge_failed`` with the reason
logged, never scored 0; the judge's API key is sent as the bearer token and never logged. Then
``spanrl serve`` (a tiny model that cannot answer JSON) is the judge: every group fails, with the
reason logged, and the step trains on nothing.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from spanrl.child_processes import free_port
from spanrl.demo import CALC_AGENT
from spanrl.schema.metrics import read_metrics
from spanrl.trainer_bridge.torch_backend.model_init import create_model_dir

TEST_DEVICE = os.environ.get("SPANRL_TEST_DEVICE", "cpu")
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
KEY = "sk-judge-test-7c1e52a9d3"  # must reach the judge as the bearer token and never a log
GROUP, TASKS = 3, 4


class JudgeServer:
    """An OpenAI-compatible chat endpoint on a free port answering as a judge (module docstring)."""

    def __init__(self) -> None:
        self.requests: list[dict] = []
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server's name
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                server.requests.append({"auth": self.headers.get("Authorization"), "body": body})
                answer = server.answer(body["messages"][0]["content"])
                reply = {"id": "judge-1", "object": "chat.completion", "created": 0, "model": body["model"],
                         "choices": [{"index": 0, "finish_reason": "stop",
                                      "message": {"role": "assistant", "content": answer}}]}
                data = json.dumps(reply).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args) -> None:
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"

    @staticmethod
    def answer(prompt: str) -> str:
        runs = re.findall(r"^<run (\d+)>$", prompt, re.MULTILINE)
        if '"id": "t-1"' in prompt:
            return "I think these runs are fine."
        if '"id": "t-2"' in prompt:
            runs = runs[:-1]
        scores = [{"run": int(n), "score": 1.0 if n == "1" else 0.0, "explanation": f"run {n} of the group"}
                  for n in runs]
        return "```json\n" + json.dumps({"scores": scores}) + "\n```"

    def __enter__(self) -> JudgeServer:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def wait_for_text(path, text: str, process: subprocess.Popen, timeout_s: float) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        content = path.read_text() if path.exists() else ""
        if text in content:
            return content
        assert process.poll() is None, f"exited {process.returncode} before saying {text!r}:\n{content[-3000:]}"
        time.sleep(0.2)
    raise AssertionError(f"{text!r} not said within {timeout_s} s")


class Processes:
    """``spanrl`` commands as child processes logging to ``<name>.log``; ``stop_all`` stops them."""

    def __init__(self, folder) -> None:
        self.env = {**{k: v for k, v in os.environ.items() if not k.startswith(("OTEL_SPANRL_", "OTEL_EXPORTER_"))},
                    "PYTHONUNBUFFERED": "1", "JUDGE_TEST_KEY": KEY}
        self.folder, self.processes, self.logs = folder, [], {}

    def start(self, name: str, *argv: str) -> subprocess.Popen:
        self.logs[name] = self.folder / f"{name}.log"
        with open(self.logs[name], "w") as log:
            process = subprocess.Popen([sys.executable, "-m", "spanrl", *argv], stdout=log, stderr=subprocess.STDOUT,
                                       env=self.env, cwd=REPO)
        self.processes.append(process)
        return process

    def stop_all(self) -> None:
        for process in self.processes:
            if process.poll() is None:
                process.terminate()
                process.wait(30)


def write_config(tmp_path, name: str, model, bridge_port: int, judge_url: str, **judge) -> str:
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text("".join(json.dumps({"id": f"t-{n}", "question": f"{n}+2", "answer": n + 2}) + "\n"
                             for n in range(TASKS)))
    config = tmp_path / f"{name}.yaml"
    config.write_text(json.dumps({
        "tasks": str(tasks), "model": str(model), "output_dir": str(tmp_path / name), "store": str(tmp_path / "db"),
        "reward": "judge", "group_size": GROUP, "tasks_per_step": TASKS, "steps": 1, "checkpoint_every": 0,
        "policy_port": 0, "bridge_port": bridge_port, "device": TEST_DEVICE, "rollout_timeout_s": 60,
        "judge": {"url": judge_url, "model": "judge-model", "api_key_env": "JUDGE_TEST_KEY",
                  "rubric": "Score the runs that answer right higher.", **judge},
    }))  # JSON is YAML
    return str(config)


@pytest.mark.timeout(600)
def test_a_judge_scores_each_group_in_one_request_and_its_failures_leave_groups_out(tmp_path):
    from spanrl.otlp_receiver import judge_evaluations, trained_rewards

    model = create_model_dir(tmp_path / "model", preset="tiny", seed=0)
    grpc_port, bridge_port, serve_port = free_port(), free_port(), free_port()
    spanrl = Processes(tmp_path)
    start, logs = spanrl.start, spanrl.logs

    def train(name: str, config: str) -> None:
        trainer = start(name, "train", config)
        start(f"runner-{name}", "run", "--agent", CALC_AGENT, "--bridge-url", f"http://127.0.0.1:{bridge_port}",
              "--otlp-endpoint", f"http://127.0.0.1:{grpc_port}", "--concurrency", "6", "--bridge-wait-s", "120")
        assert trainer.wait(300) == 0, logs[name].read_text()[-4000:]

    try:
        receiver = start("receiver", "receive", "--db", str(tmp_path / "db"), "--grpc-port", str(grpc_port),
                         "--http-port", "0", "--grace-s", "0.3")
        wait_for_text(logs["receiver"], "spanrl receive: ready", receiver, 60)
        (tmp_path / "judge_base.py").write_text("def reward(task, variables):\n    return 0.5\n")
        with JudgeServer() as judge:  # combined with a function of the config's folder: 0.75 * judge + 0.25 * 0.5
            train("judged", write_config(tmp_path, "judged", model, bridge_port, judge.url,
                                         combine_with="judge_base:reward", weight=0.75))
        serve = start("serve", "serve", str(model), "--port", str(serve_port), "--device", TEST_DEVICE,
                      "--served-model-name", "judge-model")
        wait_for_text(logs["serve"], f"127.0.0.1:{serve_port}", serve, 120)
        train("served", write_config(tmp_path, "served", model, bridge_port, f"http://127.0.0.1:{serve_port}/v1",
                                     max_tokens=24))
    finally:
        spanrl.stop_all()

    # one request per group, each holding every member's run, with the key as the bearer token
    assert len(judge.requests) == TASKS, len(judge.requests)
    for request in judge.requests:
        prompt = request["body"]["messages"][0]["content"]
        assert request["auth"] == f"Bearer {KEY}" and request["body"]["model"] == "judge-model"
        assert re.findall(r"^<run (\d+)>$", prompt, re.MULTILINE) == ["1", "2", "3"], prompt[-2000:]
        assert "Score the runs that answer right higher." in prompt and "model output" in prompt, prompt[:2000]

    # two groups judged and trained on; two left out, the reason logged
    row = read_metrics(tmp_path / "judged")[0]
    assert row["rollout/left_out"] == {"judge_failed": 2 * GROUP}, row
    assert row["actor/transitions"] > 0 and row["actor/policy_version"] == 1, row
    said = logs["judged"].read_text()
    assert f"judge: the group of task t-1 ({GROUP} rollouts) is left out: the answer is not JSON" in said
    assert f"judge: the group of task t-2 ({GROUP} rollouts) is left out: the answer has {GROUP - 1} scores " \
           f"for a group of {GROUP} runs" in said

    evaluations = judge_evaluations.load(tmp_path / "db")
    trained = trained_rewards.load(tmp_path / "db")
    judged = sorted(rid for rid in evaluations if rid.startswith("s0-"))
    assert len(judged) == 2 * GROUP and {rid.split("-a")[0] for rid in judged} == {"s0-t-0", "s0-t-3"}, judged
    for rollout_id in judged:
        evaluation = evaluations[rollout_id]
        assert evaluation.score in (0.0, 1.0) and evaluation.reward == 0.75 * evaluation.score + 0.125
        assert re.fullmatch(r"run \d of the group", evaluation.explanation) and evaluation.group_size == GROUP
        assert trained[rollout_id].reward == evaluation.reward
        assert trained[rollout_id].reward_source == "judge judge-model x0.75 + judge_base:reward"
    assert sorted(evaluations[r].score for r in judged) == [0.0, 0.0, 0.0, 0.0, 1.0, 1.0]
    shown = subprocess.run([sys.executable, "-m", "spanrl", "inspect", "rollout", "--db", str(tmp_path / "db"),
                            judged[0]], capture_output=True, text=True, cwd=REPO, timeout=60)
    assert shown.returncode == 0, shown.stderr
    first = evaluations[judged[0]]
    assert (f"gen_ai.evaluation.result spanrl.judge (judge judge-model, group of {GROUP}): score {first.score:g}, "
            f"reward {first.reward:g}: {first.explanation}") in shown.stdout, shown.stdout

    # spanrl serve as the judge: a tiny model answers no JSON: every group left out, the reason logged
    row = read_metrics(tmp_path / "served")[0]
    assert row["rollout/left_out"] == {"judge_failed": TASKS * GROUP}, row
    assert row["actor/transitions"] == 0 and row["actor/policy_version"] == 0, row
    said = logs["served"].read_text()
    for task in range(TASKS):
        assert re.search(rf"judge: the group of task t-{task} \({GROUP} rollouts\) is left out: the answer", said), \
            said[-3000:]
    for log in logs.values():
        assert KEY not in log.read_text(), log
