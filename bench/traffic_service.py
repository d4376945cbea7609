"""A simulated service trained from its own traffic: ``spanrl train --from-traffic`` measured.

No task list is handed out and no runner runs. A "service" sends its users' questions (the
calculator agent's: ``37+45``, answered through ``CALC``/``ANSWER`` turns) to the policy endpoint
that ``spanrl train`` serves, with the real ``openai`` client, one conversation id per question
(``x-spanrl-rollout-id``); the endpoint's spans go to ``spanrl receive``; the service completes
each conversation and, after a random delay (a user who rates the answer later), sends feedback
(1 right, 0 wrong) to ``POST /spanrl/v1/feedback`` by the conversation's id. The trainer's steps
take the conversations whose feedback arrived. Before and after, a held-out question set is
answered by the warm model and by the trained one, each served by the same engine, at the
temperature the service samples at (1.0: what its users get; the warm model is nearly always
right greedily, so greedy accuracy leaves nothing to learn).

    python bench/traffic_service.py --out /tmp/traffic --steps 12

Prints the held-out accuracy before and after and writes ``<out>/traffic_result.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

from spanrl.child_processes import LocalServices, free_port
from spanrl.examples.calc_agent.agent import MAX_MODEL_CALLS, MAX_TOKENS, SYSTEM_PROMPT, calculator
from spanrl.examples.calc_agent.tasks import make_tasks

_ANSWER = re.compile(r"^\s*ANSWER\s+(-?\d+)\s*$")
_CALC = re.compile(r"^\s*CALC\s+(.+?)\s*$")


def converse(base_url: str, question: str, conversation: str | None, temperature: float) -> str:
    """The calculator agent's turns for one question (its code, with the conversation id as a header)."""
    import openai

    headers = {"x-spanrl-rollout-id": conversation} if conversation else {}
    client = openai.OpenAI(base_url=base_url, api_key="unused", timeout=120, max_retries=2, default_headers=headers)
    messages: list = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": question}]
    for _ in range(MAX_MODEL_CALLS):
        text = client.chat.completions.create(model="policy", messages=messages, max_tokens=MAX_TOKENS,
                                              temperature=temperature).choices[0].message.content or ""
        messages.append({"role": "assistant", "content": text})
        if (answer := _ANSWER.match(text)) is not None:
            return answer.group(1)
        if (calc := _CALC.match(text)) is None:
            return ""
        try:
            result = str(calculator(calc.group(1)))
        except (ValueError, SyntaxError):
            result = "ERROR"
        messages.append({"role": "user", "content": f"RESULT {result}"})
    return ""


def post(url: str, body: dict) -> None:
    request = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=30):
        pass


def held_out_accuracy(model_dir: str, tasks: list[dict], device: str, out: str, temperature: float) -> float:
    """Accuracy of ``model_dir`` on ``tasks`` at ``temperature``, served by the embedded engine."""
    from spanrl.trainer_bridge.torch_backend.backend import start_backend
    from spanrl.trainer_bridge.train_settings import TrainSettings

    settings = TrainSettings(from_traffic=True, model=model_dir, output_dir=os.path.join(out, "held-out"),
                             device=device, policy_port=free_port(), checkpoint_every=0)
    backend = start_backend(settings.backend_run())
    try:
        with ThreadPoolExecutor(8) as pool:
            answers = list(pool.map(lambda t: converse(backend.endpoint_url, t["question"], None, temperature),
                                    tasks))
    finally:
        backend.close()
    return sum(a == str(t["answer"]) for a, t in zip(answers, tasks, strict=True)) / len(tasks)


class Service:
    """Users' questions through the endpoint; each answer rated after a random delay."""

    def __init__(self, base_url: str, receiver_http: int, questions: list[dict], max_delay_s: float, seed: int,
                 temperature: float):
        self.base_url, self.questions, self.max_delay_s = base_url, questions, max_delay_s
        self.temperature = temperature
        self.receiver = f"http://127.0.0.1:{receiver_http}"
        self.rng = random.Random(seed)
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.served = self.rated = 0

    def user(self, worker: int) -> None:
        count = 0
        while not self.stop.is_set():
            with self.lock:
                task = self.rng.choice(self.questions)
                delay = self.rng.uniform(0, self.max_delay_s)
            conversation = f"user{worker}-{count}"
            count += 1
            try:
                answer = converse(self.base_url, task["question"], conversation, self.temperature)
                post(f"{self.receiver}/spanrl/v1/rollouts/{conversation}/complete", {})
            except Exception:  # the endpoint restarting between steps, a timeout: the next question
                time.sleep(0.5)
                continue
            value = 1.0 if answer == str(task["answer"]) else 0.0
            threading.Timer(delay, self.rate, (conversation, value)).start()
            self.served += 1

    def rate(self, conversation: str, value: float) -> None:
        try:
            post(f"{self.receiver}/spanrl/v1/feedback",
                 {"rollout_id": conversation, "value": value, "idempotency_key": conversation})
        except OSError:  # the run ended (the receiver stopped) before this user rated
            return
        self.rated += 1


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--out", default="spanrl-traffic")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--per-step", type=int, default=32, help="judged conversations per update")
    parser.add_argument("--users", type=int, default=16, help="conversations at once")
    parser.add_argument("--max-delay-s", type=float, default=5.0, help="feedback comes 0..this many seconds later")
    parser.add_argument("--sft-steps", type=int, default=400)
    parser.add_argument("--held-out", type=int, default=300, help="held-out questions")
    parser.add_argument("--temperature", type=float, default=1.0, help="the service's (and held-out) temperature")
    parser.add_argument("--warm-model", default=None, help="a warm model made by an earlier run (skips the warm start)")
    parser.add_argument("--learning-rate", type=float, default=2e-4)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    from spanrl.demo import DemoSettings, prepare_model
    from spanrl.trainer_bridge.endpoint_spans import SPANS_ENDPOINT_ENV
    from spanrl.trainer_bridge.session import run_training
    from spanrl.trainer_bridge.train_settings import TrainSettings

    out = os.path.abspath(args.out)
    os.makedirs(out, exist_ok=True)
    started = time.monotonic()
    warm = args.warm_model or prepare_model(DemoSettings(sft_steps=args.sft_steps, device=args.device,
                                                          seed=args.seed), out)
    questions = make_tasks(200, seed=args.seed + 1)  # what the service's users ask
    held_out = make_tasks(args.held_out, seed=args.seed + 99)
    before = held_out_accuracy(warm, held_out, args.device, out, args.temperature)
    print(f"held-out accuracy of the warm model: {before:.2f}", flush=True)
    db = os.path.join(out, "spanrl.db")
    for suffix in ("", "-wal", "-shm"):
        if os.path.exists(db + suffix):
            os.remove(db + suffix)
    policy_port = free_port()
    with LocalServices(out) as services:
        receiver = services.start_receiver(db, "--idle-timeout-s", "0")
        os.environ[SPANS_ENDPOINT_ENV] = receiver.otlp_endpoint  # the endpoint's own spans -> the receiver
        service = Service(f"http://127.0.0.1:{policy_port}/v1", receiver.http, questions, args.max_delay_s, args.seed,
                          args.temperature)
        users = [threading.Thread(target=service.user, args=(i,), daemon=True) for i in range(args.users)]
        for thread in users:
            thread.start()
        settings = TrainSettings(
            from_traffic=True, model=warm, output_dir=os.path.join(out, "run"), store=db, steps=args.steps,
            tasks_per_step=args.per_step, learning_rate=args.learning_rate, policy_port=policy_port, device=args.device,
            seed=args.seed, checkpoint_every=0, max_empty_steps=0, traffic_wait_s=300)
        try:
            summary = run_training(settings, show_progress=False)
        finally:
            service.stop.set()
        for thread in users:
            thread.join(timeout=180)
    after = held_out_accuracy(summary["checkpoint"], held_out, args.device, out, args.temperature)
    result = {"held_out_before": before, "held_out_after": after, "steps": summary["steps"],
              "served": service.served, "rated": service.rated, "train_reward_first": summary["first_reward"],
              "train_reward_last": summary["last_reward"], "seconds": round(time.monotonic() - started),
              "metrics": summary["metrics"]}
    with open(os.path.join(out, "traffic_result.json"), "w", encoding="utf-8") as f:
        json.dump(result, f, indent=2)
    print(f"held-out accuracy {before:.2f} -> {after:.2f} after {summary['steps']} steps on "
          f"{service.served} served conversations ({service.rated} rated); {result['seconds']} s", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
