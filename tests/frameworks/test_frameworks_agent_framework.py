"""Microsoft Agent Framework (in `.venv-frameworks`): an unmodified program with one agent on
the framework's Responses client and one on its chat-completions client, under
`opentelemetry-instrument`, gives one transition per LLM call with the engine's ids, each named
by its agent (the framework's own `invoke_agent <name>` span, `gen_ai.agent.name`, is the call's
ancestor)."""

from __future__ import annotations

import json
from pathlib import Path

from tests.frameworks.framework_runs import call_span_names, decoded_prompts, decoded_replies, run_unmodified

HERE = Path(__file__).resolve().parent
VENV_BIN = HERE.parents[1] / ".venv-frameworks" / "bin"


def test_agent_framework_agents_on_both_clients_train_with_their_names(serve_policy, receiver):
    server = serve_policy()
    stdout, rollout = run_unmodified([str(HERE / "agents" / "agent_framework_agent.py")], server, receiver,
                                     "agent-framework-1", VENV_BIN)
    assert decoded_replies(server, rollout) == json.loads(stdout.strip().splitlines()[-1])
    prompts = decoded_prompts(server, rollout)
    assert "Write one line about the sea." in prompts[0] and "Review the line." in prompts[1]
    assert [t.agent_name for t in rollout.transitions] == ["writer", "reviewer"]
    assert call_span_names(receiver, rollout) == ["Response", "ChatCompletion"]  # openinference's, per API
