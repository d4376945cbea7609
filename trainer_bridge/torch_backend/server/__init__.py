"""The embedded policy server: OpenAI-compatible HTTP routes over the policy engine.

Runs in the engine's process (``app.serve_in_thread``) or in a torch-free child process
(``api_process``), laid out like vLLM's ``entrypoints/openai``: ``app`` (the factory), one router
per API family (``chat_completions``, ``completions``, ``responses``, ``models``, ``policy``),
``protocol`` and ``responses_protocol`` (typed bodies), ``response_store`` (the Responses API's
state), ``serving`` (what the routes share), ``logprobs``, ``errors``, ``chat_format`` and
``tool_calls`` (the model's tool calls, parsed and steered).
"""
