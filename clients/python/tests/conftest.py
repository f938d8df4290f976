"""The fixtures live in support.py, which the tests also import their helpers from."""

pytest_plugins = ["support"]
