"""Fixtures shared across test packages."""

from hypothesis import settings

pytest_plugins = ["tests.console.fixtures"]

# Tests assert behaviour, never timing: Hypothesis's per-example deadline turns a loaded machine
# (CI's 2 shared cores) into a FlakyFailure. Examples stay bounded by each test's max_examples.
settings.register_profile("umbra", deadline=None)
settings.load_profile("umbra")
