"""``spanrl serve MODEL_DIR``: the embedded OpenAI-compatible policy server, standalone.

Registered by ``core/cli.py``, which builds ``ServeSettings`` (flags, then
``OTEL_SPANRL_SERVE_<FIELD>`` variables, then the ``--config`` YAML file, then defaults; see
``core/settings_loader.py``), prints them at start-up and calls ``_serve``.
The engine is ``policy_engine.PolicyEngine``, the HTTP app ``policy_server.create_app``; the
app runs in a child process (``api_process.py``) unless ``--single-process`` is given.
A torch-backend checkpoint trained with per-agent adapters (``adapters/<name>/`` beside the
base) is served with every adapter, routed as during training (``adapter_checkpoint.py``).
Imports nothing heavy at module level.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from spanrl.errors import UserError
from spanrl.settings_loader import CommandSettings, setting
from spanrl.startup_checks import ensure_model_dir, ensure_port_free
from spanrl.trainer_bridge.model_names import ANY_NAME
from spanrl.trainer_bridge.torch_backend.config import DEFAULT_PREFIX_CACHE_MB, PREFIX_CACHE_HELP


@dataclass(frozen=True)
class ServeSettings:
    model_dir: str = field(metadata={
        "help": "Hugging Face model directory (e.g. from `spanrl model init`)", "positional": True})
    host: str = setting("127.0.0.1", "bind address (another address: give a token and TLS too)")
    port: int = setting(8000, "port")
    token: str | None = setting(None, "require 'Authorization: Bearer TOKEN' or 'x-api-key: TOKEN' (the agents' "
                                      "OPENAI_API_KEY or ANTHROPIC_API_KEY)", secret=True)
    admin_token: str | None = setting(
        None, "the trainer's bearer token for POST /spanrl/v1/weights (never give it to agents; must differ from "
        "token); none = the route is off", secret=True)
    weights_dir: str | None = setting(
        None, "POST /spanrl/v1/weights loads only model directories under this folder (the training run's "
        "output folder); required with admin_token")
    tls_cert: str | None = setting(None, "PEM certificate (chain) file: serve HTTPS only (with tls_key)")
    tls_key: str | None = setting(None, "PEM private key file of tls_cert")
    max_concurrency: int = setting(2048, "connections and requests served at once; more get 503 at once")
    max_queued_requests: int = setting(
        1024, "requests waiting for the engine (not decoding yet); more get 503 with Retry-After")
    device: str = setting("auto", "auto | cpu | cuda | cuda:N")
    dtype: str = setting("auto", "auto | float32 | bfloat16 | float16 (auto: float32 on CPU)")
    max_batch_size: int = setting(64, "most sequences decoded together in one batch")
    served_model_name: list = field(default_factory=list, metadata={
        "help": "the model names clients may send, the first the model's own (default: the directory's name); "
                "'*' answers any name (echoed back)",
        "deprecated_env": "OTEL_SPANRL_SERVE_MODEL_NAME"})  # the name before 0.2; read with a warning
    policy_version: int = setting(0, "initial policy version")
    threads: int = setting(0, "torch CPU threads; 0 = torch's choice (1 is steadier on a busy machine)")
    prefix_cache_mb: float = setting(DEFAULT_PREFIX_CACHE_MB, PREFIX_CACHE_HELP)
    batch_wait_ms: float = setting(
        20.0, "while a batch decodes, newcomers gather until they are a quarter of it, but join after "
        "waiting this long at most")
    spans_endpoint: str | None = setting(
        None, "OTLP endpoint (the receiver, e.g. http://127.0.0.1:4317) that gets one LLM span per generation "
        "request; default: OTEL_EXPORTER_OTLP_TRACES_ENDPOINT / OTEL_EXPORTER_OTLP_ENDPOINT; 'off' = none")
    prompts: str = setting(
        "", "a YAML/JSON file of prompt candidates that replace agents' instructions (docs/proxy.md, \"Prompt "
        "resources\"); they can also be set at run time by POST /spanrl/v1/prompts")
    single_process: bool = setting(
        False, "serve HTTP from the engine's own process instead of a child process (one process; under "
        "concurrent load both then share one GIL and it is slower)")


SETTINGS = CommandSettings("serve", ServeSettings, "SERVE")


def weights_admin_of(settings: ServeSettings) -> Any:
    """The ``WeightsAdmin`` of ``admin_token`` and ``weights_dir`` (None when the route is off);
    ``SettingError`` when only one is given or the admin token is the agents' token."""
    from spanrl.errors import SettingError
    from spanrl.trainer_bridge.torch_backend.server.policy import WeightsAdmin

    if settings.admin_token is None and settings.weights_dir is None:
        return None
    if not settings.admin_token or not settings.weights_dir:
        raise SettingError("loading weights over HTTP needs both admin_token and weights_dir (the folder the "
                           "trainer writes model directories to); give both or neither")
    if settings.admin_token == settings.token:
        raise SettingError("admin_token must differ from token: agents hold the token, only the trainer may "
                           "hold the admin token")
    if not os.path.isdir(settings.weights_dir):
        raise SettingError(f"weights_dir {settings.weights_dir!r} is not a folder")
    return WeightsAdmin(settings.admin_token, settings.weights_dir)


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser("serve", help="serve a model directory as an OpenAI-compatible endpoint")
    SETTINGS.add_to(parser)
    parser.set_defaults(func=_serve)


def _serve(settings: ServeSettings) -> int:
    ensure_model_dir(settings.model_dir, "model_dir")
    ensure_port_free(settings.host, settings.port, "port", "cannot serve on")
    if settings.prompts:  # a bad file is said here, not in the HTTP front end's process
        from spanrl.trainer_bridge.prompt_resources import PromptResources

        PromptResources.from_file(settings.prompts)
    weights_admin = weights_admin_of(settings)
    from spanrl.trainer_bridge.torch_backend.adapter_checkpoint import checkpoint_adapter_specs

    adapters = checkpoint_adapter_specs(settings.model_dir)  # a bad adapter file is said before any load
    if adapters and weights_admin is not None:
        from spanrl.errors import SettingError

        raise SettingError("admin_token/weights_dir with a checkpoint that has adapters: loading new weights over "
                           "HTTP replaces the base model only; serve a checkpoint with adapters without them")
    from spanrl.server_security import TlsSetupError, check_tls_pair

    try:  # before the model loads; the server warns when it is exposed (app.check_server_security)
        tls = check_tls_pair(settings.tls_cert, settings.tls_key, "tls_cert/tls_key")
    except TlsSetupError as exc:
        raise UserError(f"cannot serve over TLS: {exc}") from exc
    import torch

    if settings.threads > 0:
        torch.set_num_threads(settings.threads)
    if settings.spans_endpoint:  # read by create_app here and in the HTTP front end's process
        from spanrl.trainer_bridge.endpoint_spans import SPANS_ENDPOINT_ENV

        os.environ[SPANS_ENDPOINT_ENV] = settings.spans_endpoint

    engine = _start_engine(settings, adapters)
    if settings.single_process:
        return _serve_in_this_process(settings, engine, weights_admin, tls)
    from spanrl.trainer_bridge.torch_backend.server.api_process import serve_in_process

    try:
        handle = serve_in_process(engine, settings.host, settings.port, settings.token, log_level="info",
                                  weights_admin=weights_admin, tls_cert=settings.tls_cert, tls_key=settings.tls_key,
                                  max_concurrency=settings.max_concurrency, model_names=settings.served_model_name,
                                  prompts=settings.prompts or None)
    except OSError as exc:  # the address is taken: a setting the user can change
        engine.stop()
        raise UserError(f"cannot serve on {settings.host}:{settings.port}: {exc}") from exc
    except RuntimeError:  # the front end did not start: not the user's doing, shown with its traceback
        engine.stop()
        raise
    print(f"serving model {engine.model_name!r}{_adapters_note(engine)} on {handle.base_url} "
          f"(HTTP in process {handle.process.pid})")
    try:
        status = handle.wait()  # Ctrl-C reaches both processes; the front end shuts down cleanly
    except KeyboardInterrupt:
        status = 0
    finally:
        handle.stop()
        engine.stop()
    return 0 if status in (0, -2, 130) else 1


def _start_engine(settings: ServeSettings, adapters: tuple) -> Any:
    """The started engine of ``settings.model_dir``, serving ``adapters`` (a checkpoint's) too."""
    from spanrl.trainer_bridge.torch_backend.engine.policy_engine import PolicyEngine

    own_name = next((name for name in settings.served_model_name if name != ANY_NAME), None)
    engine = PolicyEngine.from_pretrained(
        settings.model_dir, device=settings.device, dtype=settings.dtype,
        model_name=own_name, version=settings.policy_version,
        max_batch_size=settings.max_batch_size, batch_wait_s=settings.batch_wait_ms / 1000.0,
        max_queued_requests=settings.max_queued_requests, prefix_cache_mb=settings.prefix_cache_mb,
    )
    if adapters:  # the base and every adapter at once, as the training run served them
        from spanrl.trainer_bridge.torch_backend.adapter_checkpoint import load_adapter_weights

        engine.attach_adapters(load_adapter_weights(engine.model, settings.model_dir, adapters),
                               {spec.name: spec.agents for spec in adapters})
    engine.start()
    return engine


def _adapters_note(engine: Any) -> str:
    adapters = engine.adapters
    return f" with adapters {', '.join(f'{n!r} (agents {list(a)})' for n, a in adapters.items())}" if adapters else ""


def _serve_in_this_process(settings: ServeSettings, engine: Any, weights_admin: Any, tls: bool) -> int:
    """``--single-process``: uvicorn in this process, over the engine's own thread."""
    import uvicorn

    from spanrl.server_connections import IDLE_CONNECTION_TIMEOUT_S
    from spanrl.trainer_bridge.torch_backend.server.app import check_server_security, create_app

    check_server_security(settings.host, settings.token, settings.tls_cert, settings.tls_key)
    print(f"serving model {engine.model_name!r}{_adapters_note(engine)} on {'https' if tls else 'http'}://{settings.host}:{settings.port}/v1")
    try:
        uvicorn.run(create_app(engine, settings.token, weights_admin=weights_admin,
                               model_names=settings.served_model_name, prompts=settings.prompts or None),
                    host=settings.host,
                    port=settings.port, log_level="info", access_log=False, limit_concurrency=settings.max_concurrency,
                    timeout_keep_alive=IDLE_CONNECTION_TIMEOUT_S,
                    ssl_certfile=settings.tls_cert, ssl_keyfile=settings.tls_key)
    finally:
        engine.stop()
    return 0
