"""Allows ``python -m retrywatch``."""

from retrywatch.cli import main

main()
