"""`make test` relies on ``--dist loadgroup`` to keep each ``xdist_group`` on one worker (the deploy tests share a
trained checkpoint and AOTInductor packages; the TensorBoard and resume tests share runs). If pytest and
pytest-xdist stop agreeing on how a node id carries the group, the marks are silently ignored and the shared
fixtures are built on both workers: this test fails instead."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.xdist_group("probe")


def test_a_marked_test_carries_its_group_to_the_scheduler(request: pytest.FixtureRequest) -> None:
    # pytest-xdist sets this option on its workers in a `--dist loadgroup` run, and only there.
    if not getattr(request.config.option, "loadgroup", False):
        pytest.skip("not a pytest-xdist worker of a --dist loadgroup run")
    assert request.node.nodeid.endswith("@probe"), (
        f"{request.node.nodeid!r} lost its xdist_group: pytest-xdist's loadgroup does not work with this pytest"
    )
