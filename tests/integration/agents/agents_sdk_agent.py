"""An OpenAI Agents SDK agent as its users write it, with no spanrl import and the SDK's default
model (the Responses API): a run, a second run continuing it by ``previous_response_id``, and a
streamed run. Prints each run's final output as JSON, in run order.

Environment: OPENAI_BASE_URL, OPENAI_API_KEY, OPENAI_MODEL (OPENAI_AGENTS_DISABLE_TRACING=1:
the SDK's own tracing would export to OpenAI's servers).
"""

import asyncio
import json
import os

from agents import Agent, ModelSettings, Runner


async def main():
    agent = Agent(name="calculator", instructions="Answer with ANSWER n.", model=os.environ["OPENAI_MODEL"],
                  model_settings=ModelSettings(max_tokens=8))
    first = await Runner.run(agent, "What is 12 + 30?")
    second = await Runner.run(agent, "Are you sure?", previous_response_id=first.last_response_id)
    streamed = Runner.run_streamed(agent, "What is 2 + 2?")
    async for _ in streamed.stream_events():
        pass
    print(json.dumps([first.final_output, second.final_output, streamed.final_output]))


if __name__ == "__main__":
    asyncio.run(main())
