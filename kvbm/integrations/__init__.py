"""Integrations with inference engines."""
