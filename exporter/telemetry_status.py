"""Say it, once, on stderr, when an agent's telemetry is off: the agent still runs, its exit code unchanged.

Without this, an agent under ``opentelemetry-instrument`` whose OTel SDK could not start (a
package pinned protobuf to a version the OTLP exporter's generated code refuses), whose SDK is
disabled (``OTEL_SDK_DISABLED=true``, CrewAI's documented telemetry opt-out), or whose spanrl
instrumentor was skipped (a dependency conflict) exits 0 having sent nothing, and training sees
zero transitions. Called from three places:

- ``environment_variables`` (our ``opentelemetry_environment_variables`` entry point), which the
  ``opentelemetry-instrument`` launcher loads before it starts the agent: ``check_in_launcher``
  makes the imports the SDK's start-up will make. If one fails, the SDK will not start in the
  agent, no spanrl hook runs there, and this is the one place left to say so.
- ``hook.pre_instrument``: ``say_if_sdk_disabled``.
- ``hook.post_instrument``: ``say_if_instrumentor_skipped``.

``spanrl doctor`` (``core/doctor.py``) reuses ``sdk_start_problem`` and ``instrumentor_problem``.
"""

from __future__ import annotations

import os
import sys
import threading

LAUNCHER_NAME = "opentelemetry-instrument"
DOCTOR_HINT = "run `spanrl doctor` in this environment for details"

_said: set[str] = set()
_lock = threading.Lock()


def say_once(kind: str, message: str) -> bool:
    """Print ``spanrl: <message>`` on stderr, once per ``kind`` per process; True when printed now."""
    with _lock:
        if kind in _said:
            return False
        _said.add(kind)
    try:
        print(f"spanrl: {message}", file=sys.stderr, flush=True)
    except Exception:  # noqa: BLE001 - a closed stderr must not stop the agent
        return False
    return True


def sdk_disabled(environ: dict[str, str] | None = None) -> bool:
    env = os.environ if environ is None else environ
    return env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true"


def _traces_exporter_entry_names() -> list[str]:
    """The ``opentelemetry_traces_exporter`` entry points the SDK's start-up will load."""
    names = os.environ.get("OTEL_TRACES_EXPORTER", "otlp")  # opentelemetry-distro's default
    if names.strip().lower() == "none":
        return []
    try:  # the SDK's own mapping of "otlp" to the protocol's exporter
        from opentelemetry.sdk._configuration import _get_exporter_entry_point

        return [_get_exporter_entry_point(name.strip(), "traces") for name in names.split(",") if name.strip()]
    except Exception:  # noqa: BLE001 - an SDK without it: load what the names say
        return [name.strip() for name in names.split(",") if name.strip()]


def sdk_start_problem() -> str | None:
    """Why the OTel SDK would fail to start in this environment (the imports its start-up makes
    fail), or None."""
    from importlib.metadata import entry_points

    try:
        for group in ("opentelemetry_distro", "opentelemetry_configurator"):
            for entry_point in entry_points(group=group):
                entry_point.load()
        for name in _traces_exporter_entry_names():
            found = list(entry_points(group="opentelemetry_traces_exporter", name=name))
            if not found:
                return f"the span exporter {name!r} (OTEL_TRACES_EXPORTER) is not installed"
            found[0].load()
    except Exception as exc:  # noqa: BLE001 - whatever stops the SDK, reported
        return f"{type(exc).__name__}: {exc}".strip()
    return None


def _sdk_fix(problem: str) -> str:
    if "protobuf" in problem.lower():
        from importlib.metadata import PackageNotFoundError, version

        try:
            installed = version("protobuf")
        except PackageNotFoundError:
            installed = "none"
        return (f"protobuf {installed} is installed; install the protobuf major version the OTLP exporter was built "
                "for (e.g. `pip install 'protobuf>=6'`), or an exporter release built for yours")
    return "fix the installation of the OTel SDK and exporter packages"


def check_in_launcher() -> None:
    """In the ``opentelemetry-instrument`` launcher only: say now if the SDK will fail to start."""
    if os.path.basename(sys.argv[0] if sys.argv else "") != LAUNCHER_NAME or sdk_disabled():
        return  # a disabled SDK is said by the agent's own pre-instrument hook
    try:
        problem = sdk_start_problem()
    except Exception:  # noqa: BLE001 - the launcher must start the agent whatever happens here
        return
    if problem is not None:
        say_once("sdk", f"telemetry is OFF for this agent: the OTel SDK will fail to start ({problem}); the agent "
                        f"sends no span to the receiver. To fix: {_sdk_fix(problem)}; {DOCTOR_HINT}.")


def say_if_sdk_disabled() -> bool:
    if not sdk_disabled():
        return False
    return say_once("disabled", "telemetry is OFF for this agent: OTEL_SDK_DISABLED=true, so the agent sends no span "
                                "to the receiver (unset it, or set it to false, in the agent's environment); "
                                f"{DOCTOR_HINT}.")


def instrumentor_problem() -> str | None:
    """Why ``opentelemetry-instrument`` skips spanrl's OpenAI instrumentor here, or None."""
    disabled = [name.strip() for name in os.environ.get("OTEL_PYTHON_DISABLED_INSTRUMENTATIONS", "").split(",")]
    if "spanrl_openai" in disabled or "*" in disabled:
        return "OTEL_PYTHON_DISABLED_INSTRUMENTATIONS turns it off"
    from importlib.metadata import PackageNotFoundError, distribution

    from opentelemetry.instrumentation.dependencies import get_dist_dependency_conflicts

    try:
        conflict = get_dist_dependency_conflicts(distribution("spanrl"))
    except PackageNotFoundError:
        return "the spanrl distribution is not installed (its entry points are not registered)"
    if conflict is None:  # the distribution's check (instruments-any) passes with either SDK: the OpenAI one's
        from opentelemetry.instrumentation.dependencies import get_dependency_conflicts

        from spanrl.instrumentation.package import _instruments

        conflict = get_dependency_conflicts(list(_instruments))
    if conflict is None:
        return None
    return conflict._format_message("spanrl_openai")  # OTel's own wording of the conflict


def say_if_instrumentor_skipped(instrumented: bool) -> bool:
    """After the instrumentors ran: say why spanrl's was skipped, when the agent could use it."""
    if instrumented:
        return False
    problem = instrumentor_problem()
    if problem is None or "no installed version was found" in problem:
        return False  # no OpenAI SDK in this environment: nothing of it to record
    return say_once("instrumentor", f"the agent's OpenAI calls are NOT recorded: {problem}; only spans from the "
                                    f"policy endpoint itself can train (see docs/instrumentation.md); {DOCTOR_HINT}.")


__all__ = ["check_in_launcher", "instrumentor_problem", "say_if_instrumentor_skipped", "say_if_sdk_disabled",
           "say_once", "sdk_disabled", "sdk_start_problem"]
