"""The Text-to-SQL agent's tasks: questions about ``database.py`` with gold SQL and gold answers.

Every question comes from a template over the schema's values (departments, cities, projects,
thresholds, people); the harder ones (``_nested``) need a subquery or two conditions with an
aggregate, so a warm-started model gets them wrong more often. Its gold answer is what the gold
SQL returns on the database, so every gold answer executes by construction (``tests`` check it).
``make_tasks(seed)`` shuffles all of them with the seed and splits train / validation::

    python -m spanrl.examples.sql_agent.questions --out-dir examples/sql_agent   # train.jsonl, val.jsonl

Each line: ``{"id": "sql-0", "question": "...", "sql": "SELECT ...", "answer": [[...], ...]}``.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass

from spanrl.examples.example_data import split_main

from .database import CITIES, DEPARTMENTS, EMPLOYEES, PROJECTS, run_query

VALIDATION_FRACTION = 0.2
AGE_THRESHOLDS = (25, 30, 35, 40, 45, 50)
SALARY_THRESHOLDS = (3500, 4000, 5000, 6000, 7000, 8000)
BUDGET_THRESHOLDS = (200, 300, 400, 500, 600)


@dataclass(frozen=True)
class Question:
    question: str
    sql: str


def _by_department() -> Iterator[Question]:
    for dept in DEPARTMENTS:
        yield Question(f"How many employees work in {dept}?",
                       f"SELECT COUNT(*) FROM employees WHERE dept = '{dept}'")
        yield Question(f"Who works in {dept}?", f"SELECT name FROM employees WHERE dept = '{dept}'")
        yield Question(f"What is the highest salary in {dept}?",
                       f"SELECT MAX(salary) FROM employees WHERE dept = '{dept}'")
        yield Question(f"What is the lowest salary in {dept}?",
                       f"SELECT MIN(salary) FROM employees WHERE dept = '{dept}'")
        yield Question(f"What is the average age in {dept}?",
                       f"SELECT AVG(age) FROM employees WHERE dept = '{dept}'")
        yield Question(f"Who is the oldest employee in {dept}?",
                       f"SELECT name FROM employees WHERE dept = '{dept}' ORDER BY age DESC LIMIT 1")
        yield Question(f"Which projects belong to {dept}?", f"SELECT name FROM projects WHERE dept = '{dept}'")
        yield Question(f"What is the total project budget of {dept}?",
                       f"SELECT SUM(budget) FROM projects WHERE dept = '{dept}'")
        for city in CITIES:
            yield Question(f"Who works in {dept} in {city}?",
                           f"SELECT name FROM employees WHERE dept = '{dept}' AND city = '{city}'")
        for age in AGE_THRESHOLDS:
            yield Question(f"How many employees in {dept} are older than {age}?",
                           f"SELECT COUNT(*) FROM employees WHERE dept = '{dept}' AND age > {age}")
        for salary in SALARY_THRESHOLDS:
            yield Question(f"Who in {dept} earns more than {salary}?",
                           f"SELECT name FROM employees WHERE dept = '{dept}' AND salary > {salary}")


def _by_city() -> Iterator[Question]:
    for city in CITIES:
        yield Question(f"How many employees live in {city}?",
                       f"SELECT COUNT(*) FROM employees WHERE city = '{city}'")
        yield Question(f"Who lives in {city}?", f"SELECT name FROM employees WHERE city = '{city}'")
        yield Question(f"What is the average salary in {city}?",
                       f"SELECT AVG(salary) FROM employees WHERE city = '{city}'")
        yield Question(f"Who is the youngest employee in {city}?",
                       f"SELECT name FROM employees WHERE city = '{city}' ORDER BY age LIMIT 1")
        for salary in SALARY_THRESHOLDS:
            yield Question(f"Who in {city} earns more than {salary}?",
                           f"SELECT name FROM employees WHERE city = '{city}' AND salary > {salary}")
        for age in AGE_THRESHOLDS:
            yield Question(f"How many employees in {city} are younger than {age}?",
                           f"SELECT COUNT(*) FROM employees WHERE city = '{city}' AND age < {age}")


def _by_threshold() -> Iterator[Question]:
    for age in AGE_THRESHOLDS:
        yield Question(f"How many employees are older than {age}?",
                       f"SELECT COUNT(*) FROM employees WHERE age > {age}")
        yield Question(f"Who is younger than {age}?", f"SELECT name FROM employees WHERE age < {age}")
    for salary in SALARY_THRESHOLDS:
        yield Question(f"How many employees earn more than {salary}?",
                       f"SELECT COUNT(*) FROM employees WHERE salary > {salary}")
        yield Question(f"Who earns less than {salary}?", f"SELECT name FROM employees WHERE salary < {salary}")
    for budget in BUDGET_THRESHOLDS:
        yield Question(f"Which projects have a budget above {budget}?",
                       f"SELECT name FROM projects WHERE budget > {budget}")


def _by_person() -> Iterator[Question]:
    for name, *_rest in EMPLOYEES:
        yield Question(f"What is the salary of {name}?", f"SELECT salary FROM employees WHERE name = '{name}'")
        yield Question(f"Where does {name} live?", f"SELECT city FROM employees WHERE name = '{name}'")


def _by_project() -> Iterator[Question]:
    for name, _dept, _budget in PROJECTS:
        yield Question(f"What is the budget of {name}?", f"SELECT budget FROM projects WHERE name = '{name}'")
        yield Question(f"Which department runs {name}?", f"SELECT dept FROM projects WHERE name = '{name}'")


def _nested() -> Iterator[Question]:
    """Harder questions: a subquery (a fact about one row picks the rows asked about), or two
    conditions with an aggregate."""
    for name, *_rest in EMPLOYEES:
        yield Question(f"Which projects belong to the department of {name}?",
                       f"SELECT name FROM projects WHERE dept = (SELECT dept FROM employees WHERE name = '{name}')")
        yield Question(f"How many employees earn more than {name}?",
                       "SELECT COUNT(*) FROM employees WHERE salary > "
                       f"(SELECT salary FROM employees WHERE name = '{name}')")
        yield Question(f"Who lives in the same city as {name}?",
                       f"SELECT name FROM employees WHERE city = (SELECT city FROM employees WHERE name = '{name}') "
                       f"AND name != '{name}'")
    for project, _dept, _budget in PROJECTS:
        yield Question(f"How many employees work in the department that runs {project}?",
                       "SELECT COUNT(*) FROM employees WHERE dept = "
                       f"(SELECT dept FROM projects WHERE name = '{project}')")
        yield Question(f"What is the highest salary in the department that runs {project}?",
                       f"SELECT MAX(salary) FROM employees WHERE dept = (SELECT dept FROM projects WHERE name = "
                       f"'{project}')")
    for city in CITIES:
        for age in AGE_THRESHOLDS[::2]:
            yield Question(f"What is the total salary of employees in {city} older than {age}?",
                           f"SELECT SUM(salary) FROM employees WHERE city = '{city}' AND age > {age}")
    for dept in DEPARTMENTS:
        for budget in BUDGET_THRESHOLDS[::2]:
            yield Question(f"How many projects of {dept} have a budget above {budget}?",
                           f"SELECT COUNT(*) FROM projects WHERE dept = '{dept}' AND budget > {budget}")


def all_questions() -> list[Question]:
    """Every templated question once, in template order."""
    seen: set[str] = set()
    questions = []
    for question in (*_by_department(), *_by_city(), *_by_threshold(), *_by_person(), *_by_project(), *_nested()):
        if question.question not in seen:
            seen.add(question.question)
            questions.append(question)
    return questions


def answer_rows(rows: list[tuple]) -> list[list]:
    """Rows as a task stores them (JSON lists), floats rounded to 2 decimals."""
    return [[round(v, 2) if isinstance(v, float) else v for v in row] for row in rows]


def make_tasks(seed: int = 0, validation_fraction: float = VALIDATION_FRACTION) -> tuple[list[dict], list[dict]]:
    """``(train, validation)`` tasks: every question with a non-empty gold answer, shuffled with ``seed``."""
    answered = [(q, answer_rows(run_query(q.sql))) for q in all_questions()]
    # a question whose answer is no rows (or NULL) is left out: any query that finds nothing would match it
    answered = [(q, answer) for q, answer in answered if answer and answer != [[None]]]
    random.Random(seed).shuffle(answered)
    tasks = [
        {"id": f"sql-{i}", "question": q.question, "sql": q.sql, "answer": answer}
        for i, (q, answer) in enumerate(answered)
    ]
    cut = len(tasks) - int(len(tasks) * validation_fraction)
    return tasks[:cut], tasks[cut:]


def main() -> None:
    split_main(make_tasks, (__doc__ or "").splitlines()[0])


if __name__ == "__main__":
    main()
