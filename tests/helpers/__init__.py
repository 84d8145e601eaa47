"""What several test modules share: builders, servers, fetchers (tests/ is on pytest's path, so
``from helpers.stores import build_store``); fixtures live in tests/conftest.py."""
