"""Prometheus recording and alerting rules generated from ``detector/thresholds.py``, their promtool
tests, and the tooling that evaluates them over a recorded run in a real Prometheus."""
