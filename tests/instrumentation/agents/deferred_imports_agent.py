"""Reports which instrumented libraries are imported and which instrumentors are on, before and
after importing the libraries named on its command line (run under ``opentelemetry-instrument``)."""

import importlib
import json
import sys

LIBRARIES = ("openai", "anthropic", "langchain_core")


def state() -> dict:
    from openinference.instrumentation.anthropic import AnthropicInstrumentor
    from openinference.instrumentation.langchain import LangChainInstrumentor
    from openinference.instrumentation.openai import OpenAIInstrumentor

    from spanrl.instrumentation.anthropic_instrumentor import SpanrlAnthropicInstrumentor
    from spanrl.instrumentation.openai_instrumentor import SpanrlOpenAIInstrumentor

    instrumentors = {
        "spanrl_openai": SpanrlOpenAIInstrumentor, "openinference_openai": OpenAIInstrumentor,
        "spanrl_anthropic": SpanrlAnthropicInstrumentor, "openinference_anthropic": AnthropicInstrumentor,
        "openinference_langchain": LangChainInstrumentor,
    }
    return {
        "imported": sorted(name for name in LIBRARIES if name in sys.modules),
        "on": sorted(name for name, cls in instrumentors.items() if cls().is_instrumented_by_opentelemetry),
    }


before = state()
for name in sys.argv[1:]:
    importlib.import_module(name)
print(json.dumps({"before": before, "after": state()}))
