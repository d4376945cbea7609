"""End to end with real LangGraph: an unmodified graph of two named nodes, each calling the model
through langchain-openai, runs under ``opentelemetry-instrument`` against the embedded policy
server and a real ``spanrl receive``. Each call is seen twice (openinference's LangChain span and
the OpenAI SDK span with the ids, in another trace); the rollout holds one transition per call
with the engine's ids, named by its LangGraph node (``langgraph_node`` in the metadata of the
LangChain span merged into the SDK span).
"""

from __future__ import annotations

from pathlib import Path

from tests.integration.agent_runs import run_and_assemble

AGENT = Path(__file__).resolve().parent / "agents" / "langgraph_agent.py"


def test_each_langgraph_call_is_one_transition_named_by_its_node(policy_server, receiver):
    engine = policy_server.engine
    replies, rollout = run_and_assemble(AGENT, policy_server, receiver, "langgraph-rollout-1")
    assert len(replies) == 2
    prompts = [engine.tokenizer.decode(list(t.prompt_token_ids)) for t in rollout.transitions]
    assert "Plan how to answer" in prompts[0] and "Question: What is 12 + 30?\nPlan:" in prompts[1]
    assert [t.agent_name for t in rollout.transitions] == ["planner", "solver"]
    assert any("2 LLM span(s) recorded the same call" in p for p in rollout.problems), rollout.problems
