"""An ordinary OpenAI-SDK agent on chat completions, with no spanrl import: one call, one
streamed call, one completions call. Prints the replies' texts as JSON, in call order.

Environment: OPENAI_BASE_URL, OPENAI_API_KEY, OPENAI_MODEL.
"""

import json
import os

from openai import OpenAI

MODEL = os.environ["OPENAI_MODEL"]
client = OpenAI()
replies = []
reply = client.chat.completions.create(model=MODEL, max_tokens=6,
                                       messages=[{"role": "user", "content": "What is 2 + 3?"}])
replies.append(reply.choices[0].message.content)
stream = client.chat.completions.create(model=MODEL, max_tokens=6, stream=True,
                                        messages=[{"role": "user", "content": "What is 4 + 4?"}])
replies.append("".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices))
completion = client.completions.create(model=MODEL, prompt="CALC 1+1", max_tokens=6)
replies.append(completion.choices[0].text)
print(json.dumps(replies))
