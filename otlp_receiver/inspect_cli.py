"""``spanrl inspect``: read the span store (``rollouts``, ``rollout ID``, ``transitions``, late
``feedback``: ``feedback_cli.py``) and a training run's metrics (``metrics RUN``).

Registered by ``core/cli.py``. Human tables by default, ``--json`` for machines (keys are
plain words). Safe while a receiver writes the same store (SQLite WAL). Besides what the
receiver assembled, it shows what ``spanrl train`` trained each rollout with (its reward,
whatever the source: a reward function, the agent's reward events, AIR; and each transition's
return), which the trainer records in the same store (``trained_rewards``), and, with ``reward: judge``,
the judge's ``gen_ai.evaluation.result`` (score and explanation, ``judge_evaluations``). ``metrics`` reads a
run's ``metrics.jsonl`` through ``spanrl.schema.metrics.read_metrics``, so a run of an older
version (flat keys) shows as a new one.
"""

from __future__ import annotations

import argparse
import json
import os


def add_parser(subparsers) -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--db",
        default=None,
        help="span store path (env OTEL_SPANRL_RECEIVER_DB; default spanrl.db)",
    )
    common.add_argument("--json", action="store_true", help="print JSON instead of tables")
    parser = subparsers.add_parser("inspect", help="read the span store: rollouts, span trees, transitions")
    what = parser.add_subparsers(dest="what", metavar="WHAT", required=True)
    what.add_parser("rollouts", parents=[common], help="every rollout, open or assembled").set_defaults(
        func=show_rollouts
    )
    one = what.add_parser("rollout", parents=[common], help="one rollout: span tree, rewards, transitions")
    one.add_argument("rollout_id", metavar="ID")
    one.set_defaults(func=show_rollout)
    transitions = what.add_parser("transitions", parents=[common], help="transitions of assembled rollouts")
    transitions.add_argument("--since", type=int, default=0, help="only rollouts after this cursor")
    transitions.add_argument("--rollout", default=None, help="only this rollout")
    transitions.set_defaults(func=show_transitions)
    feedback = what.add_parser("feedback", parents=[common], help="late feedback: counters, pending and joined")
    feedback.add_argument("--state", choices=("pending", "joined", "duplicate"), default=None,
                          help="only feedback in this state")
    feedback.set_defaults(func=show_feedback)
    metrics = what.add_parser("metrics", help="a training run's metrics per step (its metrics.jsonl)")
    metrics.add_argument("run", metavar="RUN", help="the run's output_dir, or its metrics.jsonl")
    metrics.add_argument("--json", action="store_true", help="print every row as JSON (namespaced keys)")
    metrics.set_defaults(func=show_metrics)
    return parser


def _store_path(args) -> str:
    from spanrl.errors import UserError

    path = args.db or os.environ.get("OTEL_SPANRL_RECEIVER_DB") or "spanrl.db"
    if not os.path.exists(path):
        raise UserError(f"no span store at {path} (use --db PATH)")
    return path


def _open(args):
    from spanrl.otlp_receiver.store import SpanStore

    return SpanStore(_store_path(args))


def _trained(args) -> dict:
    """What the trainer trained each rollout with, by rollout id (empty before any training)."""
    from spanrl.otlp_receiver import trained_rewards

    return trained_rewards.load(_store_path(args))


def _judged(args, rollout_id: str):
    """The reward judge's evaluation of a rollout (a ``gen_ai.evaluation.result`` event), or None."""
    from spanrl.otlp_receiver import judge_evaluations

    return judge_evaluations.load(_store_path(args)).get(rollout_id)


def _trained_to_dict(trained) -> dict | None:
    if trained is None:
        return None
    return {"step": trained.step, "reward": trained.reward, "reward_source": trained.reward_source,
            "used": trained.used, "returns": {str(k): v for k, v in sorted(trained.returns.items())}}


def _reward_text(rollout, trained) -> tuple[str, str]:
    """``(reward, where it came from)`` for the tables: the trained one when there is one."""
    if trained is not None:
        used = "" if trained.used else ", left out of the update"
        return f"{trained.reward:g}", f"{trained.reward_source} (step {trained.step}{used})"
    if rollout is not None and rollout.total_reward is not None:
        sources = ", ".join(sorted({r.source for r in rollout.rewards}))
        return f"{rollout.total_reward:g}", f"events: {sources} (not trained)"
    return "", "none yet" if rollout is None else "no reward event (not trained)"


def _table(headers: list[str], rows: list[list]) -> str:
    cells = [[("" if c is None else str(c)) for c in row] for row in rows]
    widths = [max([len(h)] + [len(r[i]) for r in cells]) for i, h in enumerate(headers)]
    line = lambda values: "  ".join(v.ljust(w) for v, w in zip(values, widths, strict=False)).rstrip()  # noqa: E731
    return "\n".join([line(headers), line(["-" * w for w in widths])] + [line(r) for r in cells])


def _ids(ids, limit: int = 12) -> str:
    ids = list(ids)
    text = " ".join(str(i) for i in ids[:limit])
    return f"[{text}{' …' if len(ids) > limit else ''}] ({len(ids)})"


def show_feedback(args) -> int:
    from spanrl.otlp_receiver.feedback_cli import show_feedback as show

    return show(args, _store_path(args), _table)


def show_rollouts(args) -> int:
    from spanrl.schema.rollouts import rollout_to_dict

    with _open(args) as store:
        summaries = store.rollout_summaries()
    trained = _trained(args)
    if args.json:
        print(json.dumps([
            {
                "rollout_id": s.rollout_id, "task_id": s.task_id, "attempt": s.attempt,
                "state": s.state, "span_count": s.span_count, "late_spans": s.late_spans,
                "assembled": None if s.assembled is None else rollout_to_dict(s.assembled),
                "trained": _trained_to_dict(trained.get(s.rollout_id)),
            }
            for s in summaries
        ], indent=2))
        return 0
    rows = []
    for s in summaries:
        a = s.assembled
        reward, source = _reward_text(a, trained.get(s.rollout_id))
        rows.append([
            s.rollout_id, s.task_id, s.attempt, s.state, s.span_count,
            a and a.status, a and a.end_reason, a and len(a.transitions),
            reward, source, a and len(a.problems), a and a.sequence,
        ])
    print(_table(
        ["rollout", "task", "attempt", "state", "spans", "status", "end", "transitions", "reward",
         "reward from", "problems", "seq"], rows,
    ))
    return 0


def show_rollout(args) -> int:
    from spanrl.otlp_receiver.span_tree import SpanTree, records_from_bodies
    from spanrl.schema.rollouts import rollout_to_dict

    with _open(args) as store:
        spans = store.rollout_spans(args.rollout_id)
        rollout = store.assembled_rollout(args.rollout_id)
    if not spans and rollout is None:
        from spanrl.errors import UserError

        raise UserError(f"no rollout {args.rollout_id!r} in the store {_store_path(args)}; "
                        "`spanrl inspect rollouts` lists them")
    tree = SpanTree(records_from_bodies(s.body for s in spans))
    trained = _trained(args).get(args.rollout_id)
    judged = _judged(args, args.rollout_id)
    if args.json:
        print(json.dumps({
            "rollout_id": args.rollout_id,
            "spans": [
                {
                    "span_id": r.key, "parent_span_id": None if r.parent is None else r.parent.key,
                    "name": r.name, "kind": r.span_kind, "start_ns": r.start_ns, "end_ns": r.end_ns,
                    "error": r.status_error,
                }
                for r in tree.order
            ],
            "assembled": None if rollout is None else rollout_to_dict(rollout),
            "trained": _trained_to_dict(trained),
            "evaluations": [] if judged is None else [judged.as_event()],
        }, indent=2))
        return 0
    calls = {} if rollout is None else {t.span_id: t.index for t in rollout.transitions}
    rewards: dict[str, list[str]] = {}
    for reward in () if rollout is None else rollout.rewards:
        rewards.setdefault(reward.span_id, []).append(f"{reward.name}={reward.value:g}")
    print(f"rollout {args.rollout_id}: {len(spans)} spans")
    for record in tree.order:
        marks = []
        if record.key in calls:
            marks.append(f"transition #{calls[record.key]}")
        if record.key in rewards:
            marks.append("reward " + ", ".join(rewards[record.key]))
        if record.status_error:
            marks.append("ERROR")
        duration_ms = (record.end_ns - record.start_ns) / 1e6
        kind = f" [{record.span_kind}]" if record.span_kind else ""
        extra = f"  <- {'; '.join(marks)}" if marks else ""
        print(f"{'  ' * tree.depth(record)}{record.name}{kind} {duration_ms:.1f} ms{extra}")
    if rollout is None:
        print("\nnot assembled yet")
        return 0
    reward, source = _reward_text(rollout, trained)
    print(
        f"\nstatus {rollout.status}{' (' + rollout.error + ')' if rollout.error else ''},"
        f" ended by {rollout.end_reason}, reward {reward or 'none'} ({source}), sequence {rollout.sequence}"
    )
    if rollout.variables:
        print("variables: " + ", ".join(f"{k}={v!r}" for k, v in rollout.variables.items()))
    if rollout.counters:  # the receiver's reward and token-id checks (docs/trust.md)
        print("counted: " + ", ".join(f"{k} {v}" for k, v in rollout.counters.items()))
    if judged is not None:  # the reward judge's score, recorded by the trainer (docs/judge.md)
        print(f"{judged.as_event()['name']} {judged.name} (judge {judged.judge_model}, group of "
              f"{judged.group_size}): score {judged.score:g}, reward {judged.reward:g}: {judged.explanation}")
    print()
    _print_transitions(rollout.transitions, {} if trained is None else {rollout.rollout_id: trained})
    for problem in rollout.problems:
        print(f"problem: {problem}")
    _print_late_feedback(_store_path(args), rollout.rollout_id)
    return 0


def _print_late_feedback(path: str, rollout_id: str) -> None:
    """The feedback that arrived after the rollout was assembled (``spanrl inspect feedback``)."""
    from spanrl.otlp_receiver.feedback_store import FeedbackStore

    with FeedbackStore(path) as book:
        joined = book.feedback_of(rollout_id)
    for stored in joined:
        f = stored.feedback
        judged = f"call {stored.call_span_id}" if stored.call_span_id else "the rollout"
        print(f"late feedback: {f.name}={f.value:g} on {judged} ({f.source}{', ' + f.comment if f.comment else ''})")


def _trained_return(transition, trained: dict) -> float | None:
    record = trained.get(transition.rollout_id)
    return None if record is None else record.returns.get(transition.index)


def _print_transitions(transitions, trained: dict) -> None:
    """``reward``: the reward events at this call; ``return``: what the trainer trained the call
    with (``trained at``: its step), else the receiver's credit-assigned return."""
    rows = []
    for t in transitions:
        trained_return = _trained_return(t, trained)
        shown = t.return_ if trained_return is None else trained_return
        step = "" if trained_return is None else trained[t.rollout_id].step
        rows.append([t.rollout_id, t.index, t.span_id, t.agent_name, _ids(t.prompt_token_ids),
                     _ids(t.response_token_ids), t.policy_version, f"{t.reward:g}", f"{shown:g}", step,
                     "yes" if t.retokenized else ""])
    print(_table(["rollout", "#", "span", "agent", "prompt ids", "response ids", "version", "reward",
                  "return", "trained at", "retok"], rows))


def show_transitions(args) -> int:
    from spanrl.schema.rollouts import transition_to_dict

    with _open(args) as store:
        rollouts, _ = store.completed_rollouts(since=args.since)
    transitions = [
        t for r in rollouts if args.rollout is None or r.rollout_id == args.rollout for t in r.transitions
    ]
    trained = _trained(args)
    if args.json:
        print(json.dumps([
            {**transition_to_dict(t), "trained_return": _trained_return(t, trained),
             "trained_step": trained[t.rollout_id].step if t.rollout_id in trained else None}
            for t in transitions
        ], indent=2))
    else:
        _print_transitions(transitions, trained)
    return 0


# the columns of `spanrl inspect metrics` (key, header); every key with --json
METRIC_COLUMNS = (("step", "step"), ("rollout/reward_mean", "reward"), ("val/reward", "val_reward"),
                  ("actor/policy_version", "version"), ("rollout/count", "rollouts"), ("rollout/used", "used"),
                  ("actor/transitions", "samples"), ("rollout/groups_without_signal", "flat_groups"),
                  ("actor/loss", "loss"), ("actor/grad_norm", "grad_norm"), ("timing/step_s", "seconds"))


def _cell(value) -> str:
    return f"{value:.4g}" if isinstance(value, float) else ("" if value is None else str(value))


def _metric_cell(row: dict, key: str) -> str:
    """A metrics table cell; task groups whose rollouts all scored the same as ``flat/groups``."""
    if key == "rollout/groups_without_signal":
        flat = row.get(key)
        return "" if flat is None else f"{sum(flat.values())}/{row.get('rollout/groups', 0)}"
    return _cell(row.get(key))


def show_metrics(args) -> int:
    from spanrl.errors import UserError
    from spanrl.schema.metrics import metrics_file, read_metrics

    try:
        rows = read_metrics(args.run)
    except FileNotFoundError as exc:
        raise UserError(f"no metrics at {metrics_file(args.run)} (give a run's output_dir or its "
                        "metrics.jsonl)") from exc
    except json.JSONDecodeError as exc:
        raise UserError(f"{metrics_file(args.run)} is not JSON lines: {exc}") from exc
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    print(_table([header for _, header in METRIC_COLUMNS],
                 [[_metric_cell(row, key) for key, _ in METRIC_COLUMNS] for row in rows]))
    return 0
