"""An AutoGen AgentChat team as its users write it, with no spanrl import: two assistants,
``planner`` and ``solver``, taking turns in a round-robin group chat (one turn each), both on
autogen-ext's OpenAI model client. Prints each agent's reply as JSON, in call order.

Environment: OPENAI_BASE_URL, OPENAI_API_KEY, OPENAI_MODEL.
"""

import asyncio
import json
import os

from autogen_agentchat.agents import AssistantAgent
from autogen_agentchat.teams import RoundRobinGroupChat
from autogen_ext.models.openai import OpenAIChatCompletionClient


async def main():
    client = OpenAIChatCompletionClient(
        model=os.environ["OPENAI_MODEL"], base_url=os.environ["OPENAI_BASE_URL"],
        api_key=os.environ["OPENAI_API_KEY"], max_tokens=6,
        model_info={"vision": False, "function_calling": False, "json_output": False, "family": "unknown",
                    "structured_output": False},
    )
    planner = AssistantAgent("planner", model_client=client, system_message="Plan the answer.")
    solver = AssistantAgent("solver", model_client=client, system_message="Answer with ANSWER n.")
    team = RoundRobinGroupChat([planner, solver], max_turns=2)
    result = await team.run(task="What is 12 + 30?")
    print(json.dumps([m.content for m in result.messages if m.source in ("planner", "solver")]))
    await client.close()


if __name__ == "__main__":
    asyncio.run(main())
