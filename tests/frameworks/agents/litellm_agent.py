"""A LiteLLM program as its users write it, with no spanrl import: two calls through LiteLLM's
``hosted_vllm/`` provider (its own HTTP client, not the OpenAI SDK), one plain and one streamed
from asyncio. Only OpenTelemetry's generic HTTP client instrumentations (httpx, aiohttp) see
them; the policy endpoint's own spans carry the ids. Prints each reply as JSON, in call order.

Environment: OPENAI_BASE_URL, OPENAI_MODEL.
"""

import asyncio
import json
import os

import litellm

MODEL = f"hosted_vllm/{os.environ['OPENAI_MODEL']}"
BASE = os.environ["OPENAI_BASE_URL"]


async def main():
    first = litellm.completion(model=MODEL, api_base=BASE, max_tokens=6,
                               messages=[{"role": "user", "content": "What is 12 + 30?"}])
    stream = await litellm.acompletion(model=MODEL, api_base=BASE, max_tokens=6, stream=True,
                                       messages=[{"role": "user", "content": "Answer with ANSWER n."}])
    second = "".join([chunk.choices[0].delta.content or "" async for chunk in stream])
    print(json.dumps([first.choices[0].message.content, second]))


if __name__ == "__main__":
    asyncio.run(main())
