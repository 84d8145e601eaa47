"""Fixtures the persisted-conversation tests share."""

from __future__ import annotations

import pytest
from helpers.persist_servers import Reference


@pytest.fixture(scope="module")
def reference(demo_models, tmp_path_factory):
    """The never-restarted servers every answer is compared with."""
    ref = Reference(demo_models, tmp_path_factory.mktemp("reference"))
    try:
        yield ref
    finally:
        ref.close()
