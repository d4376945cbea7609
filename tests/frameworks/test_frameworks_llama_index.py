"""LlamaIndex (in `.venv-llamaindex`: llama-index-llms-openai pins openai<3), with
openinference's LlamaIndex instrumentor: an unmodified program with two workflow agents, under
`opentelemetry-instrument`, gives one transition per LLM call with the engine's ids, each named
by its agent (the `current_agent_name` of the agent step's event, which the instrumentor records
as the step span's input; the OpenAI SDK span of the call is the step span's child).

The instrumentor also records two LLM-kind spans per call that are no calls of their own (the
preparation of the request, and an inner `astream_chat` span beside the SDK span): the receiver
reports them as calls without ids and skips them."""

from __future__ import annotations

import json
from pathlib import Path

from tests.frameworks.framework_runs import decoded_prompts, decoded_replies, run_unmodified

HERE = Path(__file__).resolve().parent
VENV_BIN = HERE.parents[1] / ".venv-llamaindex" / "bin"
NOT_CALLS = ("OpenAILike._prepare_chat_with_tools", "OpenAILike.astream_chat")


def test_llama_index_agents_train_with_each_call_named_by_its_agent(serve_policy, receiver):
    server = serve_policy()
    stdout, rollout = run_unmodified([str(HERE / "agents" / "llama_index_agent.py")], server, receiver,
                                     "llama-index-1", VENV_BIN, not_calls=NOT_CALLS)
    assert decoded_replies(server, rollout) == json.loads(stdout.strip().splitlines()[-1])
    prompts = decoded_prompts(server, rollout)
    assert "Plan the answer." in prompts[0] and "Answer with ANSWER n." in prompts[1]
    assert [t.agent_name for t in rollout.transitions] == ["planner", "solver"]
