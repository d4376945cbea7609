"""Which model names a policy endpoint answers to: a list of names, and ``*`` for any name.

Torch-free. Used by both policy endpoints: the embedded server (``torch_backend/server/serving.py``
checks each request, ``models.py`` lists the names; set by ``spanrl serve --served-model-name``
and ``spanrl train``'s ``policy_model_name`` / ``policy_model_names``) and the verl gateway
(``verl_backend/gateway_app.py``). Real agents hard-code their model names (often one per
agent), so ``spanrl train``'s endpoint and the gateway answer any name by default; ``spanrl
serve`` answers only the names it lists, as vLLM does, unless one of them is ``*``. A request
is answered under the name it asked for (echoed in the body's ``model``).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

ANY_NAME = "*"


@dataclass(frozen=True)
class ServedModelNames:
    """``names``: listed in ``GET /v1/models``, the first is the model's own; ``any_name``: every
    other name is answered too."""

    names: tuple[str, ...]
    any_name: bool = False

    @classmethod
    def of(cls, names: Iterable[str], default: str) -> ServedModelNames:
        """From a setting's list (``*`` among them: any name); ``default`` is listed when no
        other name is given."""
        given = [name.strip() for name in names if name and name.strip()]
        listed = tuple(dict.fromkeys(name for name in given if name != ANY_NAME)) or (default,)
        return cls(listed, ANY_NAME in given)

    def accepts(self, name: object) -> bool:
        return isinstance(name, str) and (self.any_name or name in self.names)

    def not_found(self, name: object) -> str:
        """What a request for an unknown ``name`` is told."""
        served = ", ".join(repr(n) for n in self.names)
        return (f"the model {name!r} does not exist; this server serves {served} (list more names, or '*' for "
                "any name, with --served-model-name / policy_model_names)")


__all__ = ["ANY_NAME", "ServedModelNames"]
