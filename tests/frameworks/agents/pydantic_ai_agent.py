"""A PydanticAI program as its users write it, with no spanrl import: a ``planner`` agent on
PydanticAI's chat-completions model and a ``solver`` agent on its Responses model, one run each.
``Agent.instrument_all()`` is PydanticAI's own switch for its OpenTelemetry spans (its
``invoke_agent <name>`` spans name the agents). Prints each agent's reply as JSON, in call order.

Environment: OPENAI_BASE_URL, OPENAI_API_KEY (read by PydanticAI's OpenAI provider), OPENAI_MODEL.
"""

import json
import os

from pydantic_ai import Agent

Agent.instrument_all()

model = os.environ["OPENAI_MODEL"]
planner = Agent(f"openai-chat:{model}", name="planner", instructions="Plan the answer.",
                model_settings={"max_tokens": 6})
solver = Agent(f"openai-responses:{model}", name="solver", instructions="Answer with ANSWER n.",
               model_settings={"max_tokens": 6})

if __name__ == "__main__":
    plan = planner.run_sync("What is 12 + 30?")
    answer = solver.run_sync(f"Plan: {plan.output}")
    print(json.dumps([plan.output, answer.output]))
