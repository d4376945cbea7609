"""Warm-start demonstrations of the Text-to-SQL agent for a locally created model (chat examples).

A fresh model knows neither SQL nor the agents' protocol. The demonstrations show each agent's
calls exactly as ``agent.py`` makes them (same prompts, the ``run_sql`` tool as ``bind_tools``
sends it, results as ``try_query`` words them):

- writer: the gold query directly; or a ``run_sql`` try of it, its rows, then the query; or a try of a
  broken query (a wrong column or table, SQLite's error), then the gold query. Like the other
  examples' demonstrators, a share of the writer's answers to the harder questions are *hasty*: the
  query of a simpler question (the named person where a look-up of their department or salary is
  needed, or only the first of two conditions). That share is 0 in the first quarter of the warm
  start's batches (``example_data.weaker_share``), so the model first learns the protocol and the
  full queries;
- checker: ``OK`` for the gold query's rows, ``WRONG`` for an error or a wrong query's rows;
- rewriter: the gold query for a broken or wrong one.

So the warm model often answers the harder questions hastily, and RL has something to compare: an
earlier demonstrator whose mistakes were misspelt names and swapped operators left the warm start
either with little to gain or nearly solved (docs/results.md, 2026-11-29).
``python -m spanrl.examples.sql_agent.demonstrations --out demos.jsonl --tokenizer-text tools.txt`` writes
a file for ``spanrl sft`` / ``warm_start: demonstrations:`` and, with the second file, the tokenizer's
corpus for ``spanrl model init --corpus``.
"""

from __future__ import annotations

import argparse
import functools
import json
import random
import re
from collections.abc import Iterator

from spanrl.examples.example_data import weaker_share, write_tool_call_text

from .agent import CHECKER_PROMPT, REWRITER_PROMPT, WRITER_PROMPT, describe, run_sql
from .agent import result_text as _result_text
from .questions import make_tasks

result_text = functools.cache(_result_text)  # deterministic: the same query always gives the same text

# a query SQLite rejects, made from a gold one: (what to replace, its replacement)
BREAKAGES = (
    ("employees", "employee"), ("projects", "project"), ("dept", "department"), ("salary", "salaries"),
    ("name", "names"), ("budget", "budgets"), ("city", "town"), ("age", "years"), ("SELECT", "SELEC"),
)
# a query that runs but answers something else
SWAPS = ((" > ", " < "), (" < ", " > "), ("MAX(", "MIN("), ("MIN(", "MAX("), ("COUNT(*)", "name"),
         ("AVG(", "SUM("), (" DESC", ""))
HASTY_SHARE = 0.6  # of the harder questions' writer answers, after the first quarter of the warm start
SUBQUERY = re.compile(r"\(SELECT \w+ FROM \w+ WHERE name = '(\w+)'\)")


@functools.cache
def tool_schema() -> dict:
    """``run_sql`` as the OpenAI tools API describes it (what ``bind_tools`` sends)."""
    from langchain_core.utils.function_calling import convert_to_openai_tool

    return convert_to_openai_tool(run_sql)


def broken_query(sql: str, rng: random.Random) -> str:
    """``sql`` with one name or keyword misspelt, so SQLite rejects it."""
    options = [(old, new) for old, new in BREAKAGES if old in sql]
    old, new = rng.choice(options)
    return sql.replace(old, new, 1)


def wrong_query(sql: str, rng: random.Random) -> str:
    """A query that runs but (most often) answers something else; a broken one when no swap fits."""
    options = [(old, new) for old, new in SWAPS if old in sql]
    if not options:
        return broken_query(sql, rng)
    old, new = rng.choice(options)
    return sql.replace(old, new, 1)


def hasty_query(sql: str) -> str | None:
    """The query a hasty writer gives for ``sql``'s question: the named entity itself where a look-up
    is needed, or only the first of two conditions. It runs, and answers a simpler question.
    None for a question with no such shortcut."""
    if SUBQUERY.search(sql):
        return SUBQUERY.sub(lambda match: f"'{match.group(1)}'", sql, count=1)
    if " AND " in sql:
        return sql.split(" AND ")[0]
    return None


def _tool_call(sql: str, number: int) -> dict:
    return {"role": "assistant", "content": "", "tool_calls": [{
        "id": f"call_{number}", "type": "function",
        "function": {"name": "run_sql", "arguments": json.dumps({"query": sql})}}]}


def writer_example(task: dict, rng: random.Random, hasty_share: float) -> dict:
    question, gold = task["question"], task["sql"]
    messages: list[dict] = [{"role": "system", "content": WRITER_PROMPT}, {"role": "user", "content": question}]
    hasty = hasty_query(gold)
    final = hasty if hasty is not None and rng.random() < hasty_share else gold
    kind = rng.random()
    if kind < 0.3:  # try the final query first, read its rows, then give it
        messages += [_tool_call(final, 0), {"role": "tool", "tool_call_id": "call_0", "content": result_text(final)}]
    elif kind < 0.5 and final == gold:  # try a broken query, read the error, then give the right one
        tried = broken_query(gold, rng)
        messages += [_tool_call(tried, 0), {"role": "tool", "tool_call_id": "call_0", "content": result_text(tried)}]
    messages.append({"role": "assistant", "content": final})
    return {"messages": messages, "tools": [tool_schema()]}


def _described(task: dict, query: str) -> str:
    return describe({"question": task["question"], "query": query, "result": result_text(query)})


def checker_example(task: dict, rng: random.Random) -> dict:
    query = task["sql"] if rng.random() < 0.5 else (
        broken_query(task["sql"], rng) if rng.random() < 0.5 else wrong_query(task["sql"], rng))
    verdict = "OK" if result_text(query) == result_text(task["sql"]) else "WRONG"
    return {"messages": [{"role": "system", "content": CHECKER_PROMPT},
                         {"role": "user", "content": _described(task, query)},
                         {"role": "assistant", "content": verdict}]}


def rewriter_example(task: dict, rng: random.Random) -> dict:
    bad = broken_query(task["sql"], rng) if rng.random() < 0.5 else wrong_query(task["sql"], rng)
    return {"messages": [{"role": "system", "content": REWRITER_PROMPT},
                         {"role": "user", "content": _described(task, bad)},
                         {"role": "assistant", "content": task["sql"]}]}


def demonstration(task: dict, rng: random.Random, hasty_share: float = HASTY_SHARE) -> dict:
    """One chat example: a writer call (half the time), a checker call or a rewriter call."""
    draw = rng.random()
    if draw < 0.5:
        return writer_example(task, rng, hasty_share)
    if draw < 0.75:
        return checker_example(task, rng)
    return rewriter_example(task, rng)


def demonstration_batches(steps: int, batch_size: int, seed: int = 0,
                          hasty_share: float = HASTY_SHARE) -> Iterator[list[dict]]:
    """``steps`` batches of fresh demonstrations on the training questions (never validation's); the
    first batches show no hasty writer (``example_data.weaker_share``)."""
    train, _ = make_tasks(seed=0)
    rng = random.Random(seed)
    for step in range(steps):
        share = weaker_share(step, steps, hasty_share)
        yield [demonstration(rng.choice(train), rng, share) for _ in range(batch_size)]


def write_demonstrations(path: str, count: int = 2000, seed: int = 0, hasty_share: float = HASTY_SHARE) -> None:
    """``count`` demonstrations as chat JSONL (``{"messages": [...], "tools": [...]}`` a line)."""
    train, _ = make_tasks(seed=0)
    rng = random.Random(seed)
    with open(path, "w", encoding="utf-8") as f:
        for _ in range(count):
            f.write(json.dumps(demonstration(rng.choice(train), rng, hasty_share)) + "\n")


def write_tokenizer_corpus(path: str, demonstrations_file: str) -> None:
    """Plain text the tokenizer also learns from: the tool-call and tool-response lines as the chat
    template writes them (the demonstrations' message contents alone leave them out)."""
    write_tool_call_text(path, demonstrations_file, "run_sql", tool_schema())


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--count", type=int, default=2000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--hasty-share", type=float, default=HASTY_SHARE,
                        help="the share of hasty writer answers to the harder questions")
    parser.add_argument("--tokenizer-text", help="also write the tool-call text lines for `spanrl model init --corpus`")
    args = parser.parse_args()
    write_demonstrations(args.out, args.count, args.seed, args.hasty_share)
    if args.tokenizer_text:
        write_tokenizer_corpus(args.tokenizer_text, args.out)


if __name__ == "__main__":
    main()
