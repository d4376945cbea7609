"""A LangGraph agent as its users write it, with no spanrl import: a graph of two named nodes,
``planner`` then ``solver``, each calling the model through langchain-openai's ``ChatOpenAI``.
Prints each node's reply as JSON, in call order.

Environment: OPENAI_BASE_URL, OPENAI_API_KEY, OPENAI_MODEL.
"""

import json
import os
from typing import TypedDict

from langchain_openai import ChatOpenAI
from langgraph.graph import END, START, StateGraph


class State(TypedDict):
    question: str
    plan: str
    answer: str


model = ChatOpenAI(model=os.environ["OPENAI_MODEL"], max_tokens=6)


def planner(state: State) -> dict:
    return {"plan": model.invoke(f"Plan how to answer: {state['question']}").content}


def solver(state: State) -> dict:
    return {"answer": model.invoke(f"Question: {state['question']}\nPlan: {state['plan']}\nAnswer:").content}


graph = StateGraph(State)
graph.add_node("planner", planner)
graph.add_node("solver", solver)
graph.add_edge(START, "planner")
graph.add_edge("planner", "solver")
graph.add_edge("solver", END)

if __name__ == "__main__":
    final = graph.compile().invoke({"question": "What is 12 + 30?"})
    print(json.dumps([final["plan"], final["answer"]]))
