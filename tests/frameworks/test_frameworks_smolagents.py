"""smolagents (in `.venv-frameworks`, with openinference's smolagents instrumentor): an
unmodified program with a tool-calling agent and a code agent, one step each, under
`opentelemetry-instrument`, gives one transition per LLM call with the engine's ids, each named
by its agent (the instrumentor's run span `<name>.run` is the call's ancestor; the model
wrapper's own LLM span is merged into the OpenAI SDK span of the call)."""

from __future__ import annotations

from pathlib import Path

from tests.frameworks.framework_runs import decoded_prompts, run_unmodified

HERE = Path(__file__).resolve().parent
VENV_BIN = HERE.parents[1] / ".venv-frameworks" / "bin"


def test_smolagents_agents_train_with_each_call_named_by_its_agent(serve_policy, receiver):
    server = serve_policy()
    _, rollout = run_unmodified([str(HERE / "agents" / "smolagents_agent.py")], server, receiver,
                                "smolagents-1", VENV_BIN)
    # a step, then the final answer smolagents asks for when the steps run out: two calls per agent
    assert [t.agent_name for t in rollout.transitions] == ["planner", "planner", "solver", "solver"]
    prompts = decoded_prompts(server, rollout)
    assert all("What is 12 + 30?" in prompt for prompt in prompts[:2])
    assert all("Plan: " in prompt for prompt in prompts[2:])
