"""The OpenAI Agents SDK's own example programs, unmodified, from the sdist of the pinned
version (`.ci/frameworks_env.sh` fetches it; these tests download nothing). Each runs as its
README says (`python -m examples.<...>` from the sdist's root) under the main environment's
`opentelemetry-instrument`, against the embedded policy server serving the model name the SDK
asks for by default, and gives one transition per LLM call with the engine's ids, each named by
the agent that made it: the agent whose instructions open the call's prompt.

Chosen for the patterns: a function tool, a forced tool choice, handoffs streamed, agents as
tools, agents in parallel, a tool streamed, and a typed output. Examples that call hosted tools
(web search, file search, code interpreter, computer use, hosted MCP) need OpenAI's servers and
are left out. Input: what a user types is fed on stdin; an example that asks in a loop until
stopped runs in the SDK's own non-interactive mode (EXAMPLES_INTERACTIVE_MODE=auto: one turn).
The weights are random: agents answer with noise and seldom call a tool, so the checks hold for
whichever calls a run makes.
"""

from __future__ import annotations

import sys
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from agents.models.default_models import get_default_model

from tests.frameworks.conftest import AGENTS_SDK_SDIST
from tests.frameworks.framework_runs import decoded_prompts, run_unmodified

MAIN_BIN = Path(sys.executable).parent
SYSTEM_OPEN, TURN_CLOSE = "<|im_start|>system\n", "<|im_end|>"
# A typed output (output_type=...) asks for JSON through the Responses API's `text.format`; it
# parses only where the server constrains decoding to the schema (issue 23, item 1).


@dataclass(frozen=True)
class Example:
    module: str
    agents: dict[str, str]  # name -> instructions, of every agent the example defines
    calls_at_least: dict[str, int]  # the calls every run makes, whatever the model answers
    args: tuple[str, ...] = ()
    stdin: str = ""
    env: dict[str, str] = field(default_factory=dict)


TRANSLATORS = {f"{language.lower()}_agent": f"You translate the user's message to {language}"
               for language in ("Spanish", "French", "Italian")}
EXAMPLES = {
    "function tool": Example("examples.basic.tools", {"Hello world": "You are a helpful agent."},
                             {"Hello world": 1}),
    "forced tool choice": Example("examples.agent_patterns.forcing_tool_use",
                                  {"Weather agent": "You are a helpful agent."}, {"Weather agent": 1},
                                  args=("-t", "first_tool")),
    "handoffs, streamed": Example(
        "examples.agent_patterns.routing",
        {"triage_agent": "Handoff to the appropriate agent based on the language of the request.",
         "french_agent": "You only speak French", "spanish_agent": "You only speak Spanish",
         "english_agent": "You only speak English"},
        {"triage_agent": 1}, env={"EXAMPLES_INTERACTIVE_MODE": "auto"}),
    "agents as tools": Example(
        "examples.agent_patterns.agents_as_tools",
        {**TRANSLATORS, "orchestrator_agent": "You are a translation agent.",
         "synthesizer_agent": "You inspect translations, correct them if needed"},
        {"orchestrator_agent": 1, "synthesizer_agent": 1},
        stdin="Translate 'Hello, world!' to French and Spanish.\n"),
    "agents in parallel": Example(
        "examples.agent_patterns.parallelization",
        {"spanish_agent": TRANSLATORS["spanish_agent"],
         "translation_picker": "You pick the best Spanish translation from the given options."},
        {"spanish_agent": 3, "translation_picker": 1}, stdin="Good morning!\n"),
    "tool, streamed": Example("examples.basic.stream_items",
                              {"Joker": "First call the `how_many_jokes` tool, then tell that many jokes."},
                              {"Joker": 1}),
    "typed output": Example(
        "examples.agent_patterns.deterministic",
        {"story_outline_agent": "Generate a very short story outline",
         "outline_checker_agent": "Read the given story outline, and judge the quality.",
         "story_agent": "Write a short story based on the given outline."},
        {"story_outline_agent": 1, "outline_checker_agent": 1}, stdin="Write a short sci-fi story.\n"),
}


def agent_of_prompt(prompt: str, agents: dict[str, str]) -> str:
    """The one agent whose instructions are in the prompt's system message."""
    assert prompt.startswith(SYSTEM_OPEN), prompt[:200]
    system = prompt[len(SYSTEM_OPEN):prompt.index(TURN_CLOSE)]
    matches = [name for name, instructions in agents.items() if instructions in system]
    assert len(matches) == 1, (matches, system[:300])
    return matches[0]


@pytest.mark.timeout(600)  # a program's start-up alone (the SDK, OTel) takes a minute on a loaded 2-core machine
@pytest.mark.parametrize("name", list(EXAMPLES), ids=lambda name: name.replace(" ", "-").replace(",", ""))
def test_an_agents_sdk_example_trains_unmodified_with_each_call_named(name, serve_policy, receiver):
    example = EXAMPLES[name]
    server = serve_policy(model_name=get_default_model())  # what the examples ask for: no model= of their own
    _, rollout = run_unmodified(["-m", example.module, *example.args], server, receiver,
                                f"example-{example.module.rsplit('.', 1)[-1]}", MAIN_BIN, cwd=AGENTS_SDK_SDIST,
                                stdin=example.stdin, extra_env=example.env)
    expected = [agent_of_prompt(prompt, example.agents) for prompt in decoded_prompts(server, rollout)]
    assert [t.agent_name for t in rollout.transitions] == expected
    made = Counter(expected)
    assert all(made[agent] >= count for agent, count in example.calls_at_least.items()), made
