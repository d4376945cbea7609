"""CrewAI (in `.venv-crewai`): an unmodified sequential crew of two agents under
`opentelemetry-instrument` gives one transition per LLM call with the engine's ids, each named
by the agent's role (openinference's CrewAI instrumentor, a spanrl dependency, records it as
`graph.node.id` on the agent span above the call). CrewAI's own usage telemetry is turned off
with its documented CREWAI_DISABLE_TELEMETRY (it would try to reach its servers)."""

from __future__ import annotations

from pathlib import Path

from tests.integration.agent_runs import run_and_assemble

HERE = Path(__file__).resolve().parent
VENV_BIN = HERE.parents[1] / ".venv-crewai" / "bin"


def test_a_crewai_crew_trains_with_each_call_named_by_its_agent(policy_server, receiver):
    engine = policy_server.engine
    replies, rollout = run_and_assemble(HERE / "agents" / "crewai_agent.py", policy_server, receiver,
                                        "crewai-rollout-1", bin_dir=VENV_BIN,
                                        extra_env={"CREWAI_DISABLE_TELEMETRY": "true"}, one_call_per_reply=False)
    assert len(replies) == 2
    names = [t.agent_name for t in rollout.transitions]
    # CrewAI asks again, for a final answer, after a reply it cannot parse as one (the test model
    # samples one now and then): an agent may make more than one call, all before the next agent's
    assert names == ["planner"] * names.count("planner") + ["solver"] * names.count("solver")
    assert names.count("planner") >= 1 and names.count("solver") >= 1
    decoded = [engine.tokenizer.decode(list(t.response_token_ids), skip_special_tokens=True)
               for t in rollout.transitions]
    last_reply = dict(zip(names, decoded, strict=True))
    if len(names) == 2:
        assert [last_reply["planner"], last_reply["solver"]] == replies
    else:  # a forced final answer goes through CrewAI's answer parser, which may trim it
        tasks = zip(["planner", "solver"], replies, strict=True)
        assert all(reply.strip() in last_reply[name] for name, reply in tasks)
    prompts = [engine.tokenizer.decode(list(t.prompt_token_ids)) for t in rollout.transitions]
    assert "What is 12 + 30?" in prompts[0] and "Plan how to answer" in prompts[0]
    assert "Answer: What is 12 + 30?" in prompts[names.index("solver")]
