"""``spanrl serve MODEL_DIR``: the embedded OpenAI-compatible policy server, standalone.

Registered by ``spanrl/cli.py``. Settings come from flags, then ``OTEL_SPANRL_SERVE_*``
environment variables, then defaults (``ServeSettings``); they are printed at start-up.
The engine is ``policy_engine.PolicyEngine``, the HTTP app ``policy_server.create_app``; the
app runs in a child process (``api_process.py``) unless ``--single-process`` is given.
Imports nothing heavy at module level.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import asdict, dataclass

from spanrl.env_settings import env_value

ENV_PREFIX = "OTEL_SPANRL_SERVE_"


@dataclass(frozen=True)
class ServeSettings:
    model_dir: str
    host: str = "127.0.0.1"
    port: int = 8000
    token: str | None = None
    device: str = "auto"
    dtype: str = "auto"
    max_batch_size: int = 64
    served_model_name: str | None = None
    policy_version: int = 0
    threads: int = 0  # torch intra-op threads; 0 = torch's default
    batch_wait_ms: float = 20.0
    single_process: bool = False  # HTTP in the engine's process (one GIL for both; slower under load)

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> ServeSettings:
        def pick(flag, name, default):
            return flag if flag is not None else env_value(ENV_PREFIX + name, default)

        return cls(
            model_dir=args.model_dir,
            host=pick(args.host, "HOST", cls.host),
            port=pick(args.port, "PORT", cls.port),
            token=pick(args.token, "TOKEN", None),
            device=pick(args.device, "DEVICE", cls.device),
            dtype=pick(args.dtype, "DTYPE", cls.dtype),
            max_batch_size=pick(args.max_batch_size, "MAX_BATCH_SIZE", cls.max_batch_size),
            served_model_name=pick(args.served_model_name, "MODEL_NAME", None),
            policy_version=pick(args.policy_version, "POLICY_VERSION", cls.policy_version),
            threads=pick(args.threads, "THREADS", cls.threads),
            batch_wait_ms=pick(args.batch_wait_ms, "BATCH_WAIT_MS", cls.batch_wait_ms),
            single_process=pick(args.single_process, "SINGLE_PROCESS", cls.single_process),
        )

    def printable(self) -> dict:
        shown = asdict(self)
        if shown["token"]:
            shown["token"] = "***"
        return shown


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser("serve", help="serve a model directory as an OpenAI-compatible endpoint")
    parser.add_argument("model_dir", help="Hugging Face model directory (e.g. from `spanrl model init`)")
    parser.add_argument("--host", default=None, help="bind address (default 127.0.0.1; env OTEL_SPANRL_SERVE_HOST)")
    parser.add_argument("--port", type=int, default=None, help="port (default 8000; env OTEL_SPANRL_SERVE_PORT)")
    parser.add_argument("--token", default=None,
                        help="require 'Authorization: Bearer TOKEN' (env OTEL_SPANRL_SERVE_TOKEN)")
    parser.add_argument("--device", default=None, help="auto | cpu | cuda | cuda:N (default auto)")
    parser.add_argument("--dtype", default=None, help="auto | float32 | bfloat16 | float16 (auto: fp32 on CPU)")
    parser.add_argument("--max-batch-size", type=int, default=None,
                        help="most sequences decoded together in one batch (default 64)")
    parser.add_argument("--served-model-name", default=None,
                        help="the model name clients send (default: the directory's name)")
    parser.add_argument("--policy-version", type=int, default=None, help="initial policy version (default 0)")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch CPU threads (default: torch's choice; 1 is steadier on a busy machine)")
    parser.add_argument("--batch-wait-ms", type=float, default=None,
                        help="while a batch decodes, newcomers gather until they are a quarter of it, "
                             "but join after waiting this long at most (default 20)")
    parser.add_argument("--single-process", action="store_true", default=None,
                        help="serve HTTP from the engine's own process instead of a child process "
                             "(one process; under concurrent load both then share one GIL and it is slower)")
    parser.set_defaults(func=_serve)


def _serve(args: argparse.Namespace) -> int:
    settings = ServeSettings.from_args(args)
    print(f"spanrl serve: {settings.printable()}")
    import torch
    import uvicorn

    if settings.threads > 0:
        torch.set_num_threads(settings.threads)

    from spanrl.trainer_bridge.torch_backend.engine.policy_engine import PolicyEngine
    from spanrl.trainer_bridge.torch_backend.server.app import create_app

    engine = PolicyEngine.from_pretrained(
        settings.model_dir, device=settings.device, dtype=settings.dtype,
        model_name=settings.served_model_name, version=settings.policy_version,
        max_batch_size=settings.max_batch_size, batch_wait_s=settings.batch_wait_ms / 1000.0,
    ).start()
    if settings.single_process:
        print(f"serving model {engine.model_name!r} on http://{settings.host}:{settings.port}/v1")
        try:
            uvicorn.run(create_app(engine, settings.token), host=settings.host, port=settings.port,
                        log_level="info", access_log=False)
        finally:
            engine.stop()
        return 0
    from spanrl.trainer_bridge.torch_backend.server.api_process import serve_in_process

    try:
        handle = serve_in_process(engine, settings.host, settings.port, settings.token, log_level="info")
    except (OSError, RuntimeError) as exc:  # the address is taken, or the front end did not start
        engine.stop()
        print(f"spanrl serve: cannot serve on {settings.host}:{settings.port}: {exc}", file=sys.stderr)
        return 1
    print(f"serving model {engine.model_name!r} on {handle.base_url} (HTTP in process {handle.process.pid})")
    try:
        status = handle.wait()  # Ctrl-C reaches both processes; the front end shuts down cleanly
    except KeyboardInterrupt:
        status = 0
    finally:
        handle.stop()
        engine.stop()
    return 0 if status in (0, -2, 130) else 1
