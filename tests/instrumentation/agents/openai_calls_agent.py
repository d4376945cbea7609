"""An ordinary OpenAI-SDK agent with no spanrl import: it makes every kind of call spanrl must
trace (chat and completions, sync and async, streaming and not, with_raw_response, n=2,
logprobs) against OPENAI_BASE_URL, then prints the response ids it got as JSON.

Usage: python openai_calls_agent.py [all|quick]
"""

import asyncio
import json
import sys

from openai import AsyncOpenAI, OpenAI

MESSAGES = [{"role": "user", "content": "What is 2+3?"}]


def drain(stream):
    response_id = None
    for chunk in stream:
        response_id = response_id or chunk.id
    return response_id


async def adrain(stream):
    response_id = None
    async for chunk in stream:
        response_id = response_id or chunk.id
    return response_id


def sync_calls(client, quick):
    made = {}
    made["chat"] = client.chat.completions.create(model="policy", messages=MESSAGES).id
    made["chat_stream"] = drain(
        client.chat.completions.create(model="policy", messages=MESSAGES, stream=True)
    )
    if quick:
        return made
    made["chat_n2_logprobs"] = client.chat.completions.create(
        model="policy", messages=MESSAGES, n=2, logprobs=True
    ).id
    made["chat_stream_n2_logprobs"] = drain(
        client.chat.completions.create(
            model="policy", messages=MESSAGES, stream=True, n=2, logprobs=True,
            stream_options={"include_usage": True},
        )
    )
    made["completion"] = client.completions.create(model="policy", prompt="2+3=").id
    made["completion_stream_logprobs"] = drain(
        client.completions.create(model="policy", prompt="7*6=", stream=True, logprobs=1)
    )
    raw = client.chat.completions.with_raw_response.create(model="policy", messages=MESSAGES)
    made["chat_raw"] = raw.parse().id
    raw_stream = client.completions.with_raw_response.create(
        model="policy", prompt="9-4=", stream=True
    )
    made["completion_raw_stream"] = drain(raw_stream.parse())
    return made


async def async_calls(quick):
    client = AsyncOpenAI()
    made = {}
    made["async_chat"] = (await client.chat.completions.create(model="policy", messages=MESSAGES)).id
    made["async_chat_stream"] = await adrain(
        await client.chat.completions.create(model="policy", messages=MESSAGES, stream=True)
    )
    if quick:
        return made
    made["async_completion"] = (await client.completions.create(model="policy", prompt="1+1=")).id
    made["async_completion_stream"] = await adrain(
        await client.completions.create(model="policy", prompt="3+3=", stream=True)
    )
    raw = await client.chat.completions.with_raw_response.create(
        model="policy", messages=MESSAGES, stream=True
    )
    made["async_chat_raw_stream"] = await adrain(raw.parse())  # legacy raw responses parse synchronously
    return made


def main():
    quick = len(sys.argv) > 1 and sys.argv[1] == "quick"
    made = sync_calls(OpenAI(), quick)
    made.update(asyncio.run(async_calls(quick)))
    print(json.dumps(made))


if __name__ == "__main__":
    main()
