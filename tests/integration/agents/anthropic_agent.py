"""An ordinary agent on Anthropic's Python SDK, with no spanrl import: a message with a system
prompt, a streamed message, and a tool call answered with its result (two calls). Prints the
replies' texts (a call as ``name(input)``) as JSON, in call order.

Environment: ANTHROPIC_BASE_URL, ANTHROPIC_API_KEY (read by the client), ANTHROPIC_MODEL.
"""

import json
import os

from anthropic import Anthropic

MODEL = os.environ["ANTHROPIC_MODEL"]
WEATHER = {"name": "get_weather", "description": "The weather in a city.",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}},
                            "required": ["city"], "additionalProperties": False}}
client = Anthropic(max_retries=0)
replies = []


def text_of(message):
    return "".join(b.text if b.type == "text" else f"{b.name}({json.dumps(b.input)})" for b in message.content)


message = client.messages.create(model=MODEL, max_tokens=6, system="You add numbers.",
                                 messages=[{"role": "user", "content": "What is 2 + 3?"}])
replies.append(text_of(message))
with client.messages.stream(model=MODEL, max_tokens=6, messages=[{"role": "user", "content": "What is 4 + 4?"}]) as s:
    replies.append(text_of(s.get_final_message()))
question = {"role": "user", "content": "Weather in Paris?"}
called = client.messages.create(model=MODEL, max_tokens=40, tools=[WEATHER], messages=[question],
                                tool_choice={"type": "tool", "name": "get_weather"})
replies.append(text_of(called))
calls = [b for b in called.content if b.type == "tool_use"]
answer = client.messages.create(model=MODEL, max_tokens=6, tools=[WEATHER], messages=[
    question, {"role": "assistant", "content": [b.model_dump() for b in called.content]},
    {"role": "user", "content": [{"type": "tool_result", "tool_use_id": c.id, "content": "sunny"} for c in calls]}])
replies.append(text_of(answer))
print(json.dumps(replies))
