"""The retrieval QA example's questions: two or three look-ups each, with gold answers.

Four kinds, over the world of ``corpus.py``:

- ``founder_birthplace``: "Where was the founder of C born?" (company -> founder -> city)
- ``company_country``: "In which country is C based?" (company -> city -> country)
- ``person_country``: "In which country was P born?" (person -> city -> country)
- ``founder_country``: "In which country was the founder of C born?" (three look-ups)

The split is by the question's subject: a fifth of the companies and of the people (drawn with
the seed) are asked about only in ``val.jsonl``, so validation asks about subjects training never
asked about. ``python -m spanrl.examples.retrieval_qa.questions --out-dir examples/retrieval_qa``
writes ``train.jsonl`` and ``val.jsonl``; a line is ``{"id", "question", "answer", "kind", "hops"}``
where ``hops`` lists the documents' titles a full answer reads, in order.
"""

from __future__ import annotations

import random

from spanrl.examples.example_data import split_main

from .corpus import World, build_world

VALIDATION_FRACTION = 0.2


def questions_about_company(world: World, company: str) -> list[dict]:
    founder = world.company_founder[company]
    birthplace = world.person_birthplace[founder]
    seat = world.company_city[company]
    return [
        {"question": f"Where was the founder of {company} born?", "answer": birthplace,
         "kind": "founder_birthplace", "hops": [company, founder]},
        {"question": f"In which country is {company} based?", "answer": world.city_country[seat],
         "kind": "company_country", "hops": [company, seat]},
        {"question": f"In which country was the founder of {company} born?",
         "answer": world.city_country[birthplace], "kind": "founder_country",
         "hops": [company, founder, birthplace]},
    ]


def questions_about_person(world: World, person: str) -> list[dict]:
    birthplace = world.person_birthplace[person]
    return [{"question": f"In which country was {person} born?", "answer": world.city_country[birthplace],
             "kind": "person_country", "hops": [person, birthplace]}]


def make_tasks(seed: int = 0, validation_fraction: float = VALIDATION_FRACTION,
               world: World | None = None) -> tuple[list[dict], list[dict]]:
    """``(train, validation)``: validation's subjects (companies, people) are never training's."""
    world = world or build_world()
    rng = random.Random(seed)
    companies = sorted(world.company_founder)
    people = sorted(world.person_birthplace)
    rng.shuffle(companies)
    rng.shuffle(people)
    held_out = set(companies[:int(len(companies) * validation_fraction)])
    held_out |= set(people[:int(len(people) * validation_fraction)])
    train: list[dict] = []
    validation: list[dict] = []
    for subject in companies + people:
        asked = (questions_about_company(world, subject) if subject in world.company_founder
                 else questions_about_person(world, subject))
        (validation if subject in held_out else train).extend(asked)
    rng.shuffle(train)
    rng.shuffle(validation)
    return ([{"id": f"qa-{i}", **task} for i, task in enumerate(train)],
            [{"id": f"qa-val-{i}", **task} for i, task in enumerate(validation)])


def main() -> None:
    split_main(make_tasks, (__doc__ or "").splitlines()[0])


if __name__ == "__main__":
    main()
