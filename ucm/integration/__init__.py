"""Integrations of ucm with serving engines."""
