"""A Google ADK program as its users write it, with no spanrl import: a sequential agent of two
LLM agents, ``planner`` and ``solver``, on ADK's LiteLLM model (``openai/<model>`` at the
policy endpoint). ADK traces itself (``invoke_agent <name>`` spans). Prints each agent's reply
as JSON, in call order.

Environment: OPENAI_BASE_URL, OPENAI_API_KEY, OPENAI_MODEL.
"""

import asyncio
import json
import os

from google.adk.agents import LlmAgent, SequentialAgent
from google.adk.models.lite_llm import LiteLlm
from google.adk.runners import InMemoryRunner
from google.genai import types

model = LiteLlm(model=f"openai/{os.environ['OPENAI_MODEL']}", api_base=os.environ["OPENAI_BASE_URL"],
                api_key=os.environ["OPENAI_API_KEY"], max_tokens=6)
planner = LlmAgent(name="planner", model=model, instruction="Plan the answer.")
solver = LlmAgent(name="solver", model=model, instruction="Answer with ANSWER n.")
team = SequentialAgent(name="team", sub_agents=[planner, solver])


async def main():
    runner = InMemoryRunner(agent=team, app_name="arithmetic")
    session = await runner.session_service.create_session(app_name="arithmetic", user_id="user")
    question = types.Content(role="user", parts=[types.Part(text="What is 12 + 30?")])
    replies = []
    async for event in runner.run_async(user_id="user", session_id=session.id, new_message=question):
        if event.content and event.content.parts and event.author in ("planner", "solver"):
            replies.append("".join(part.text or "" for part in event.content.parts))
    print(json.dumps(replies))


if __name__ == "__main__":
    asyncio.run(main())
