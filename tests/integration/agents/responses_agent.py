"""An ordinary OpenAI-SDK agent using the Responses API, with no spanrl import: one conversation
continued with ``previous_response_id`` over every kind of call (sync, streamed, the SDK's stream
helper, async, async streamed), a function call and its output in the history. Prints the
text of each reply as JSON, in call order.

Environment: OPENAI_BASE_URL, OPENAI_API_KEY, OPENAI_MODEL.
"""

import asyncio
import json
import os

from openai import AsyncOpenAI, OpenAI

MODEL = os.environ["OPENAI_MODEL"]
ARGS = {"model": MODEL, "max_output_tokens": 6}


def final_of(stream):
    final = None
    for event in stream:
        if event.type == "response.completed":
            final = event.response
    return final


async def async_calls(previous_id):
    client = AsyncOpenAI()
    reply = await client.responses.create(input="And 2 + 2?", previous_response_id=previous_id, **ARGS)
    stream = await client.responses.create(input="Sure?", previous_response_id=reply.id, stream=True, **ARGS)
    final = None
    async for event in stream:
        if event.type == "response.completed":
            final = event.response
    await client.close()
    return [reply, final]


def main():
    client = OpenAI()
    replies = [client.responses.create(instructions="Answer with ANSWER n.", input="What is 12 + 30?", **ARGS)]
    replies.append(final_of(client.responses.create(input="Check it.", previous_response_id=replies[-1].id,
                                                    stream=True, **ARGS)))
    history = [
        {"type": "function_call", "call_id": "call_1", "name": "add", "arguments": '{"a": 12, "b": 30}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "42"},
    ]
    with client.responses.stream(input=history, previous_response_id=replies[-1].id, **ARGS) as stream:
        replies.append(stream.get_final_response())
    replies.extend(asyncio.run(async_calls(replies[-1].id)))
    print(json.dumps([reply.output_text for reply in replies]))


if __name__ == "__main__":
    main()
