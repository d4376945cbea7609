"""Google ADK (in `.venv-frameworks`): an unmodified sequential agent of two LLM agents on ADK's
LiteLLM model (`openai/<model>`, which calls through the OpenAI SDK), under
`opentelemetry-instrument`, gives one transition per LLM call with the engine's ids, each named
by its agent (ADK's own `invoke_agent <name>` span, `gen_ai.agent.name`, is the call's
ancestor). LiteLLM's fetch of its price list over the network is turned off with its documented
LITELLM_LOCAL_MODEL_COST_MAP (with no route out it retries for about 10 s)."""

from __future__ import annotations

import json
from pathlib import Path

from tests.frameworks.framework_runs import decoded_prompts, decoded_replies, run_unmodified

HERE = Path(__file__).resolve().parent
VENV_BIN = HERE.parents[1] / ".venv-frameworks" / "bin"


def test_a_google_adk_sequential_agent_trains_with_each_call_named_by_its_agent(serve_policy, receiver):
    server = serve_policy()
    stdout, rollout = run_unmodified([str(HERE / "agents" / "google_adk_agent.py")], server, receiver,
                                     "google-adk-1", VENV_BIN, extra_env={"LITELLM_LOCAL_MODEL_COST_MAP": "True"})
    # ADK sends no event for an empty reply (a random tiny model may sample EOS first), so the
    # printed replies are the decoded ones that are not empty, in call order
    printed = json.loads(stdout.strip().splitlines()[-1])
    assert [reply for reply in decoded_replies(server, rollout) if reply] == printed
    prompts = decoded_prompts(server, rollout)
    assert "Plan the answer." in prompts[0] and "Answer with ANSWER n." in prompts[1]
    assert [t.agent_name for t in rollout.transitions] == ["planner", "solver"]
