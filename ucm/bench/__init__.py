"""Benchmarks: ``ucm bench`` measures ucm next to the machine's limits and other systems."""
