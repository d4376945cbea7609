"""``spanrl prompts export``: write out the prompt resources an endpoint serves, to paste back into
the agents' code or to load again with ``--prompts FILE``.

Registered by ``core/cli.py``, which builds ``PromptsExportSettings`` (flags >
``OTEL_SPANRL_PROMPTS_EXPORT_*`` > ``--config`` YAML > defaults) and calls ``export_command``.
It reads ``GET /spanrl/v1/prompts`` of any endpoint (``spanrl proxy``, ``spanrl serve``, the verl
gateway) with ``endpoint_prompts.PromptResourcesClient`` and writes the prompts-file format of
``prompt_resources.py`` (YAML): every candidate and the active one, or with ``--active-only`` each
resource's active instructions alone. Stdlib + PyYAML.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, field
from typing import Any

from spanrl.errors import UserError
from spanrl.settings_loader import CommandSettings


@dataclass(frozen=True)
class PromptsExportSettings:
    url: str = field(default="http://127.0.0.1:8200", metadata={
        "help": "the endpoint (its root or its /v1 base URL): spanrl proxy, spanrl serve or the verl gateway"})
    token: str | None = field(default=None, metadata={"help": "the endpoint's bearer token", "secret": True})
    output: str = field(default="", metadata={"help": "write to this file (default: standard output)"})
    active_only: bool = field(default=False, metadata={
        "help": "write each resource's active instructions only (resource: text), not every candidate"})
    force: bool = field(default=False, metadata={"help": "replace an existing --output file"})


SETTINGS = CommandSettings("prompts export", PromptsExportSettings, "PROMPTS_EXPORT")


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("prompts", help="the prompt candidates an endpoint serves in place of the "
                                                   "agents' instructions")
    actions = parser.add_subparsers(dest="prompts_action", metavar="ACTION")
    export = actions.add_parser("export", help="write out the prompt resources of a running endpoint (YAML)")
    SETTINGS.add_to(export)
    export.set_defaults(func=export_command)
    parser.set_defaults(func=lambda args: (parser.print_help(), 2)[1])


def exported(resources: dict[str, Any], active_only: bool) -> dict[str, Any]:
    """The prompts-file form of ``GET /spanrl/v1/prompts``'s resources."""
    if active_only:
        return {name: entry["candidates"][entry["active"]] for name, entry in resources.items() if entry["active"]}
    return {name: {"active": entry["active"], "candidates": entry["candidates"]} for name, entry in resources.items()}


def export_command(settings: PromptsExportSettings) -> int:
    import yaml

    from spanrl.trainer_bridge.endpoint_prompts import PromptResourcesClient

    resources = PromptResourcesClient(settings.url, settings.token).resources()
    text = yaml.safe_dump(exported(resources, settings.active_only), sort_keys=True, allow_unicode=True,
                          default_flow_style=False, width=100)
    if not settings.output:
        print(text, end="", flush=True)
        return 0
    if os.path.exists(settings.output) and not settings.force:
        raise UserError(f"--output {settings.output} exists: choose another file, or pass --force to replace it")
    with open(settings.output, "w", encoding="utf-8") as f:
        f.write(text)
    print(f"wrote {len(resources)} prompt resources to {settings.output}", flush=True)
    return 0
