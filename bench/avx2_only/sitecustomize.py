"""Make a Python process on an AVX-512 machine run as on an AVX2-only one (serving bench, ``--isa avx2``).

``bench_serving_vs_vllm.py --isa avx2`` puts this folder first on the servers' ``PYTHONPATH``, so
Python imports this module at start-up in every server process (and their children). Together
with the environment the bench sets (``ATEN_CPU_CAPABILITY=avx2`` for torch's own kernels,
``ONEDNN_MAX_CPU_ISA=AVX2`` for oneDNN's, ``MKL_ENABLE_INSTRUCTIONS=AVX2`` for MKL's), it answers
torch's CPU feature checks as an AVX2-only CPU would. vLLM's CPU build asks exactly those checks to
pick its compiled kernels (``vllm._C_AVX2`` instead of the AVX-512 ones) and its attention
and GEMM paths. spanrl's engine runs only torch's kernels, so the environment alone covers it.
"""

import os

if os.environ.get("SPANRL_BENCH_CPU_ISA") == "avx2":
    import torch

    for check in ("_is_avx512_supported", "_is_avx512_bf16_supported", "_is_avx512_vnni_supported",
                  "_is_avx512_fp16_supported", "_is_amx_tile_supported", "_is_amx_fp16_supported"):
        if hasattr(torch.cpu, check):
            setattr(torch.cpu, check, lambda: False)
