"""AutoGen AgentChat (in `.venv-autogen`: AutoGen pins protobuf 5.29): an unmodified round-robin
team of two assistants under `opentelemetry-instrument` gives one transition per LLM call with
the engine's ids, each named by the agent that made it (AutoGen's own `invoke_agent` span,
`gen_ai.agent.name`, is the call's ancestor)."""

from __future__ import annotations

from pathlib import Path

from tests.integration.agent_runs import run_and_assemble

HERE = Path(__file__).resolve().parent
VENV_BIN = HERE.parents[1] / ".venv-autogen" / "bin"


def test_an_autogen_team_trains_with_each_call_named_by_its_agent(policy_server, receiver):
    engine = policy_server.engine
    replies, rollout = run_and_assemble(HERE / "agents" / "autogen_agent.py", policy_server, receiver,
                                        "autogen-rollout-1", bin_dir=VENV_BIN)
    assert len(replies) == 2
    prompts = [engine.tokenizer.decode(list(t.prompt_token_ids)) for t in rollout.transitions]
    assert "Plan the answer." in prompts[0] and "Answer with ANSWER n." in prompts[1]
    assert [t.agent_name for t in rollout.transitions] == ["planner", "solver"]
