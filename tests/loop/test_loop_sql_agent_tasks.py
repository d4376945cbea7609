"""The Text-to-SQL example's data and reward: the question generator, the gold answers, the
execution-match reward and the warm-start demonstrations, on the real SQLite database."""

from __future__ import annotations

import json
import random
import sqlite3
from pathlib import Path

import pytest
from langchain_core.messages import AIMessage

from spanrl.examples.sql_agent import database, demonstrations
from spanrl.examples.sql_agent.agent import query_of, result_text, try_query
from spanrl.examples.sql_agent.questions import all_questions, answer_rows, make_tasks
from spanrl.examples.sql_agent.reward import execution_match, reward

EXAMPLE_DIR = Path(__file__).resolve().parents[2] / "examples" / "sql_agent"


def test_every_gold_query_executes_and_gives_the_stored_answer():
    train, validation = make_tasks(seed=0)
    tasks = train + validation
    assert 300 <= len(tasks) <= 500  # a few hundred
    for task in tasks:
        assert answer_rows(database.run_query(task["sql"])) == task["answer"], task
        assert execution_match(task["sql"], task["answer"]) == 1.0
    assert len({t["id"] for t in tasks}) == len(tasks)
    # the split is disjoint; no gold answer is empty (a query finding nothing would match it)
    assert not {t["question"] for t in train} & {t["question"] for t in validation}
    assert len(validation) == int(len(tasks) * 0.2)
    assert all(task["answer"] for task in tasks)


def test_the_split_depends_on_the_seed_only():
    assert make_tasks(seed=3) == make_tasks(seed=3)
    assert make_tasks(seed=3)[1] != make_tasks(seed=4)[1]
    assert len(all_questions()) == len({q.question for q in all_questions()})


def test_committed_task_files_are_what_the_generator_writes():
    train, validation = make_tasks(seed=0)
    for name, tasks in (("train.jsonl", train), ("val.jsonl", validation)):
        lines = (EXAMPLE_DIR / name).read_text().splitlines()
        assert [json.loads(line) for line in lines] == tasks, f"regenerate {name} with questions.py"


def test_the_database_is_read_only_and_fresh_for_every_query():
    with pytest.raises(sqlite3.OperationalError):
        database.run_query("DELETE FROM employees")
    assert database.run_query("SELECT COUNT(*) FROM employees") == [(len(database.EMPLOYEES),)]


def test_a_query_can_neither_write_files_nor_undo_the_read_only_mode(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # where ATTACH or VACUUM INTO would create their files
    for query in ("ATTACH 'copy.db' AS copy", "VACUUM INTO 'copy.db'", "VACUUM", "PRAGMA query_only = OFF",
                  "PRAGMA writable_schema = ON", "PRAGMA journal_mode = DELETE"):
        with pytest.raises(sqlite3.DatabaseError, match="not authorized|authorization denied"):
            database.run_query(query)
    assert list(tmp_path.iterdir()) == []
    # reading the schema stays allowed, as a pragma or its table-valued function
    assert [row[1] for row in database.run_query("PRAGMA table_info(projects)")] == ["name", "dept", "budget"]
    assert database.run_query("SELECT count(*) FROM pragma_table_info('employees')") == [(5,)]


def test_a_query_that_would_run_forever_is_stopped_at_its_deadline():
    endless = "WITH RECURSIVE n(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM n) SELECT count(*) FROM n"
    with pytest.raises(database.QueryTimeout, match="ran longer than 0.2 s"):
        database.run_query(endless, timeout_s=0.2)
    growing = "WITH RECURSIVE s(x) AS (SELECT 'ab' UNION ALL SELECT x || x FROM s) SELECT length(x) FROM s"
    with pytest.raises(sqlite3.DataError, match="too big"):  # a value cannot grow without bound either
        database.run_query(growing)
    assert try_query(endless).startswith("ERROR: query stopped: it ran longer than")
    assert database.run_query("SELECT count(*) FROM employees") == [(len(database.EMPLOYEES),)]


def test_execution_match_compares_rows_as_a_multiset():
    gold = [["Ada"], ["Gus"]]
    assert execution_match("SELECT name FROM employees WHERE name IN ('Gus', 'Ada') ORDER BY name DESC", gold) == 1.0
    assert execution_match("SELECT name FROM employees WHERE name IN ('Ada')", gold) == 0.0
    assert execution_match("SELECT name FROM employees WHERE name IN ('Ada', 'Gus', 'Ben')", gold) == 0.0
    assert execution_match("SELECT name, age FROM employees WHERE name IN ('Ada', 'Gus')", gold) == 0.0
    assert execution_match("SELECT nam FROM employees", gold) == 0.0  # SQLite rejects it
    assert execution_match("SELECT 1; SELECT 2", [[1]]) == 0.0  # two statements
    assert execution_match("", []) == 0.0  # no query is never right, even for an empty answer
    # averages are compared to 2 decimals
    task = next(t for t in make_tasks(0)[0] if t["sql"].startswith("SELECT AVG("))
    assert execution_match(task["sql"].replace("AVG(", "ROUND(AVG(").replace(") FROM", "), 2) FROM", 1),
                           task["answer"]) == 1.0


def test_reward_function_reads_the_runner_output_variable():
    task = make_tasks(0)[0][0]
    assert reward(task, {"output": task["sql"]}) == 1.0
    assert reward(task, {"output": task["sql"].replace("SELECT", "SELEC")}) == 0.0
    assert reward(task, {}) == 0.0


def test_query_of_takes_the_text_else_the_tool_call():
    assert query_of(AIMessage(content="```sql\nSELECT 1\n```")) == "SELECT 1"
    call = {"name": "run_sql", "args": {"query": "SELECT 2"}, "id": "call_0"}
    assert query_of(AIMessage(content="", tool_calls=[call])) == "SELECT 2"
    assert query_of(AIMessage(content="")) == ""


def test_try_query_words_results_as_the_demonstrations_do():
    assert try_query("SELECT name FROM projects WHERE budget > 650") == "Apollo\nFalcon"
    assert try_query("SELECT nam FROM projects") == "ERROR: no such column: nam"
    for query in ("SELECT AVG(age) FROM employees", "SELECT name FROM projects WHERE budget > 10000", "SELEC 1"):
        assert try_query(query) == result_text(query)


def test_demonstrations_break_queries_for_real_and_judge_them_right():
    rng = random.Random(0)
    train, _ = make_tasks(0)
    for task in train:
        broken = demonstrations.broken_query(task["sql"], rng)
        with pytest.raises(sqlite3.Error):
            database.run_query(broken)
    examples = [demonstrations.demonstration(task, rng) for task in train * 2]
    writers = [e for e in examples if "tools" in e]
    checkers = [e for e in examples if e["messages"][0]["content"] == demonstrations.CHECKER_PROMPT]
    assert writers and checkers and len(writers) + len(checkers) < len(examples)  # rewriters too
    assert {"OK", "WRONG"} == {e["messages"][-1]["content"] for e in checkers}
    for example in checkers:
        result = example["messages"][1]["content"].rsplit("Result: ", 1)[1]
        if result.startswith("ERROR:"):
            assert example["messages"][-1]["content"] == "WRONG"
    # writer examples with a tool try carry the tool's real answer to the query tried
    for example in writers:
        messages = example["messages"]
        if len(messages) == 5:
            tried = json.loads(messages[2]["tool_calls"][0]["function"]["arguments"])["query"]
            assert messages[3]["content"] == try_query(tried)
    assert writers[0]["tools"] == [demonstrations.tool_schema()]
    assert demonstrations.tool_schema()["function"]["name"] == "run_sql"


def test_hasty_writer_answers_a_simpler_question_with_a_query_that_runs():
    """The demonstrator's weaker writer: for every harder question its query runs and answers
    something else; the simple questions have no hasty form; the first quarter of the warm start
    shows no hasty answer at all."""
    train, _ = make_tasks(0)
    hasty = {task["sql"]: demonstrations.hasty_query(task["sql"]) for task in train}
    harder = [sql for sql in hasty if " AND " in sql or "(SELECT" in sql]
    assert len(harder) > 10 and {sql for sql, query in hasty.items() if query is not None} == set(harder)
    same_answer = 0
    for sql in harder:
        assert len(hasty[sql]) < len(sql)
        same_answer += database.run_query(hasty[sql]) == database.run_query(sql)  # raises if it did not run
    assert same_answer < len(harder) / 5  # 22 of 220: a shortcut that happens to give the same rows

    def final_answers(batches):
        return [e["messages"][-1]["content"] for batch in batches for e in batch if "tools" in e]

    golds = {task["sql"] for task in train}
    batches = list(demonstrations.demonstration_batches(8, 64, seed=0, hasty_share=1.0))
    assert all(answer in golds for answer in final_answers(batches[:2]))
    assert any(answer not in golds for answer in final_answers(batches[2:]))


def test_each_node_asks_for_its_own_model_name_when_told(monkeypatch):
    """SQL_AGENT_MODEL_PER_NODE=1: the writer, checker and rewriter ask for models named after them
    (what `adapters:` routes by); unset, every node asks for OPENAI_MODEL."""
    from spanrl.examples.sql_agent.agent import ModelConfig, model_of

    monkeypatch.setenv("OPENAI_MODEL", "policy")
    monkeypatch.delenv("SQL_AGENT_MODEL_PER_NODE", raising=False)
    assert {model_of({}, node).model_name for node in ("writer", "checker")} == {"policy"}
    monkeypatch.setenv("SQL_AGENT_MODEL_PER_NODE", "1")
    assert ModelConfig.from_env().model_per_node
    assert [model_of({}, node).model_name for node in ("writer", "checker", "rewriter")] == \
        ["writer", "checker", "rewriter"]
