"""The spanrl wire contract: every span attribute, event and span name spanrl reads or writes.

Agent-side instrumentation writes these keys; the OTLP receiver reads them. Any OTel source
(another language, a Collector) that writes the same keys is understood by the receiver. No
key is spelled anywhere else in spanrl: import it from here.
"""

from __future__ import annotations

from openinference.semconv.trace import OpenInferenceSpanKindValues, SpanAttributes

# Every spanrl key starts with this; the receiver type-checks exactly the keys under it.
NAMESPACE_PREFIX = "spanrl."

# --- Rollout identity: on every span of a rollout -------------------------------------------
ROLLOUT_ID = "spanrl.rollout.id"  # string
TASK_ID = "spanrl.task.id"  # string
ATTEMPT = "spanrl.attempt"  # int
ROLLOUT_IDENTITY_KEYS = (ROLLOUT_ID, TASK_ID, ATTEMPT)

# --- Multi-agent systems --------------------------------------------------------------------
AGENT_NAME = "spanrl.agent.name"  # string

# --- LLM spans: what the serving engine saw and produced ------------------------------------
LLM_PREFIX = "spanrl.llm."
LLM_PROMPT_TOKEN_IDS = "spanrl.llm.prompt_token_ids"  # int[], or packed: string (packed_values.py)
LLM_POLICY_VERSION = "spanrl.llm.policy_version"  # int
LLM_ADAPTER = "spanrl.llm.adapter"  # string: the per-agent LoRA adapter that served the call (endpoint spans)
LLM_RETOKENIZED = "spanrl.llm.retokenized"  # bool
LLM_RESPONSE_PREFIX = "spanrl.llm.response."
LLM_RESPONSE_TOKEN_IDS_SUFFIX = ".token_ids"  # int[], or packed: string
LLM_RESPONSE_LOGPROBS_SUFFIX = ".logprobs"  # double[], or packed: string


def llm_response_token_ids(choice_index: int) -> str:
    """Key of the response token ids of choice ``choice_index`` (0 for the usual n=1)."""
    return f"{LLM_RESPONSE_PREFIX}{int(choice_index)}{LLM_RESPONSE_TOKEN_IDS_SUFFIX}"


def llm_response_logprobs(choice_index: int) -> str:
    """Key of the per-token logprobs of choice ``choice_index``."""
    return f"{LLM_RESPONSE_PREFIX}{int(choice_index)}{LLM_RESPONSE_LOGPROBS_SUFFIX}"


# The policy endpoint's own span of a call (trainer_bridge/endpoint_spans.py): the same LLM keys,
# marked so the receiver keeps one transition when the agent side also reported the call.
LLM_SOURCE = "spanrl.llm.source"  # string
LLM_SOURCE_ENDPOINT = "endpoint"  # its value on spans the policy endpoint emitted
# The prompt candidate the endpoint served in place of the agent's instructions
# (trainer_bridge/prompt_resources.py): the resource (agent or model name) and the candidate's name.
PROMPT_RESOURCE = "spanrl.prompt.resource"  # string
PROMPT_CANDIDATE = "spanrl.prompt.candidate"  # string


# --- Semantic variables ---------------------------------------------------------------------
VARIABLE_PREFIX = "spanrl.variable."  # + name -> string / number / bool


def variable(name: str) -> str:
    """Key of the semantic variable ``name`` (the paper's named values of agent state)."""
    return f"{VARIABLE_PREFIX}{name}"


# --- Rewards --------------------------------------------------------------------------------
REWARD_EVENT = "spanrl.reward"  # span event on the span it judges
REWARD_VALUE = "spanrl.reward.value"  # double
REWARD_NAME = "spanrl.reward.name"  # string, default DEFAULT_REWARD_NAME
# Optional: the response id (OpenAI ``id`` of the completion) the reward judges, when the
# reward is emitted on a span that is not the LLM call's own span or ancestor.
REWARD_RESPONSE_ID = "spanrl.reward.response_id"  # string
DEFAULT_REWARD_NAME = "reward"
# The OTel GenAI evaluation event, accepted as a reward as well.
GENAI_EVALUATION_EVENT = "gen_ai.evaluation.result"
GENAI_EVALUATION_SCORE = "gen_ai.evaluation.score.value"  # double
GENAI_EVALUATION_NAME = "gen_ai.evaluation.name"  # string
GENAI_RESPONSE_ID = "gen_ai.response.id"  # string, on LLM spans
GENAI_REQUEST_MODEL = "gen_ai.request.model"  # string: the model name a call asked for (policy endpoint spans)

# --- Rollout root ---------------------------------------------------------------------------
ROLLOUT_SPAN_NAME = "spanrl.rollout"
# A rollout whose ``spanrl.rollout`` span ends with status ERROR failed (the runner sets it
# when the agent crashed or timed out); the status description says why.

# --- HTTP fields exchanged with OpenAI-compatible endpoints (vLLM's names) ------------------
REQUEST_RETURN_TOKEN_IDS = "return_token_ids"  # request body flag
RESPONSE_PROMPT_TOKEN_IDS = "prompt_token_ids"  # top level (chat) or per choice (completions)
RESPONSE_CHOICE_TOKEN_IDS = "token_ids"  # per choice, per stream chunk when streaming
RESPONSE_POLICY_VERSION = "policy_version"  # top-level body field of spanrl's server
POLICY_VERSION_HEADER = "x-spanrl-policy-version"  # response header of spanrl's server
ROLLOUT_ID_HEADER = "x-spanrl-rollout-id"  # request header: the gateway routes a rollout's calls to one upstream
# request body field: answer each id list as one packed string (packed_values; spanrl's server and its
# relays; vLLM ignores it). The header of the same name does the same for a client that cannot add a
# body field; the instrumentation uses the field: a header costs an agent ~4x more (docs/performance.md).
TOKEN_IDS_FORM_FIELD = "spanrl_token_ids"
TOKEN_IDS_FORM_HEADER = "x-spanrl-token-ids"
TOKEN_IDS_FORM_PACKED = "packed"
TOKEN_IDS_FORM_LISTS = "lists"  # vLLM's form, the default
RESPONSE_MODEL_REQUEST_FIELDS = "request_fields"  # /v1/models entry of spanrl's server: implemented/ignored fields
# the Responses API (/v1/responses): vLLM's names on that route
REQUEST_ENABLE_RESPONSE_MESSAGES = "enable_response_messages"  # request body flag
RESPONSE_INPUT_MESSAGES = "input_messages"  # [{"type": "raw_message_tokens", "message", "tokens"}]: the prompt
RESPONSE_OUTPUT_MESSAGES = "output_messages"  # the same shape: what was sampled
RESPONSE_MESSAGE_TOKENS = "tokens"  # the ids of one input/output message

# --- Environment variables ------------------------------------------------------------------
ENV_PREFIX = "OTEL_SPANRL_"

# --- openinference attributes spanrl reads (openinference's own constants, re-exported) -------
OPENINFERENCE_SPAN_KIND = SpanAttributes.OPENINFERENCE_SPAN_KIND  # "LLM", "TOOL", "CHAIN", ...
SPAN_KIND_LLM = OpenInferenceSpanKindValues.LLM.value
INPUT_VALUE = SpanAttributes.INPUT_VALUE  # prompt text, when no messages were recorded
OUTPUT_VALUE = SpanAttributes.OUTPUT_VALUE  # response text, likewise
