"""Packaged YAML configurations."""
