"""The serving bench's ``--isa avx2`` (bench/avx2_only): a process started with its environment
must run as on an AVX2-only machine, for torch's kernels and for vLLM's choice of its own, and a
process started without it must not be touched (the AVX-512 figure stays the machine's own)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "bench"
sys.path.insert(0, str(BENCH))
import bench_serving_vs_vllm as serving_bench  # noqa: E402

PROBE = """
import torch
from vllm.platforms import current_platform
current_platform.import_kernels()
kernels = sorted({line.split('/')[-1].strip() for line in open('/proc/self/maps') if '/vllm/_C' in line})
print(torch.backends.cpu.get_cpu_capability(), torch.cpu._is_avx512_supported(), ','.join(kernels))
"""


def probe(isa: str) -> list[str]:
    env = {**os.environ, **serving_bench.VLLM_ENV, **serving_bench.isa_env(isa)}
    done = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout.split()


def test_avx2_environment_makes_torch_and_vllm_take_their_avx2_kernels():
    capability, avx512, kernels = probe("avx2")
    assert capability == "AVX2"
    assert avx512 == "False"
    assert kernels == "_C_AVX2.abi3.so"


def test_native_environment_is_the_machines_own():
    capability, avx512, kernels = probe("native")
    import torch

    assert capability == torch.backends.cpu.get_cpu_capability()
    assert avx512 == str(torch.cpu._is_avx512_supported())
    assert kernels != "" and (kernels == "_C_AVX2.abi3.so") == (avx512 == "False")
