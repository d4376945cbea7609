"""The retrieval QA example's world: made-up people, companies, cities and countries, and the
encyclopedia of short documents that describes them.

No fact can be known from the question or memorised from pre-training: every name is made of
random syllables, and every link (a company's founder and seat, a person's birthplace, a city's
country) is drawn with a fixed seed. Each entity has one document; a company's document names its
founder and its city, a person's names the city they were born in, a city's names its country. So
"Where was the founder of Dravik Holt born?" needs two look-ups: the company's document gives the
founder, the founder's document gives the city. ``build_world()`` is deterministic; the committed
``corpus.jsonl`` is what ``python -m spanrl.examples.retrieval_qa.corpus --out ...`` writes
(``{"id": "doc-0", "title": ..., "text": ...}`` a line). Used by ``questions.py`` and ``search.py``.
"""

from __future__ import annotations

import argparse
import json
import random
from dataclasses import dataclass
from pathlib import Path

CORPUS_FILE = Path(__file__).resolve().parent / "corpus.jsonl"
WORLD_SEED = 2108  # arXiv 2508.03680's month, nothing more
SYLLABLES = ("ka", "lo", "mi", "ran", "tes", "vo", "zu", "bel", "dor", "fi", "gan", "hul", "ix", "jor",
             "kel", "mar", "nev", "ost", "pra", "quin", "ril", "sat", "tor", "ul", "vek", "wyn", "yar", "zel")
COUNTRIES = 6
CITIES = 24
PEOPLE = 80
COMPANIES = 60


@dataclass(frozen=True)
class World:
    """Every entity and link; names are unique across all kinds."""

    countries: tuple[str, ...]
    city_country: dict[str, str]
    person_birthplace: dict[str, str]
    company_founder: dict[str, str]
    company_city: dict[str, str]


def _names(rng: random.Random, count: int, parts: int, taken: set[str]) -> list[str]:
    """``count`` new capitalised names of ``parts`` words (two or three syllables each)."""
    names: list[str] = []
    while len(names) < count:
        words = ["".join(rng.choice(SYLLABLES) for _ in range(rng.choice((2, 3)))).capitalize()
                 for _ in range(parts)]
        name = " ".join(words)
        if name not in taken and not any(word in taken for word in words):
            taken.add(name)
            names.append(name)
    return names


def build_world(seed: int = WORLD_SEED) -> World:
    """The world of the example (the same for a seed on every machine)."""
    rng = random.Random(seed)
    taken: set[str] = set()
    countries = _names(rng, COUNTRIES, 1, taken)
    cities = _names(rng, CITIES, 1, taken)
    people = _names(rng, PEOPLE, 2, taken)
    companies = [f"{name} {rng.choice(('Labs', 'Works', 'Foods', 'Motors', 'Books'))}"
                 for name in _names(rng, COMPANIES, 1, taken)]
    return World(
        countries=tuple(countries),
        city_country={city: rng.choice(countries) for city in cities},
        person_birthplace={person: rng.choice(cities) for person in people},
        company_founder={company: rng.choice(people) for company in companies},
        company_city={company: rng.choice(cities) for company in companies},
    )


def documents(world: World) -> list[dict]:
    """One short document per company, person and city (``id``, ``title``, ``text``)."""
    texts: list[tuple[str, str]] = []
    for company, founder in world.company_founder.items():
        texts.append((company, f"{company} was founded by {founder}. {company} is based in "
                               f"{world.company_city[company]}."))
    for person, city in world.person_birthplace.items():
        texts.append((person, f"{person} was born in {city}."))
    for city, country in world.city_country.items():
        texts.append((city, f"{city} is a city in {country}."))
    return [{"id": f"doc-{i}", "title": title, "text": text} for i, (title, text) in enumerate(texts)]


def load_corpus(path: str | Path = CORPUS_FILE) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--out", default=str(CORPUS_FILE))
    args = parser.parse_args()
    docs = documents(build_world())
    with open(args.out, "w", encoding="utf-8") as f:
        for doc in docs:
            f.write(json.dumps(doc) + "\n")
    print(f"{len(docs)} documents in {args.out}")


if __name__ == "__main__":
    main()
