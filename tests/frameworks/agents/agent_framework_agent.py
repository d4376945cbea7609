"""A Microsoft Agent Framework program as its users write it, with no spanrl import: a
``writer`` agent on the framework's Responses client (``OpenAIChatClient``) and a ``reviewer``
agent on its chat-completions client (``OpenAIChatCompletionClient``), one run each. The
framework traces itself (``invoke_agent <name>`` spans; on by default). Prints each agent's
reply as JSON, in call order.

Environment: OPENAI_BASE_URL, OPENAI_API_KEY, OPENAI_MODEL (read by the clients themselves).
"""

import asyncio
import json

from agent_framework import Agent
from agent_framework.openai import OpenAIChatClient, OpenAIChatCompletionClient


async def main():
    writer = Agent(client=OpenAIChatClient(), name="writer", instructions="Write one line about the sea.",
                   default_options={"max_tokens": 6})
    reviewer = OpenAIChatCompletionClient().as_agent(name="reviewer", instructions="Review the line.",
                                                     default_options={"max_tokens": 6})
    line = await writer.run("Write it.")
    review = await reviewer.run(f"The line: {line.text}")
    print(json.dumps([line.text, review.text]))


if __name__ == "__main__":
    asyncio.run(main())
