"""bench/learning.py's report: the mean and spread over seeds, the arms compared run by run, the
plot, and each task's section of ``docs/results.md`` (written between the markers, the rest of the
file left alone).

Run on its own, it pools the runs of several ``bench/learning.py`` output folders trained from the
same warm starts (say, a first set of repeats and more of them later) and prints each arm's mean
curve and the comparisons run by run over all of them::

    python bench/learning_report.py runs/rqa-a runs/rqa-b --task retrieval_qa

Kept apart from the runs themselves (``learning.py``) so the bookkeeping can be read and tested on
results made up by hand. The statistics are the standard library's; the t interval is computed
here (no SciPy in the environment).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import statistics
import sys
from pathlib import Path

BEGIN, END = "<!-- bench/learning.py: begin -->", "<!-- bench/learning.py: end -->"


def student_t_quantile(probability: float, degrees: int) -> float:
    """The ``probability`` quantile (above 0.5) of Student's t with ``degrees`` degrees of freedom:
    its density integrated from 0 by Simpson's rule, the bound found by bisection. Accurate to
    about 1e-4, which is all an interval printed to three decimals needs."""
    scale = math.exp(math.lgamma((degrees + 1) / 2) - math.lgamma(degrees / 2)) / math.sqrt(degrees * math.pi)

    def density(x: float) -> float:
        return scale * (1 + x * x / degrees) ** (-(degrees + 1) / 2)

    def mass_to(bound: float, slices: int = 2000) -> float:  # the mass between 0 and bound
        width = bound / slices
        odd = sum(density((2 * i - 1) * width) for i in range(1, slices // 2 + 1))
        even = sum(density(2 * i * width) for i in range(1, slices // 2))
        return width / 3 * (density(0) + 4 * odd + 2 * even + density(bound))

    low, high = 0.0, 1000.0
    for _ in range(50):
        middle = (low + high) / 2
        low, high = (middle, high) if 0.5 + mass_to(middle) < probability else (low, middle)
    return (low + high) / 2


def mean_interval(differences: list[float], confidence: float = 0.95) -> tuple[float, float]:
    """The t interval of the mean of paired differences (two or more): where the true mean
    difference lies at ``confidence``, if the pairs are independent draws."""
    mean = statistics.fmean(differences)
    half = (student_t_quantile((1 + confidence) / 2, len(differences) - 1)
            * statistics.stdev(differences) / math.sqrt(len(differences)))
    return mean - half, mean + half


def over_repeats(runs: list[dict]) -> dict:
    """One arm's result on one seed: the mean over its repeats of accuracy at each step, time and
    accuracy by kind, and the repeats themselves (``runs``); a single run is its own mean."""
    first = runs[0]
    steps = sorted(set.intersection(*(set(run["accuracy"]) for run in runs)), key=int)
    kinds = list(first.get("by_kind", {}))
    return {**first,
            "accuracy": {step: statistics.fmean(run["accuracy"][step] for run in runs) for step in steps},
            "seconds": statistics.fmean(run["seconds"] for run in runs),
            "by_kind": {kind: statistics.fmean(run.get("by_kind", {}).get(kind, 0.0) for run in runs)
                        for kind in kinds},
            "runs": runs}


def final_accuracies(arm_result: dict) -> list[float]:
    """The last held-out accuracy of each repeat of one arm on one seed."""
    runs = arm_result.get("runs") or [arm_result]
    return [float(list(run["accuracy"].values())[-1]) for run in runs]


def interval_text(differences: list[float]) -> str:
    """``[-0.044, +0.086]``, or ``-`` for a single pair."""
    if len(differences) < 2:
        return "-"
    low, high = mean_interval(differences)
    return f"[{low:+.3f}, {high:+.3f}]"


def sign_test(ahead: int, behind: int) -> float:
    """Two-sided exact sign test of ``ahead`` against ``behind`` (ties left out): the chance of a
    split at least this uneven if either arm were as likely to come out ahead."""
    n = ahead + behind
    if n == 0:
        return 1.0
    tail = sum(math.comb(n, i) for i in range(min(ahead, behind) + 1)) / 2 ** n
    return min(1.0, 2 * tail)


def paired_rows(per_seed: dict) -> list[str]:
    """Markdown rows comparing each arm with ``sft`` and with ``grpo`` over the pairs of runs from
    one warm start (repeat k of one arm with repeat k of the other): ahead / level / behind, the
    mean difference of final accuracy with its 95 % t interval, and the sign test's p (none with
    one seed and one repeat). An interval that holds 0 means the runs cannot tell the arms apart."""
    results = list(per_seed.values())
    arms = [arm for arm in (results[0] if results else {}) if arm != "warm" and all(arm in r for r in results)]
    pairs_of = {}
    for baseline in ("sft", "grpo"):
        for arm in arms:
            if baseline in arms and arm != baseline and not (baseline == "grpo" and arm == "sft"):
                pairs_of[(arm, baseline)] = [
                    (a, b) for result in results
                    for a, b in zip(final_accuracies(result[arm]), final_accuracies(result[baseline]), strict=False)]
    if not pairs_of or max(len(pairs) for pairs in pairs_of.values()) < 2:
        return []
    lines = ["Each arm against `sft` and `grpo`, run by run (repeat k of both arms from one warm start), by the "
             "final held-out accuracy:", "",
             "| arm | against | pairs | ahead / level / behind | mean difference | 95 % interval | sign test p |",
             "|---|---|---|---|---|---|---|"]
    for (arm, baseline), pairs in pairs_of.items():
        differences = [a - b for a, b in pairs]
        ahead = sum(d > 1e-9 for d in differences)
        behind = sum(d < -1e-9 for d in differences)
        lines.append(f"| {arm} | {baseline} | {len(pairs)} | {ahead} / {len(pairs) - ahead - behind} / {behind} | "
                     f"{statistics.fmean(differences):+.3f} | {interval_text(differences)} | "
                     f"{sign_test(ahead, behind):.2f} |")
    return [*lines, ""]


def kinds_text(by_kind: dict[str, float]) -> str:
    """``; by kind: a 0.50, b 1.00`` (nothing when the tasks have no kind)."""
    return "; by kind: " + ", ".join(f"{k} {v:.2f}" for k, v in by_kind.items()) if by_kind else ""


def kind_table(per_seed: dict) -> list[str]:
    """Markdown rows: final held-out accuracy by task kind, each arm's mean over seeds (none without kinds)."""
    results = list(per_seed.values())
    if not results:
        return []
    arms = [arm for arm in results[0] if all(result.get(arm, {}).get("by_kind") for result in results)]
    if not arms:
        return []
    kinds = list(results[0][arms[0]]["by_kind"])
    lines = ["Held-out accuracy by kind of task at the last step (mean over seeds):", "",
             "| kind | " + " | ".join(arms) + " |", "|---|" + "---|" * len(arms)]
    for kind in kinds:
        cells = [statistics.fmean(result[arm]["by_kind"].get(kind, 0.0) for result in results) for arm in arms]
        lines.append(f"| {kind} | " + " | ".join(f"{c:.2f}" for c in cells) + " |")
    return [*lines, ""]


def summarise(per_seed: dict[int, dict]) -> dict[str, dict]:
    """Per arm: mean and spread (population std) of the accuracy at each step over seeds."""
    summary: dict[str, dict] = {}
    arms = {arm for result in per_seed.values() for arm in result}
    for arm in sorted(arms):
        curves = [result[arm]["accuracy"] for result in per_seed.values() if arm in result]
        steps = sorted(set.intersection(*(set(map(int, c)) for c in curves)))
        by_step = {s: [float(c[s] if s in c else c[str(s)]) for c in curves] for s in steps}
        summary[arm] = {
            "steps": steps,
            "mean": [statistics.fmean(by_step[s]) for s in steps],
            "std": [statistics.pstdev(by_step[s]) for s in steps],
            "final": by_step[steps[-1]],
            "seconds": [result[arm]["seconds"] for result in per_seed.values() if arm in result],
            "rollouts": [result[arm].get("rollouts", 0) for result in per_seed.values() if arm in result],
        }
    return summary


def plot(task_name: str, summary: dict[str, dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for arm, data in summary.items():
        steps = data["steps"] if arm != "warm" else [0, max((max(d["steps"]) for d in summary.values()), default=0)]
        mean = data["mean"] if arm != "warm" else data["mean"] * 2
        std = data["std"] if arm != "warm" else data["std"] * 2
        ax.plot(steps, mean, marker="o" if arm != "warm" else None, linestyle="--" if arm == "warm" else "-",
                label=arm)
        ax.fill_between(steps, [m - s for m, s in zip(mean, std, strict=True)],
                        [m + s for m, s in zip(mean, std, strict=True)], alpha=0.15)
    ax.set_xlabel("training step (0 = warm start)")
    ax.set_ylabel("held-out accuracy (greedy)")
    ax.set_ylim(0, 1)
    ax.set_title(task_name)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def task_markers(task_name: str) -> tuple[str, str]:
    """The markers around one task's section inside the block (a run rewrites only its tasks)."""
    return f"<!-- bench/learning.py {task_name}: begin -->", f"<!-- bench/learning.py {task_name}: end -->"


def task_section(task_name: str, data: dict, args: argparse.Namespace, command: str) -> str:
    """One task's markdown: its command, machine and settings, plot and table, between its markers."""
    summary = data["summary"]
    warm = summary["warm"]["mean"][0]
    warm_sft = next((seed["warm"].get("sft", "") for seed in data.get("seeds", {}).values()), "")
    begin, end = task_markers(task_name)
    lines = [begin, f"### {task_name}", "", f"`{command}`", "",
             f"Measured {datetime.date.today().isoformat()} on {platform.machine()} with {os.cpu_count()} CPU cores "
             f"({args.machine_note}); device {args.device}, preset {args.preset}, seeds {args.seeds}, "
             f"{args.steps} steps x {args.tasks_per_step} tasks x {args.group_size} rollouts per arm. Held-out "
             "accuracy is greedy, over the validation file (failed rollouts count as wrong); mean ± spread "
             "(population std) over seeds.", "", *([f"Warm start: {warm_sft}.", ""] if warm_sft else []),
             f"![{task_name}](results/learning-{task_name}.png)", "",
             "| arm | accuracy after warm start | final accuracy | change | per seed (final) | rollouts "
             "| wall time per seed |",
             "|---|---|---|---|---|---|---|"]
    for arm, arm_data in summary.items():
        final_mean, final_std = arm_data["mean"][-1], arm_data["std"][-1]
        per_seed = " ".join(f"{v:.2f}" for v in arm_data["final"])
        seconds = statistics.fmean(arm_data["seconds"]) if arm_data["seconds"] else 0.0
        rollouts = arm_data["rollouts"][0] if arm_data["rollouts"] else 0
        lines.append(f"| {arm} | {warm:.3f} | {final_mean:.3f} ± {final_std:.3f} | {final_mean - warm:+.3f} | "
                     f"{per_seed} | {rollouts} | {seconds:.0f} s |")
    lines += ["", *kind_table(data.get("seeds", {})), *paired_rows(data.get("seeds", {})), end]
    return "\n".join(lines)


def table(results: dict, args: argparse.Namespace, command: str) -> dict[str, str]:
    """Each measured task's section (``task_section``), by task name."""
    return {task_name: task_section(task_name, data, args, command) for task_name, data in results["tasks"].items()}


def write_results(path: Path, sections: dict[str, str]) -> None:
    """Put each task's section into the block between the markers of ``path``: a task measured before
    is replaced where it stands, a new one goes at the block's end; other tasks' sections and the rest
    of the file stay. The block is appended when the file has none."""
    text = path.read_text(encoding="utf-8") if path.exists() else "# Results\n"
    if not (BEGIN in text and END in text):
        text = text.rstrip("\n") + f"\n\n{BEGIN}\n\n{END}\n"
    head, rest = text.split(BEGIN, 1)
    block, tail = rest.split(END, 1)
    for task_name, section in sections.items():
        begin, end = task_markers(task_name)
        if begin in block and end in block:
            before, after = block.split(begin, 1)
            block = before + section + after.split(end, 1)[1]
        else:
            block = block.rstrip("\n") + "\n\n" + section + "\n\n"
    path.write_text(head + BEGIN + block + END + tail, encoding="utf-8")


def pooled_seeds(results: list[tuple[str, dict]], task_name: str) -> dict[str, dict]:
    """One task's runs from several ``results.json`` (name, content), pooled per seed and arm
    (``over_repeats``). Runs pool only from the same warm start (a seed whose warm-start accuracy
    differs between two files is refused, naming both) and, for one arm, only when they trained
    alike (``check_same_training``)."""
    warm_of: dict[str, tuple[str, dict]] = {}
    trained_by: dict[tuple, tuple[str, dict]] = {}
    runs_of: dict[str, dict[str, list[dict]]] = {}
    for name, content in results:
        for seed, arms in content.get("tasks", {}).get(task_name, {}).get("seeds", {}).items():
            first_name, first_warm = warm_of.setdefault(seed, (name, arms["warm"]))
            warm, earlier = (float(next(iter(w["accuracy"].values()))) for w in (arms["warm"], first_warm))
            if abs(earlier - warm) > 1e-9:
                raise ValueError(f"{task_name} seed {seed}: the warm start differs between {first_name} "
                                 f"({earlier:.3f}) and {name} ({warm:.3f}); only runs from one warm start pool")
            for arm, arm_result in arms.items():
                if arm != "warm":
                    for run in arm_result.get("runs") or [arm_result]:
                        check_same_training(trained_by, (task_name, seed, arm), name, run)
                        runs_of.setdefault(seed, {}).setdefault(arm, []).append(run)
    return {seed: {"warm": warm_of[seed][1], **{arm: over_repeats(runs) for arm, runs in runs_of.get(seed, {}).items()}}
            for seed in warm_of}


def check_same_training(trained_by: dict, key: tuple, name: str, run: dict) -> None:
    """Refuse to pool runs of one arm that trained differently (an arm's meaning can change between
    releases: ``grpo_graded``'s reward did on 2026-12-05). Runs written before ``training`` was
    recorded pool with anything."""
    training = run.get("training")
    if training is None:
        return
    first_name, first = trained_by.setdefault(key, (name, training))
    if first != training:
        changed = sorted(field for field in {*first, *training} if first.get(field) != training.get(field))
        raise ValueError(f"{key[0]} seed {key[1]} arm {key[2]}: {first_name} and {name} trained it differently "
                         f"({', '.join(changed)}); only like runs pool")


def curve_rows(per_seed: dict) -> list[str]:
    """Markdown rows: each arm's held-out accuracy at each validation, the mean over all its runs
    (every seed's, each run once), and the mean of its validations after the warm start."""
    runs_of: dict[str, list[dict]] = {}
    for arms in per_seed.values():
        for arm, arm_result in arms.items():
            if arm != "warm":
                runs_of.setdefault(arm, []).extend(arm_result["runs"])
    if not runs_of:
        return []
    pooled = {arm: over_repeats(runs)["accuracy"] for arm, runs in runs_of.items()}  # mean over every run
    steps = sorted(set.intersection(*(set(curve) for curve in pooled.values())), key=int)
    later = [step for step in steps if int(step) > 0]
    lines = ["| arm | runs | " + " | ".join(f"step {step}" for step in steps) + " | mean after the warm start |",
             "|---|---|" + "---|" * (len(steps) + 1)]
    for arm, curve in pooled.items():
        over_run = statistics.fmean(curve[step] for step in later) if later else curve[steps[-1]]
        lines.append(f"| {arm} | {len(runs_of[arm])} | " + " | ".join(f"{curve[step]:.3f}" for step in steps)
                     + f" | {over_run:.3f} |")
    return [*lines, ""]


def read_results(path: str) -> tuple[str, dict]:
    """A ``results.json``, given as the file or the output folder that holds it."""
    file = Path(path) / "results.json" if Path(path).is_dir() else Path(path)
    if not file.is_file():
        raise SystemExit(f"{path}: no results.json there (a bench/learning.py --output-dir, or the file)")
    return str(path), json.loads(file.read_text(encoding="utf-8"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Pool bench/learning.py runs from one set of warm starts and "
                                                 "compare the arms over all of them.")
    parser.add_argument("results", nargs="+", help="output folders of bench/learning.py, or their results.json")
    parser.add_argument("--task", action="append", help="a task to report (default: every task in the files)")
    args = parser.parse_args(argv)
    results = [read_results(path) for path in args.results]
    tasks = args.task or sorted({task for _, content in results for task in content.get("tasks", {})})
    for task_name in tasks:
        try:
            per_seed = pooled_seeds(results, task_name)
        except ValueError as error:
            raise SystemExit(str(error)) from None
        if not per_seed:
            print(f"{task_name}: no runs in these files\n")
            continue
        print(f"### {task_name} (seeds {', '.join(sorted(per_seed))})\n")
        print("\n".join([*curve_rows(per_seed), *paired_rows(per_seed)]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
