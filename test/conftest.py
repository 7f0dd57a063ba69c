"""Shared test fixtures.

ROS tests run on real rclpy with Fast DDS over loopback. Each pytest run picks its own ROS_DOMAIN_ID
(from the process id) and keeps discovery on localhost, so parallel runs on one machine don't cross.
Tests that need ROS (rclpy + the colcon install space) are marked ``ros`` and skip cleanly when run
outside ``make test``'s environment.

Two guards against a hung run:

* Node leaks. rclpy finalises a node (``rcl_node_fini``; with Fast DDS the last node of a context also
  destroys its DDS participant) only when every holder of the node's handle has let go: ``destroy_node()``
  releases the node's publishers, subscriptions, services, clients, timers and guard conditions, but not
  its waitables (an ``ActionClient`` or ``ActionServer`` must be destroyed by its owner) nor a
  ``LifecycleNode``'s state machine (``OxygenNode.destroy_node`` destroys its own). Whatever is left is
  finalised by the garbage collector at an arbitrary moment of a later test, and destroying a DDS
  participant from there can wait forever on a participant-listener callback in flight (a hang seen in
  CI). Every rclpy node is therefore tracked (weakly) from its creation; after each test, each module and
  the session, a node created there whose rcl node is still held fails the test (an error at teardown,
  naming the node and what holds it) after being destroyed explicitly — never by the collector. Detecting
  only looks at the handles: it neither collects nor finalises.
* A per-test watchdog (pytest.ini: pytest's ``faulthandler_timeout`` with ``faulthandler_exit_on_timeout``;
  pytest-timeout is not a dependency): 900 s after a test started (setup, call and teardown), faulthandler,
  from a C thread of its own (so also when the main thread spins holding the GIL), dumps every thread's
  stack to stderr and ends the run with status 1 — a hang is a diagnosable failure, not a CI timeout. The
  whole suite takes 6-8 min on 2 loaded cores; ``-o faulthandler_timeout=0`` disables the watchdog.
"""
from __future__ import annotations

import functools
import gc
import itertools
import os
import time
import weakref
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


# ---- node leak guard (module docstring) ----------------------------------------------------------------

_NODES: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()   # rclpy Node -> (serial, name, created in)
_SERIALS = itertools.count(1)
_last_serial = 0         # the serial of the node created last
_phase = "collection"    # the test (or fixture scope) that runs now: where a node was created


def _track_nodes() -> None:
    """Register every rclpy node at construction (before ``Node.__init__`` runs, so that a constructor that
    raises after creating the rcl node is tracked too)."""
    from rclpy.node import Node

    original = Node.__init__
    if getattr(original, "_oxygen_tracked", False):
        return

    @functools.wraps(original)
    def tracked_init(self, node_name, *args, **kwargs):
        global _last_serial
        namespace = (kwargs.get("namespace") or "").rstrip("/")
        _last_serial = next(_SERIALS)
        _NODES[self] = (_last_serial, f"{namespace}/{node_name}", _phase)
        original(self, node_name, *args, **kwargs)

    tracked_init._oxygen_tracked = True
    Node.__init__ = tracked_init


if ROS_AVAILABLE:
    _track_nodes()


def _destroy_requested(handle) -> bool:
    """Whether ``destroy_when_not_in_use()`` was called on an rclpy handle (it refuses new uses then)."""
    from rclpy.exceptions import InvalidHandle

    try:
        handle.__enter__()
    except InvalidHandle:
        return True
    handle.__exit__(None, None, None)
    return False


def _holders(node) -> list[str]:
    """What still holds ``node``'s rcl node (empty when it is finalised or finalises as soon as an
    executor's wait in progress lets go)."""
    handle = node.__dict__.get("_Node__node")
    if handle is None:
        return []    # the constructor failed before the rcl node existed
    if not _destroy_requested(handle):
        return ["the node itself: destroy_node() was not called"]
    held = [f"{type(w).__module__}.{type(w).__name__} (a waitable: destroy it, destroy_node() does not)"
            for w in list(node.waitables)]
    machine = node.__dict__.get("_state_machine")
    if machine is not None and not _destroy_requested(machine):
        held.append("its lifecycle state machine (rclpy's LifecycleNode.destroy_node leaves it: destroy "
                    "node._state_machine)")
    return held


def _release(node) -> list[str]:
    """Destroy what still holds ``node`` now (not at garbage collection); returns the errors met."""
    errors = []
    steps = [getattr(w, "destroy", functools.partial(node.remove_waitable, w))
             for w in list(node.waitables)]
    if not _destroy_requested(node.handle):
        steps.append(node.destroy_node)
    machine = node.__dict__.get("_state_machine")
    if machine is not None:
        steps.append(machine.destroy_when_not_in_use)
    for step in steps:
        try:
            step()
        except Exception as error:  # noqa: BLE001 - release the rest, report all
            errors.append(f"{type(error).__name__}: {error}")
    return errors


def _check_nodes(since: int, where: str) -> None:
    """Fail (after destroying them) when nodes created after serial ``since`` are not finalised."""
    leaks = []
    for node, (serial, name, created_in) in list(_NODES.items()):
        if serial <= since:
            continue
        held = _holders(node)
        if held:
            errors = _release(node)
            leaks.append(f"{name} (created in {created_in}) is held by " + "; ".join(held)
                         + (f" [releasing it raised: {'; '.join(errors)}]" if errors else ""))
    if leaks:
        pytest.fail(f"{where} left {len(leaks)} rclpy node(s) not destroyed; the garbage collector would finalise "
                    "them at a random later moment, which can hang the run (test/conftest.py):\n  "
                    + "\n  ".join(leaks), pytrace=False)


@pytest.fixture(autouse=True, scope="session")
def _nodes_destroyed_by_session():
    yield
    _check_nodes(0, "the session")     # also nodes created while collecting


@pytest.fixture(autouse=True, scope="module")
def _nodes_destroyed_by_module(request):
    global _phase
    _phase = f"module {request.node.nodeid}'s fixtures"
    since = _last_serial
    yield
    _phase = f"module {request.node.nodeid}'s fixtures"
    _check_nodes(since, f"module {request.node.nodeid}")
    # Nothing of the module's nodes is left to finalise: collect its cycles (models, engines) now, at a known
    # point, rather than inside a later test.
    gc.collect()


@pytest.fixture(autouse=True)
def _nodes_destroyed_by_test(request):
    global _phase
    since = _last_serial
    _phase = request.node.nodeid
    yield
    _check_nodes(since, request.node.nodeid)
    _phase = f"module {request.module.__name__}'s fixtures"


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
