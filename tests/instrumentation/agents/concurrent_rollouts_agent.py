"""Two rollouts at once in one process, twice: in two threads, then in two asyncio tasks.

Each rollout makes LLM calls (one streaming), names its agent, sets a variable and emits a
reward; the asyncio pair also runs work in a thread pool with ``bind_context``. One asyncio
rollout fails on purpose. Prints {rollout_id: [response ids it received]} as JSON.

Run under ``opentelemetry-instrument`` (default), or with ``in-process`` as first argument to
set tracing up with ``spanrl.exporter.in_process.start_tracing`` instead.
"""

import asyncio
import json
import sys
import threading
from concurrent.futures import ThreadPoolExecutor

from openai import AsyncOpenAI, OpenAI

from spanrl.instrumentation import agent, bind_context, emit_reward, rollout, set_variable

MESSAGES = [{"role": "user", "content": "2+3?"}]
received: dict[str, list[str]] = {}
lock = threading.Lock()


def note(rollout_id, response_id):
    with lock:
        received.setdefault(rollout_id, []).append(response_id)


def thread_rollout(number, barrier):
    client = OpenAI()
    with rollout(f"task-thread-{number}", attempt=number, rollout_id=f"thread-{number}") as r:
        barrier.wait()
        with agent(f"solver-{number}"):
            for _ in range(2):
                note(r.rollout_id, client.chat.completions.create(model="p", messages=MESSAGES).id)
            stream = client.chat.completions.create(model="p", messages=MESSAGES, stream=True)
            note(r.rollout_id, [chunk.id for chunk in stream][0])
        set_variable("answer", f"answer-{number}")
        emit_reward(float(number))


async def asyncio_rollout(number, fail):
    client = AsyncOpenAI()
    with rollout(f"task-async-{number}", attempt=0, rollout_id=f"async-{number}") as r:
        with agent(f"planner-{number}"):
            for _ in range(2):
                response = await client.chat.completions.create(model="p", messages=MESSAGES)
                note(r.rollout_id, response.id)
                await asyncio.sleep(0.01)  # let the other rollout interleave
            stream = await client.completions.create(model="p", prompt="1+1=", stream=True)
            note(r.rollout_id, [chunk.id async for chunk in stream][0])

        def pooled_call():  # runs in a worker thread; bind_context carries the rollout there
            note(r.rollout_id, OpenAI().chat.completions.create(model="p", messages=MESSAGES).id)

        with ThreadPoolExecutor(max_workers=1) as pool:
            await asyncio.wrap_future(pool.submit(bind_context(pooled_call)))
        emit_reward(10.0 + number, name="score")
        if fail:
            raise ValueError(f"rollout async-{number} failed on purpose")


async def asyncio_pair():
    results = await asyncio.gather(asyncio_rollout(1, False), asyncio_rollout(2, True),
                                   return_exceptions=True)
    assert isinstance(results[1], ValueError), results


def main():
    if len(sys.argv) > 1 and sys.argv[1] == "in-process":
        from spanrl.exporter.in_process import start_tracing, stop_tracing

        start_tracing()
    barrier = threading.Barrier(2)
    threads = [threading.Thread(target=thread_rollout, args=(n, barrier)) for n in (1, 2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    asyncio.run(asyncio_pair())
    if len(sys.argv) > 1 and sys.argv[1] == "in-process":
        stop_tracing()
    print(json.dumps(received))


if __name__ == "__main__":
    main()
