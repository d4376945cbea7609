"""End to end with the Responses API: an unmodified agent under ``opentelemetry-instrument``
talks to the embedded policy server; its spans travel over OTLP/gRPC to a real ``spanrl
receive`` process, and the assembled rollout holds exactly one transition per call with the ids
the policy engine produced (recorded in the server's process). The agents: one calling
``client.responses.create`` (sync, streamed, the stream helper, async), and one written with the
OpenAI Agents SDK, with its default (Responses) model and in chat-completions mode, streamed and
not; each of its calls is named by the SDK agent that made it.
"""

from __future__ import annotations

from pathlib import Path

from tests.integration.agent_runs import run_and_assemble

AGENTS = Path(__file__).resolve().parent / "agents"
ROLLOUT_ID = "responses-rollout-1"


def test_responses_calls_become_one_transition_each_with_the_engines_ids(policy_server, receiver):
    engine = policy_server.engine
    replies, rollout = run_and_assemble(AGENTS / "responses_agent.py", policy_server, receiver, ROLLOUT_ID)
    assert len(replies) == 5
    # one conversation: each prompt holds the first question and the reply before it (the server
    # kept the conversation for previous_response_id), but not the first call's instructions
    prompts = [engine.tokenizer.decode(list(t.prompt_token_ids)) for t in rollout.transitions]
    assert "Answer with ANSWER n." in prompts[0]
    for prompt, previous_reply in zip(prompts[1:], replies, strict=False):
        assert "What is 12 + 30?" in prompt and previous_reply in prompt
        assert "Answer with ANSWER n." not in prompt
    assert '"name": "add"' in prompts[2] and "42" in prompts[2]


def test_an_agents_sdk_agent_with_its_default_model_trains_with_zero_code(policy_server, receiver):
    engine = policy_server.engine
    # The SDK raises on a reply cut by max_tokens (status incomplete), and the random model
    # rarely samples its end token: here every token ends a reply, so each reply is one token.
    engine.eos_ids = set(range(len(engine.tokenizer)))
    replies, rollout = run_and_assemble(AGENTS / "agents_sdk_agent.py", policy_server, receiver, ROLLOUT_ID)
    assert len(replies) == 3
    prompts = [engine.tokenizer.decode(list(t.prompt_token_ids)) for t in rollout.transitions]
    assert all("Answer with ANSWER n." in prompt for prompt in prompts)  # the agent's instructions
    assert "What is 12 + 30?" in prompts[1] and replies[0] in prompts[1]  # continued on the server
    assert "What is 12 + 30?" not in prompts[2]
    assert all(len(t.response_token_ids) == 1 for t in rollout.transitions)
    # named by the SDK's agent spans (spanrl's processor, instrumentation/agents_sdk.py): no agent code
    assert [t.agent_name for t in rollout.transitions] == ["calculator", "calculator", "checker"]


def test_an_agents_sdk_agent_in_chat_completions_mode_streamed_and_not(policy_server, receiver):
    engine = policy_server.engine
    engine.eos_ids = set(range(len(engine.tokenizer)))  # one-token replies, as above
    replies, rollout = run_and_assemble(AGENTS / "agents_sdk_agent.py", policy_server, receiver, ROLLOUT_ID,
                                        extra_env={"AGENT_API": "chat_completions"})
    assert len(replies) == 2
    prompts = [engine.tokenizer.decode(list(t.prompt_token_ids)) for t in rollout.transitions]
    assert "What is 12 + 30?" in prompts[0] and "What is 2 + 2?" in prompts[1]
    assert [t.agent_name for t in rollout.transitions] == ["calculator", "checker"]
