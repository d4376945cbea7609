// The run page: draws the run's charts with Chart.js and refreshes them without a reload.
// Data comes from /api/run (pages.run_data): first embedded in the page, then polled every
// refresh_s seconds; charts are updated in place when the run changed.
"use strict";

const COLORS = ["#2563eb", "#dc2626", "#16a34a", "#9333ea", "#ea580c", "#0891b2", "#4b5563", "#ca8a04"];
const charts = {};
let shown = null;
let agentsStep = null;
let timer = null;
let generation = 0;  // bumped when the agents' step changes: only the newest polling chain goes on

function lineChart(id, datasets) {
  const chart = new Chart(document.getElementById(id), {
    type: "line",
    data: { labels: [], datasets: datasets.map((d, n) => ({ borderColor: COLORS[n], backgroundColor: COLORS[n],
      spanGaps: true, pointRadius: 3, tension: 0, ...d })) },
    options: { animation: false, responsive: true, maintainAspectRatio: false,
      scales: { x: { title: { display: true, text: "step" } }, y: { ticks: { callback: (value) => num(value) } } },
      plugins: { legend: { position: "bottom", labels: { filter: (item, data) => data.datasets[item.datasetIndex].legend !== false } } } },
  });
  charts[id] = chart;
  return chart;
}

function makeCharts() {
  lineChart("chart-reward", [
    { label: "reward mean", key: "reward_mean" },
    { label: "mean + std", key: "band_high", borderColor: "rgba(37,99,235,0.25)", pointRadius: 0, fill: false,
      legend: false },
    { label: "mean ± std", key: "band_low", borderColor: "rgba(37,99,235,0.25)", pointRadius: 0,
      backgroundColor: "rgba(37,99,235,0.12)", fill: "-1" },
    { label: "validation reward", key: "val_reward", borderDash: [6, 4], pointStyle: "rect" },
  ]);
  lineChart("chart-loss", [{ label: "loss", key: "loss" }, { label: "pg_loss", key: "pg_loss" }]);
  lineChart("chart-kl", [{ label: "kl_loss", key: "kl_loss" }, { label: "ppo_kl", key: "ppo_kl" }]);
  lineChart("chart-clip", [{ label: "pg_clipfrac", key: "pg_clipfrac" }]);
  lineChart("chart-speed", [{ label: "rollouts/s", key: "rollouts_per_s" }]);
  charts["chart-left-out"] = new Chart(document.getElementById("chart-left-out"), {
    type: "bar", data: { labels: [], datasets: [] },
    options: { animation: false, responsive: true, maintainAspectRatio: false,
      scales: { x: { stacked: true, title: { display: true, text: "step" } }, y: { stacked: true, beginAtZero: true } },
      plugins: { legend: { position: "bottom" } } },
  });
}

function series(data) {
  // the metrics' own series, plus the band of mean ± std: the store's spread where it has the step,
  // else metrics.jsonl's reward_std
  const out = { ...data.series };
  const spread = new Map(data.spread.map((s) => [s.step, s]));
  out.band_high = data.steps.map((step, n) => band(spread.get(step), data.series, n, +1));
  out.band_low = data.steps.map((step, n) => band(spread.get(step), data.series, n, -1));
  return out;
}

function band(stored, metrics, n, sign) {
  if (stored) return stored.mean + sign * stored.std;
  const mean = metrics.reward_mean[n], std = metrics.reward_std[n];
  return mean == null || std == null ? null : mean + sign * std;
}

function draw(data) {
  const values = series(data);
  for (const [id, chart] of Object.entries(charts)) {
    chart.data.labels = data.steps;
    if (id === "chart-left-out") {
      chart.data.datasets = Object.entries(data.left_out).map(([reason, counts], n) =>
        ({ label: reason, data: counts, backgroundColor: COLORS[n % COLORS.length] }));
    } else {
      for (const dataset of chart.data.datasets) dataset.data = values[dataset.key] || [];
    }
    chart.update();
  }
  drawProblems(data.problems);
  drawAgents(data);
  drawSteps(data);
  document.getElementById("updated").textContent = `Last step: ${data.steps.length ? data.steps[data.steps.length - 1] : "none yet"}.`;
}

function cell(row, text, className) {
  const td = row.insertCell();
  td.textContent = text;
  if (className) td.className = className;
  return td;
}

function num(value, digits = 3) {
  if (value == null) return "-";
  return Number.isInteger(value) ? String(value) : String(Number(Number(value).toPrecision(digits)));
}

function drawProblems(problems) {
  const box = document.getElementById("problems");
  box.replaceChildren(...problems.map((text) => {
    const p = document.createElement("p");
    p.className = "problem";
    p.textContent = text;
    return p;
  }));
}

function drawAgents(data) {
  const select = document.getElementById("agents-step");
  const steps = data.agent_steps || [];
  select.replaceChildren(...steps.map((step) => new Option(String(step), String(step), false, step === data.agents_step)));
  const body = document.querySelector("#agents tbody");
  body.replaceChildren();
  for (const a of data.agents) {
    const row = body.insertRow();
    row.dataset.agent = a.agent;
    cell(row, a.agent); cell(row, a.calls); cell(row, a.trained_calls); cell(row, a.rollouts); cell(row, num(a.mean_reward));
  }
}

function drawSteps(data) {
  const spread = new Map(data.spread.map((s) => [s.step, s]));
  const body = document.querySelector("#steps tbody");
  body.replaceChildren();
  data.steps.forEach((step, n) => {
    const s = spread.get(step);
    const row = body.insertRow(0);
    row.dataset.step = step;
    cell(row, step);
    cell(row, num(data.series.reward_mean[n]));
    cell(row, num(s ? s.std : data.series.reward_std[n]));
    cell(row, num(s && s.low));
    cell(row, num(s && s.high));
    cell(row, num(data.series.val_reward[n]));
    cell(row, num(data.series.loss[n]));
    const left = Object.entries(data.left_out).filter(([, counts]) => counts[n]).map(([r, counts]) => `${r} ${counts[n]}`);
    cell(row, left.join(", ") || "none");
    const link = document.createElement("a");
    link.href = `/rollouts?step=${step}&kind=training`;
    link.textContent = "rollouts";
    row.insertCell().append(link);
  });
}

async function refresh(gen) {
  try {
    const query = agentsStep == null ? "" : `?agents_step=${agentsStep}`;
    const response = await fetch(`/api/run${query}`, { cache: "no-store" });
    if (response.ok) {
      const data = await response.json();
      const version = JSON.stringify([data.version, data.agents_step]);
      if (version !== shown) {
        shown = version;
        draw(data);
      }
    }
  } finally {
    if (gen === generation) timer = setTimeout(() => refresh(gen), settings.refresh_s * 1000);
  }
}

const settings = JSON.parse(document.getElementById("run-settings").textContent);
makeCharts();
const first = JSON.parse(document.getElementById("run-data").textContent);
shown = JSON.stringify([first.version, first.agents_step]);
draw(first);
document.getElementById("agents-step").addEventListener("change", (event) => {
  agentsStep = Number(event.target.value);
  shown = null;
  generation += 1;
  clearTimeout(timer);
  refresh(generation);
});
timer = setTimeout(() => refresh(generation), settings.refresh_s * 1000);
