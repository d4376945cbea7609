"""AIR (Automatic Intermediate Rewarding): monitoring signals in spans become rewards.

Called by ``assembly.py`` for every span of a rollout. Rules are applied on the receiver, so
any OTLP source benefits. A rule matches spans by OpenInference span kind, status, name and
attributes, and adds a reward to the LLM call that led to the span (the attachment rule of
``assembly.call_for_span``). The rollout's ``spanrl.rollout`` root span never matches (its
status is the rollout's status).

Rules file (JSON or YAML)::

    rules:
      - name: tool_error          # the reward's name
        reward: -0.1
        when:                     # every condition given must hold
          status: ERROR           # ERROR | OK | UNSET (optional)
          span_kind: TOOL         # openinference.span.kind (optional)
          name: "search*"         # span name, shell-style pattern (optional)
          attributes: {k: v}      # exact attribute values (optional)
          ungrounded_numbers: true  # an LLM call whose tool arguments hold a number none of
                                    # its input messages holds (optional; air_grounding.py)

AIR is off unless asked for: ``--air-rules default`` uses ``DEFAULT_RULES`` (any span that
ended with status ERROR -> ``tool_error`` -0.1), ``--air-rules PATH`` a file of your own.
"""

from __future__ import annotations

import fnmatch
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from spanrl.otlp_receiver.air_grounding import ungrounded_numbers
from spanrl.otlp_receiver.span_tree import SpanRecord

STATUSES = ("ERROR", "OK", "UNSET")


class AirRuleError(ValueError):
    """An AIR rules file or rule cannot be used."""


@dataclass(frozen=True)
class AirRule:
    name: str
    reward: float
    status: str | None = None
    span_kind: str | None = None
    name_pattern: str | None = None
    attributes: dict[str, Any] = field(default_factory=dict)
    ungrounded_numbers: bool = False

    def matches(self, span: SpanRecord) -> bool:
        if self.status is not None:
            status = "ERROR" if span.status_error else "UNSET"
            if self.status == "ERROR" and status != "ERROR":
                return False
            if self.status in ("OK", "UNSET") and status == "ERROR":
                return False
        if self.span_kind is not None and span.span_kind != self.span_kind:
            return False
        if self.name_pattern is not None and not fnmatch.fnmatchcase(span.name, self.name_pattern):
            return False
        if not all(span.attributes.get(k) == v for k, v in self.attributes.items()):
            return False
        return not self.ungrounded_numbers or bool(ungrounded_numbers(span.attributes))


DEFAULT_RULES = (AirRule(name="tool_error", reward=-0.1, status="ERROR"),)


def rule_from_dict(data: Any, where: str) -> AirRule:
    if not isinstance(data, dict):
        raise AirRuleError(f"{where}: a rule must be a mapping, got {type(data).__name__}")
    unknown = set(data) - {"name", "reward", "when"}
    if unknown:
        raise AirRuleError(f"{where}: unknown keys {sorted(unknown)} (use name, reward, when)")
    name = data.get("name")
    if not isinstance(name, str) or not name:
        raise AirRuleError(f"{where}: 'name' must be a non-empty string")
    reward = data.get("reward")
    if isinstance(reward, bool) or not isinstance(reward, (int, float)) or not math.isfinite(reward):
        raise AirRuleError(f"{where}: 'reward' must be a finite number, got {reward!r}")
    when = data.get("when") or {}
    if not isinstance(when, dict):
        raise AirRuleError(f"{where}: 'when' must be a mapping")
    unknown = set(when) - {"status", "span_kind", "name", "attributes", "ungrounded_numbers"}
    if unknown:
        raise AirRuleError(f"{where}: unknown conditions {sorted(unknown)}")
    status = when.get("status")
    if status is not None and str(status).upper() not in STATUSES:
        raise AirRuleError(f"{where}: status must be one of {STATUSES}, got {status!r}")
    attributes = when.get("attributes") or {}
    if not isinstance(attributes, dict):
        raise AirRuleError(f"{where}: 'attributes' must be a mapping")
    if not when:
        raise AirRuleError(f"{where}: a rule needs at least one condition under 'when'")
    ungrounded = when.get("ungrounded_numbers", False)
    if not isinstance(ungrounded, bool):
        raise AirRuleError(f"{where}: 'ungrounded_numbers' must be true or false, got {ungrounded!r}")
    return AirRule(
        name=name,
        reward=float(reward),
        status=None if status is None else str(status).upper(),
        span_kind=None if when.get("span_kind") is None else str(when["span_kind"]).upper(),
        name_pattern=when.get("name"),
        attributes=dict(attributes),
        ungrounded_numbers=ungrounded,
    )


def load_rules(source: str | None) -> tuple[AirRule, ...]:
    """``None``/``off`` -> no rules, ``default`` -> DEFAULT_RULES, else a JSON/YAML file."""
    if source is None or source.strip().lower() in ("", "off", "none"):
        return ()
    if source.strip().lower() == "default":
        return DEFAULT_RULES
    path = Path(source)
    try:
        text = path.read_text()
    except OSError as exc:
        raise AirRuleError(f"cannot read AIR rules file {path}: {exc}") from exc
    try:
        if path.suffix.lower() == ".json":
            data = json.loads(text)
        else:
            import yaml

            data = yaml.safe_load(text)
    except Exception as exc:  # json/yaml parse errors have no common base
        raise AirRuleError(f"AIR rules file {path} is not valid {path.suffix or 'YAML'}: {exc}") from exc
    rules = data.get("rules") if isinstance(data, dict) else data
    if not isinstance(rules, list):
        raise AirRuleError(f"AIR rules file {path}: expected a list under 'rules'")
    return tuple(rule_from_dict(rule, f"{path} rule {i}") for i, rule in enumerate(rules))
