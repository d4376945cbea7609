"""An OpenAI Agents SDK agent as its users write it, with no spanrl import and the SDK's default
model (the Responses API): the agent ``calculator`` runs, runs again continuing by
``previous_response_id``, then the agent ``checker`` runs streamed. Prints each run's final
output as JSON, in run order.

With AGENT_API=chat_completions the agents use the SDK's chat-completions model instead (as an
agent does with ``set_default_openai_api``): ``calculator`` runs, then ``checker`` streamed (no
server-side conversation state on that API).

Environment: OPENAI_BASE_URL, OPENAI_API_KEY, OPENAI_MODEL. The SDK's own tracing stays on: under
``opentelemetry-instrument`` spanrl's processor takes its agent spans (the agents' names) in place
of the export to OpenAI's servers.
"""

import asyncio
import json
import os

from agents import Agent, ModelSettings, Runner, set_default_openai_api


def agent(name: str) -> Agent:
    return Agent(name=name, instructions="Answer with ANSWER n.", model=os.environ["OPENAI_MODEL"],
                 model_settings=ModelSettings(max_tokens=8))


async def streamed(name: str) -> str:
    run = Runner.run_streamed(agent(name), "What is 2 + 2?")
    async for _ in run.stream_events():
        pass
    return run.final_output


async def main():
    if os.environ.get("AGENT_API") == "chat_completions":
        set_default_openai_api("chat_completions")
        first = await Runner.run(agent("calculator"), "What is 12 + 30?")
        print(json.dumps([first.final_output, await streamed("checker")]))
        return
    first = await Runner.run(agent("calculator"), "What is 12 + 30?")
    second = await Runner.run(agent("calculator"), "Are you sure?", previous_response_id=first.last_response_id)
    print(json.dumps([first.final_output, second.final_output, await streamed("checker")]))


if __name__ == "__main__":
    asyncio.run(main())
