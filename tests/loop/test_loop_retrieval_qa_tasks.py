"""The retrieval QA example's data and reward: the generated world and corpus, the multi-hop
questions and their split, BM25 search (bm25s), the reward and the warm-start demonstrations."""

from __future__ import annotations

import json
import random
from pathlib import Path

from spanrl.examples.retrieval_qa import corpus, demonstrations, questions
from spanrl.examples.retrieval_qa.reward import chain_credit, exact_match, reward, token_f1
from spanrl.examples.retrieval_qa.search import search, search_in

EXAMPLE_DIR = Path(__file__).resolve().parents[2] / "examples" / "retrieval_qa"


def test_committed_files_are_what_the_generators_write():
    assert corpus.load_corpus() == corpus.documents(corpus.build_world()), "regenerate corpus.jsonl with corpus.py"
    train, validation = questions.make_tasks(seed=0)
    for name, tasks in (("train.jsonl", train), ("val.jsonl", validation)):
        lines = (EXAMPLE_DIR / name).read_text().splitlines()
        assert [json.loads(line) for line in lines] == tasks, f"regenerate {name} with questions.py"


def test_every_answer_takes_each_hop_of_its_chain_through_search():
    """Searching each hop's entity shows the next hop's entity (or the answer), and the question
    itself names neither: two or more look-ups are needed."""
    train, validation = questions.make_tasks(seed=0)
    for task in train + validation:
        chain = [*task["hops"], task["answer"]]
        assert len(task["hops"]) >= 2
        for entity, following in zip(chain, chain[1:], strict=False):
            assert following in search(entity), (task, entity)
        assert task["hops"][0] in task["question"]
        assert not any(entity in task["question"] for entity in chain[1:])


def test_validation_asks_about_subjects_training_never_asks_about():
    train, validation = questions.make_tasks(seed=0)
    assert 150 <= len(train) and 40 <= len(validation)
    assert {t["hops"][0] for t in train}.isdisjoint({t["hops"][0] for t in validation})
    assert {t["kind"] for t in validation} == {"founder_birthplace", "company_country", "person_country",
                                               "founder_country"}
    assert questions.make_tasks(seed=1) != questions.make_tasks(seed=0)


def test_search_ranks_the_named_entity_first_and_says_when_nothing_matches():
    world = corpus.build_world()
    company, founder = next(iter(world.company_founder.items()))
    assert search(company).splitlines()[0].startswith(f"{company} was founded by {founder}")
    assert search(founder).splitlines()[0] == f"{founder} was born in {world.person_birthplace[founder]}."
    assert search("qqq zzz") == "no results" and search("") == "no results"


def test_reward_is_normalised_exact_match_and_f1_is_partial_credit():
    assert exact_match("  the Hulix. ", "Hulix") == 1.0
    assert exact_match("Hulix Losat", "Hulix") == 0.0 and exact_match("", "") == 0.0
    assert token_f1("Hulix Losat", "Hulix") == 2 * 0.5 * 1.0 / 1.5
    assert reward({"answer": "Hulix"}, {"output": "hulix"}) == 1.0
    assert reward({"answer": "Hulix"}, {}) == 0.0


def test_chain_credit_grows_along_the_chain_and_only_the_gold_answer_gets_1():
    hops = ["Zufi Books", "Lotor Nevmarul", "Jorhulka"]  # company, its founder, the founder's birthplace
    said = {answer: chain_credit(answer, "Tormiwyn", hops)
            for answer in ("Tormiwyn", "the Jorhulka.", "Lotor Nevmarul", "Zufi Books", "Lotor", "", "Dorfi")}
    assert said == {"Tormiwyn": 1.0, "the Jorhulka.": 0.5 * 2 / 3, "Lotor Nevmarul": 0.5 / 3, "Zufi Books": 0.0,
                    "Lotor": 0.0, "": 0.0, "Dorfi": 0.0}


def test_demonstrations_show_the_tool_results_the_agent_would_see():
    asked = demonstrations.demonstration_questions()
    rng = random.Random(0)
    examples = [demonstrations.demonstration(task, rng) for task in asked]
    full = skipped = 0
    for task, example in zip(asked, examples, strict=True):
        messages = example["messages"]
        assert messages[0]["content"] == demonstrations.INSTRUCTIONS and messages[1]["content"] == task["question"]
        calls = [m for m in messages if m.get("tool_calls")]
        results = [m["content"] for m in messages if m["role"] == "tool"]
        queries = [json.loads(m["tool_calls"][0]["function"]["arguments"])["query"] for m in calls]
        texts = demonstrations.demonstration_world(task["world"])[1]
        assert queries == task["hops"][:len(queries)] and results == [search_in(texts, q) for q in queries]
        assert queries, "every demonstration looks the first hop up"
        if len(queries) == len(task["hops"]):
            full += 1
            assert messages[-1] == {"role": "assistant", "content": task["answer"]}
        else:  # stopped early: replies with the entity the last result names, not the answer
            skipped += 1
            named = task["hops"][len(queries)]
            assert named in results[-1] and messages[-1] == {"role": "assistant", "content": named} != task["answer"]
        assert example["tools"] == [demonstrations.tool_schema()]
    assert full and skipped  # both of the demonstrator's behaviours
    assert demonstrations.tool_schema()["function"]["name"] == "search"


def test_demonstrations_never_ask_about_the_examples_world():
    """What the demonstrator answers from memory must be of no use on the example's questions."""
    world = corpus.build_world()
    names = {*world.company_founder, *world.person_birthplace, *world.city_country, *world.countries}
    train, validation = questions.make_tasks(seed=0)
    example_questions = {task["question"] for task in train + validation}
    asked = demonstrations.demonstration_questions()
    assert len({task["world"] for task in asked}) == len(demonstrations.DEMONSTRATION_WORLD_SEEDS)
    assert len({task["question"] for task in asked}) > 5 * len(example_questions)
    for task in asked:
        assert task["question"] not in example_questions
        assert not names & {*task["hops"], task["answer"]}, task
