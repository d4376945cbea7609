"""The LLM-SDK and agent-framework instrumentors, turned on when the agent imports their library.

``opentelemetry-instrument`` calls ``instrument()`` on every installed instrumentor before the agent
starts, and each of these imports the library it patches. Where a library is installed but the
agent never uses it (Anthropic's SDK and LangChain beside an OpenAI agent, say), that import is
start-up time for nothing: on a 2-core machine ``opentelemetry-instrument python -c pass`` took
~7 CPU-seconds with anthropic and langchain-core installed, ~2.6 without them. For an agent
``spanrl run`` starts once per attempt (``command:``), that is per rollout.

``defer_until_imported`` (the pre-instrument hook calls it) makes the auto-instrumentation loader
(``BaseDistro.load_instrumentor``, the method the OTel docs name for distros to customise loading)
register an import hook for each instrumentor in ``DEFERRED_UNTIL_IMPORTED`` whose library is not
imported yet: the instrumentor is loaded and turned on the moment the agent imports the library,
before the importing statement gets it, so the agent's calls are recorded as before. A library
already imported is instrumented at once. Only instrumentors that do nothing but patch their
library are listed (spanrl's and the openinference ones spanrl depends on); any other keeps
loading at start-up. ``OTEL_SPANRL_DEFER_INSTRUMENTORS=false`` turns this off.

Nothing here may break the agent: an instrumentor that fails at import time is logged, as the OTel
loader logs it at start-up, and the agent's import goes on.
"""

from __future__ import annotations

import functools
import logging
import sys
from typing import Any

logger = logging.getLogger(__name__)

# entry point value (module:class) -> the module whose import turns it on
DEFERRED_UNTIL_IMPORTED = {
    "spanrl.instrumentation.openai_instrumentor:SpanrlOpenAIInstrumentor": "openai",
    "spanrl.instrumentation.anthropic_instrumentor:SpanrlAnthropicInstrumentor": "anthropic",
    "openinference.instrumentation.openai:OpenAIInstrumentor": "openai",
    "openinference.instrumentation.anthropic:AnthropicInstrumentor": "anthropic",
    "openinference.instrumentation.langchain:LangChainInstrumentor": "langchain_core",
    "openinference.instrumentation.crewai:CrewAIInstrumentor": "crewai",
}


def defer_until_imported() -> bool:
    """Make ``BaseDistro.load_instrumentor`` defer the instrumentors above until their library is
    imported; False when it already does (a second call) or cannot (an OTel without the method)."""
    from opentelemetry.instrumentation.distro import BaseDistro  # type: ignore[attr-defined]

    loader = BaseDistro.__dict__.get("load_instrumentor")
    if loader is None or getattr(loader, "spanrl_original", None) is not None:
        return False

    @functools.wraps(loader)
    def load_instrumentor(self: Any, entry_point: Any, **kwargs: Any) -> Any:
        module = DEFERRED_UNTIL_IMPORTED.get(getattr(entry_point, "value", ""))
        if module is None or module in sys.modules:
            return loader(self, entry_point, **kwargs)
        from wrapt import register_post_import_hook

        register_post_import_hook(functools.partial(_load_now, loader, self, entry_point, kwargs), module)
        logger.debug("spanrl: %s waits for the agent to import %s", entry_point.name, module)
        return None

    load_instrumentor.spanrl_original = loader  # type: ignore[attr-defined]
    BaseDistro.load_instrumentor = load_instrumentor
    return True


def stop_deferring() -> None:
    """Give ``BaseDistro`` its own ``load_instrumentor`` back (the hooks registered stay)."""
    from opentelemetry.instrumentation.distro import BaseDistro  # type: ignore[attr-defined]

    original = getattr(BaseDistro.__dict__.get("load_instrumentor"), "spanrl_original", None)
    if original is not None:
        BaseDistro.load_instrumentor = original


def _load_now(loader: Any, distro: Any, entry_point: Any, kwargs: dict[str, Any], module: Any) -> None:
    """The import hook: load and turn on the instrumentor, unless something turned it on meanwhile
    (spanrl's SDK instrumentors turn on openinference's)."""
    from opentelemetry.instrumentation.dependencies import DependencyConflictError

    try:
        if entry_point.load()().is_instrumented_by_opentelemetry:
            return
        loader(distro, entry_point, **kwargs)
        logger.debug("spanrl: instrumented %s on the import of %s", entry_point.name, module.__name__)
    except DependencyConflictError as exc:  # as the OTel loader: the installed library is not supported
        logger.debug("spanrl: instrumentation %s skipped: %s", entry_point.name, exc.conflict)
    except Exception:  # noqa: BLE001 - the agent's import must go on
        logger.exception("spanrl: instrumenting %s on the import of %s failed; its calls are not recorded",
                         entry_point.name, module.__name__)


__all__ = ["DEFERRED_UNTIL_IMPORTED", "defer_until_imported", "stop_deferring"]
