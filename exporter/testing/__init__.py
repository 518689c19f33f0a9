"""Test helpers for the proxy: an OpenAI-compatible streaming upstream written for testing it."""
