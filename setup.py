"""Declares the package's one C extension; everything else is in pyproject.toml.

``spanrl.otlp_receiver._span_scan`` (otlp_receiver/_span_scan.c) speeds up span validation at
ingest. It is optional: without a C compiler the install still succeeds and the receiver
validates spans in Python, with the same results, about three times slower.
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "spanrl.otlp_receiver._span_scan",
            sources=["otlp_receiver/_span_scan.c"],
            optional=True,
            extra_compile_args=["-O2"],
        )
    ]
)
