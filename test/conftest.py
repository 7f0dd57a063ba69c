"""Shared test fixtures.

ROS tests run on real rclpy with Fast DDS over loopback. Each pytest run picks its own ROS_DOMAIN_ID
(from the process id) and keeps discovery on localhost, so parallel runs on one machine don't cross.
Tests that need ROS (rclpy + the colcon install space) are marked ``ros`` and skip cleanly when run
outside ``make test``'s environment.
"""
from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Callable

import pytest

os.environ.setdefault("ROS_DOMAIN_ID", str(1 + os.getpid() % 100))
os.environ.setdefault("ROS_AUTOMATIC_DISCOVERY_RANGE", "LOCALHOST")
os.environ.setdefault("RMW_IMPLEMENTATION", "rmw_fastrtps_cpp")

REPO_ROOT = Path(__file__).resolve().parents[1]
SHARED_DATA = REPO_ROOT.parent / "shared" / "data"


def _ros_available() -> bool:
    try:
        import rclpy  # noqa: F401
        from oxygen_ros import msg  # noqa: F401
    except ImportError:
        return False
    return True


ROS_AVAILABLE = _ros_available()


def pytest_collection_modifyitems(config, items):
    if ROS_AVAILABLE:
        return
    skip = pytest.mark.skip(reason="rclpy or the built oxygen_ros messages are not importable: run `make test`")
    for item in items:
        if "ros" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def ros_context():
    """A fresh rclpy context for one test, shut down afterwards."""
    import rclpy
    from rclpy.context import Context

    context = Context()
    rclpy.init(context=context)
    try:
        yield context
    finally:
        context.try_shutdown()
        context.destroy()    # the DDS participant goes now, not at garbage collection


def spin_until(executor, condition: Callable[[], bool], timeout: float = 10.0) -> bool:
    """Spin ``executor`` until ``condition()`` is true or ``timeout`` [s] passes; return the condition."""
    deadline = time.monotonic() + timeout
    while not condition() and time.monotonic() < deadline:
        executor.spin_once(timeout_sec=0.05)
    return condition()


@pytest.fixture
def shared_data() -> Path:
    """../shared/data (real frames, rosbag2); skips the test when absent, as on a fresh clone."""
    if not SHARED_DATA.is_dir():
        pytest.skip(f"{SHARED_DATA} is absent")
    return SHARED_DATA


@pytest.fixture(scope="module")
def model():
    """The tiny π0.5 (seeded random weights, seed 5, float32) of the engine equivalence and fleet tests; a
    module that needs another seed defines its own ``model``."""
    from engine_support import tiny_model

    return tiny_model(5)


@pytest.fixture(scope="module")
def causal_model():
    """The tiny π0.5 of seed 6 with the causal prompt mask (instead of one bidirectional image + prompt block)."""
    from engine_support import tiny_model

    return tiny_model(6, "causal")
