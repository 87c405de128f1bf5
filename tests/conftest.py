"""Fixtures shared across test packages."""

pytest_plugins = ["tests.console.fixtures"]
