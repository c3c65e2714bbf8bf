"""Fixtures of the experts tests (see devices.py)."""

from tests.experts.devices import te_device  # noqa: F401  (a fixture)
