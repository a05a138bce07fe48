"""Helpers for ucm's tests: tiny models, prompts, fixtures and backend conformance tests."""
