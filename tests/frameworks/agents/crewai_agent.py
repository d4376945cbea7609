"""A CrewAI crew as its users write it, with no spanrl import: two agents, ``planner`` and
``solver`` (their roles), each doing one task in a sequential crew, on CrewAI's OpenAI LLM.
Prints each task's output as JSON, in task order.

Environment: OPENAI_BASE_URL, OPENAI_API_KEY, OPENAI_MODEL.
"""

import json
import os

from crewai import LLM, Agent, Crew, Process, Task

llm = LLM(model=f"openai/{os.environ['OPENAI_MODEL']}", base_url=os.environ["OPENAI_BASE_URL"],
          api_key=os.environ["OPENAI_API_KEY"], max_tokens=6)
planner = Agent(role="planner", goal="Plan the answer", backstory="You plan.", llm=llm, max_iter=1)
solver = Agent(role="solver", goal="Answer with ANSWER n", backstory="You answer.", llm=llm, max_iter=1)
plan = Task(description="Plan how to answer: What is 12 + 30?", expected_output="a plan", agent=planner)
answer = Task(description="Answer: What is 12 + 30?", expected_output="ANSWER n", agent=solver)

if __name__ == "__main__":
    crew = Crew(agents=[planner, solver], tasks=[plan, answer], process=Process.sequential)
    result = crew.kickoff()
    print(json.dumps([task.raw for task in result.tasks_output]))
