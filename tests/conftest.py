"""Shared fixtures. Each area keeps its fixtures in tests/fixtures/<area>.py."""

pytest_plugins = [
    "tests.fixtures.data",
    "tests.fixtures.servers",
    "tests.fixtures.credentials",
    "tests.fixtures.mlflow",
    "tests.fixtures.runtime",
]
