"""The one OpenAI-compatible relay of spanrl: agents call it, it forwards each request to an upstream
and emits the endpoint's LLM span of the call.

Two front ends share it, with different upstreams and settings (``config.RelayConfig``): the verl
backend's gateway (``verl_backend/gateway.py``: vLLM replicas, paused around weight syncs) and
``spanrl proxy`` (``proxy.py``: any OpenAI-compatible server, a hosted API with its key included).
Torch-free and verl-free: ``app`` (routes), ``forwarding`` (talking to upstreams), ``rewrite`` (body
changes), ``upstreams`` (which upstream), ``state`` (what the routes share), ``spans`` (the span per
call), ``server_thread`` (serving on a loop of its own).
"""
