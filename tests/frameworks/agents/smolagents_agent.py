"""A smolagents program as its users write it, with no spanrl import: a ``planner`` tool-calling
agent and a ``solver`` code agent on smolagents' OpenAI-compatible model, one step each (a step,
then the answer smolagents asks for when the steps run out: two calls per agent).
openinference's smolagents instrumentor (installed beside it) traces the runs. Prints nothing of
the replies: what a smolagents run returns is parsed out of them.

Environment: OPENAI_BASE_URL, OPENAI_API_KEY, OPENAI_MODEL.
"""

import os

from smolagents import CodeAgent, OpenAIServerModel, ToolCallingAgent

model = OpenAIServerModel(model_id=os.environ["OPENAI_MODEL"], api_base=os.environ["OPENAI_BASE_URL"],
                          api_key=os.environ["OPENAI_API_KEY"], max_tokens=6)
planner = ToolCallingAgent(tools=[], model=model, name="planner", max_steps=1, verbosity_level=0)
solver = CodeAgent(tools=[], model=model, name="solver", max_steps=1, verbosity_level=0)

if __name__ == "__main__":
    plan = planner.run("What is 12 + 30?")
    solver.run(f"Plan: {plan}")
