"""The proxy tests' real test upstream, for the benchmarks' instruments."""

from tests.exporter.conftest import upstream

__all__ = ["upstream"]
