"""The dashboard in a real browser (Debian's Chromium through Playwright) over a real training run.

One run for the module (``training_run.py``): receiver, trainer (tiny model, 3 steps, selective
training of the ``writer`` agent, validation every 2 steps), runner with a two-agent agent, and
``spanrl dashboard``. Steps 1 and 2 are done when the tests start; step 3 waits for the last
test, which watches the run page while it happens. Checked against what the run wrote (the
store read with the receiver's own ``SpanStore``, ``metrics.jsonl``, ``trained_rollouts``) and
the model's tokenizer loaded by transformers. With ``SPANRL_DASHBOARD_SCREENSHOTS=DIR`` each
page is also saved as a PNG in DIR (how docs/dashboard.md's screenshots are made).
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import pytest

from spanrl.dashboard.app import format_number
from spanrl.otlp_receiver import trained_rewards
from spanrl.otlp_receiver.store import SpanStore
from spanrl.schema import metrics as keys
from spanrl.trainer_bridge.advantages import GRPO_EPSILON

from .training_run import start_training_run

SCREENSHOTS = os.environ.get("SPANRL_DASHBOARD_SCREENSHOTS")


@pytest.fixture(scope="module")
def run(tmp_path_factory, browser):
    training = start_training_run(tmp_path_factory.mktemp("dashboard-run"))
    try:
        yield training
    finally:
        training.stop()


def screenshot(page, name: str) -> None:
    if SCREENSHOTS:
        Path(SCREENSHOTS).mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(Path(SCREENSHOTS) / f"dashboard-{name}.png"), full_page=True)


def chart_points(page, canvas: str, label: str) -> list:
    return page.evaluate(
        "([id, label]) => Chart.getChart(id).data.datasets.find((d) => d.label === label).data", [canvas, label])


def in_html(text: str) -> str:
    """``text`` as a browser can hold it: HTML has no NUL character (a parser makes it U+FFFD)."""
    return text.replace("\x00", "\ufffd")


def assembled(run) -> dict:
    store = SpanStore(run.store)
    try:
        rollouts, _ = store.completed_rollouts()
    finally:
        store.close()
    return {r.rollout_id: r for r in rollouts}


def test_run_page_draws_one_point_per_step_with_the_spread_and_agents(run, page):
    rows = run.metrics_rows()
    page.goto(run.dashboard_url + "/run")
    page.wait_for_selector("#steps tbody tr")
    assert chart_points(page, "chart-reward", "reward mean") == pytest.approx([r[keys.REWARD_MEAN] for r in rows])
    assert page.evaluate("Chart.getChart('chart-reward').data.labels") == [r["step"] for r in rows]
    validated = chart_points(page, "chart-reward", "validation reward")
    assert validated == [r.get(keys.VAL_REWARD) for r in rows] and validated[1] is not None
    assert chart_points(page, "chart-loss", "loss") == pytest.approx([r[keys.actor_key("loss")] for r in rows])
    assert chart_points(page, "chart-speed", "rollouts/s") == pytest.approx([r[keys.ROLLOUTS_PER_S] for r in rows])
    # the band is mean ± population std of the rewards each step trained with
    trained = trained_rewards.load(run.store)
    for step, high in zip([r["step"] for r in rows], chart_points(page, "chart-reward", "mean + std"), strict=True):
        rewards = [t.reward for t in trained.values() if t.step == step]
        mean = sum(rewards) / len(rewards)
        assert high == pytest.approx(mean + math.sqrt(sum((x - mean) ** 2 for x in rewards) / len(rewards)))
    # selective training: only the writer's calls were trained
    agents = {row.get_attribute("data-agent"): row.inner_text().split("\t")
              for row in page.query_selector_all("#agents tbody tr")}
    assert set(agents) == {"planner", "writer"}
    assert agents["planner"][2] == "0" and agents["writer"][2] == agents["writer"][1] != "0"
    screenshot(page, "run")


def test_model_text_reaches_the_browser_exactly_but_nul_shows_as_a_replacement(page):
    from spanrl.dashboard.app import exact_text

    # what the templates do with a token's text: a CR kept, a NUL (dropped by any HTML parser in
    # body text, so a sampled NUL token would vanish) shown as U+FFFD, markup escaped
    page.set_content(f"<pre><span id='t'>{exact_text('a<b>&' + chr(13) + 'x' + chr(0) + 'y')}</span></pre>")
    assert page.text_content("#t") == "a<b>&\rx\ufffdy"


def test_rollout_page_shows_the_tree_rewards_on_their_calls_and_tokens(run, page):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(run.model_dir))
    trained = trained_rewards.load(run.store)
    rollout = next(r for r in assembled(run).values() if r.task_id == "q0" and r.rollout_id.startswith("s0-"))
    record = trained[rollout.rollout_id]
    page.goto(f"{run.dashboard_url}/rollouts/{rollout.rollout_id}")
    cells = page.query_selector_all("#spans tbody tr td:first-child")
    names = [cell.inner_text().split(" transition")[0].strip() for cell in cells]
    assert names[0] == "spanrl.rollout" and "lookup tool" in names
    tool = page.query_selector("#spans tr:has-text('lookup tool')")
    assert "ERROR: lookup failed" in tool.inner_text()
    writer = next(t for t in rollout.transitions if t.agent_name == "writer")
    planner = next(t for t in rollout.transitions if t.agent_name == "planner")
    # the AIR reward of the failed tool and the writer's own reward event sit on the writer's call
    call_row = page.query_selector(f"#spans tr[data-span='{writer.span_id}']")
    assert call_row.get_attribute("data-transition") == str(writer.index)
    marks = call_row.inner_text()
    assert "tool_error = -0.1" in marks and "writer_letters" in marks
    assert "tool_error" not in page.inner_text(f"#spans tr[data-span='{planner.span_id}']")

    for transition, trained_on in ((writer, True), (planner, False)):
        section = page.query_selector(f"#transition-{transition.index}")
        tokens = section.query_selector_all(".response .tok")
        assert [int(t.get_attribute("data-id")) for t in tokens] == list(transition.response_token_ids)
        text = "".join(t.text_content() for t in tokens)
        assert text == in_html(tokenizer.decode(list(transition.response_token_ids), skip_special_tokens=False))
        assert {t.get_attribute("class") for t in tokens} == {"tok trained" if trained_on else "tok masked"}
        assert transition.response_logprobs is not None  # the agent asks for logprobs
        logprobs = [float(t.get_attribute("data-logprob")) for t in tokens]
        assert logprobs == pytest.approx(list(transition.response_logprobs))
        prompt = section.query_selector("pre.prompt").text_content()
        assert prompt == in_html(tokenizer.decode(list(transition.prompt_token_ids), skip_special_tokens=False))
        assert ("Plan: 2+3" if transition is planner else "Answer 2+3") in prompt
    shown = page.query_selector(f"#transition-{writer.index} .advantage").inner_text()
    assert float(shown) == pytest.approx(record.advantages[writer.index], abs=1e-4)
    # a group of two: +-(d / 2) / (std + eps) with std = |d| / sqrt(2), i.e. +-1/sqrt(2) unless d is tiny
    group = [trained[r.rollout_id].reward for r in assembled(run).values()
             if r.task_id == "q0" and r.rollout_id in trained and trained[r.rollout_id].step == record.step]
    assert len(group) == 2
    spread = abs(group[0] - group[1])
    expected = (spread / 2) / (spread / math.sqrt(2) + GRPO_EPSILON) if spread else 0.0
    assert abs(record.advantages[writer.index]) == pytest.approx(expected, abs=1e-5)
    assert "not trained" in page.inner_text(f"#transition-{planner.index}")
    page.evaluate("document.querySelectorAll('details').forEach((d) => { d.open = true; })")
    screenshot(page, "rollout")


def test_rollouts_filters_select_what_the_store_holds(run, page):
    stored = assembled(run)
    page.goto(run.dashboard_url + "/rollouts")
    page.fill("input[name=task]", "q1")
    page.select_option("select[name=kind]", "training")
    page.fill("input[name=step]", "2")
    page.click("button[type=submit]")
    page.wait_for_url("**/rollouts?*")
    shown = [row.get_attribute("data-rollout") for row in page.query_selector_all("#rollouts tbody tr[data-rollout]")]
    assert sorted(shown) == sorted(r for r, v in stored.items() if v.task_id == "q1" and r.startswith("s1-"))
    screenshot(page, "rollouts")
    page.goto(run.dashboard_url + "/rollouts?kind=validation")
    shown = {row.get_attribute("data-rollout") for row in page.query_selector_all("#rollouts tbody tr[data-rollout]")}
    assert shown == {r for r in stored if r.startswith("v")} and shown
    page.goto(run.dashboard_url + "/rollouts?sort=reward_desc&reward_min=0.7&kind=training")
    cells = [float(c.inner_text()) for c in page.query_selector_all("#rollouts tbody td.reward")]
    assert cells == sorted(cells, reverse=True) and all(c >= 0.7 for c in cells)
    trained = trained_rewards.load(run.store)
    assert len(cells) == sum(1 for t in trained.values() if t.reward >= 0.7)
    page.goto(run.dashboard_url + "/rollouts?agent=critic")
    assert page.query_selector("#rollouts tbody tr[data-rollout]") is None


def test_validation_and_compare_pages(run, page):
    rows = {r["step"]: r for r in run.metrics_rows()}
    page.goto(run.dashboard_url + "/validation")
    round_row = page.query_selector("#validation tr[data-step='2']")
    # the cell shows 4 significant digits of the round's mean (dashboard.app.format_number)
    assert round_row.query_selector(".val-reward").inner_text() == format_number(rows[2][keys.VAL_REWARD], 4)
    screenshot(page, "validation")
    page.goto(run.dashboard_url + "/compare?task=q0&a=1&b=2")
    sides = page.query_selector_all("section.side")
    assert [s.get_attribute("data-step") for s in sides] == ["1", "2"]
    for side, prefix in zip(sides, ("s0-q0-", "s1-q0-"), strict=True):
        ids = [a.get_attribute("data-rollout") for a in side.query_selector_all(".compare-rollout")]
        assert len(ids) == 2 and all(i.startswith(prefix) for i in ids)
    screenshot(page, "compare")


def test_a_new_step_appears_on_the_open_run_page_without_a_reload(run, page):
    """Last in the module: it lets step 3 happen."""
    before = len(run.metrics_rows())
    page.goto(run.dashboard_url + "/run")
    page.wait_for_selector("#steps tbody tr")
    page.evaluate("window.stillTheSamePage = true")
    assert len(chart_points(page, "chart-reward", "reward mean")) == before
    run.open_gate()
    page.wait_for_function(
        f"Chart.getChart('chart-reward').data.datasets[0].data.length > {before}", timeout=240_000)
    assert page.evaluate("window.stillTheSamePage") is True
    rows = run.wait_steps(before + 1, timeout_s=60)
    assert chart_points(page, "chart-reward", "reward mean")[before] == pytest.approx(rows[before][keys.REWARD_MEAN])
    assert page.query_selector(f"#steps tr[data-step='{before + 1}']") is not None
