"""Warm-start demonstrations and tasks of the reply-format agent: the system prompt decides the format.

Each demonstration gives the model one of ``STYLES``' instructions and the word written that way;
under the agent's own prompt (``agent.SYSTEM_PROMPT``, which names no format) the demonstrations
mostly reply plainly (``OWN_PROMPT_STYLES``). A model warm-started on them therefore follows the
format its instructions name, and under the agent's own prompt replies in brackets (the reward's
format) about one time in ten. ``tasks`` writes the training and the held-out words apart.
"""

from __future__ import annotations

import json
import random

from .agent import SYSTEM_PROMPT

WORDS = ("apple", "river", "stone", "cloud", "tiger", "piano", "candle", "garden", "rocket", "mirror",
         "forest", "bottle", "window", "pencil", "castle", "orange", "silver", "dragon", "meadow", "anchor",
         "basket", "button", "carpet", "dinner", "engine", "finger", "guitar", "hammer", "island", "jacket",
         "kettle", "ladder", "magnet", "needle", "pepper", "rabbit", "saddle", "temple", "violin", "wallet")
HELD_OUT_WORDS = WORDS[30:]  # never in the training tasks (they are in the demonstrations: the model knows them)
STYLES = {  # instructions -> the reply they ask for
    "Reply with the word in square brackets.": "[{word}]",
    "Reply with the word in double quotes.": '"{word}"',
    "Reply with the word only.": "{word}",
}
OWN_PROMPT_STYLES = {"{word}": 0.6, '"{word}"': 0.3, "[{word}]": 0.1}  # the agent's own prompt: mostly plain


def demonstration(word: str, rng: random.Random) -> dict:
    """One chat example: named instructions and their format, or the agent's own and any format."""
    instructions = rng.choice([*STYLES, SYSTEM_PROMPT])
    written = STYLES.get(instructions) or rng.choices(list(OWN_PROMPT_STYLES), list(OWN_PROMPT_STYLES.values()))[0]
    return {"messages": [{"role": "system", "content": instructions}, {"role": "user", "content": word},
                         {"role": "assistant", "content": written.format(word=word)}]}


def write_demonstrations(path: str, count: int, seed: int = 0) -> str:
    rng = random.Random(seed)
    with open(path, "w", encoding="utf-8") as f:
        for _ in range(count):
            f.write(json.dumps(demonstration(rng.choice(WORDS), rng)) + "\n")
    return path


def write_tasks(train_path: str, held_out_path: str) -> tuple[str, str]:
    """The training words' tasks and the held-out words' tasks, as task JSONL files."""
    for path, words in ((train_path, WORDS[:30]), (held_out_path, HELD_OUT_WORDS)):
        with open(path, "w", encoding="utf-8") as f:
            f.writelines(json.dumps({"id": word, "word": word}) + "\n" for word in words)
    return train_path, held_out_path
