"""A LlamaIndex program as its users write it, with no spanrl import: two workflow agents
(``FunctionAgent``), ``planner`` and ``solver``, on LlamaIndex's OpenAI-compatible LLM
(``OpenAILike``), one run each. openinference's LlamaIndex instrumentor (installed beside it)
traces the runs. Prints each agent's reply as JSON, in call order.

Environment: OPENAI_BASE_URL, OPENAI_API_KEY, OPENAI_MODEL.
"""

import asyncio
import json
import os

from llama_index.core.agent.workflow import FunctionAgent
from llama_index.llms.openai_like import OpenAILike

llm = OpenAILike(model=os.environ["OPENAI_MODEL"], api_base=os.environ["OPENAI_BASE_URL"],
                 api_key=os.environ["OPENAI_API_KEY"], is_chat_model=True, is_function_calling_model=True,
                 max_tokens=6, context_window=8192)
planner = FunctionAgent(name="planner", description="Plans", system_prompt="Plan the answer.", llm=llm)
solver = FunctionAgent(name="solver", description="Solves", system_prompt="Answer with ANSWER n.", llm=llm)


async def main():
    plan = await planner.run(user_msg="What is 12 + 30?")
    answer = await solver.run(user_msg=f"Plan: {plan}")
    print(json.dumps([str(plan), str(answer)]))


if __name__ == "__main__":
    asyncio.run(main())
