"""PydanticAI (in `.venv-frameworks`): an unmodified program with one agent on PydanticAI's
chat-completions model and one on its Responses model, its OpenTelemetry spans switched on with
its own `Agent.instrument_all()`, under `opentelemetry-instrument`, gives one transition per LLM
call with the engine's ids, each named by its agent (PydanticAI's `invoke_agent <name>` span,
`gen_ai.agent.name`, is the call's ancestor)."""

from __future__ import annotations

import json
from pathlib import Path

from tests.frameworks.framework_runs import call_span_names, decoded_prompts, decoded_replies, run_unmodified

HERE = Path(__file__).resolve().parent
VENV_BIN = HERE.parents[1] / ".venv-frameworks" / "bin"


def test_pydantic_ai_agents_train_with_each_call_named_by_its_agent(serve_policy, receiver):
    server = serve_policy()
    stdout, rollout = run_unmodified([str(HERE / "agents" / "pydantic_ai_agent.py")], server, receiver,
                                     "pydantic-ai-1", VENV_BIN)
    replies, names = decoded_replies(server, rollout), [t.agent_name for t in rollout.transitions]
    # PydanticAI asks again after an empty reply (the test model samples one now and then): each
    # agent's output is its last call's reply, and every call before it came back empty
    assert names == ["planner"] * names.count("planner") + ["solver"] * names.count("solver")
    assert names.count("planner") >= 1 and names.count("solver") >= 1
    last_reply = dict(zip(names, replies, strict=True))
    assert [last_reply["planner"], last_reply["solver"]] == json.loads(stdout.strip().splitlines()[-1])
    retried = [reply for reply, name, after in zip(replies, names, names[1:] + [None], strict=True) if name == after]
    assert all(not reply.strip() for reply in retried), retried
    prompts = decoded_prompts(server, rollout)
    assert "Plan the answer." in prompts[0] and "Answer with ANSWER n." in prompts[names.index("solver")]
    assert call_span_names(receiver, rollout) == [
        "ChatCompletion" if name == "planner" else "Response" for name in names]
