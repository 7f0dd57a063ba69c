"""Shared test fixtures.

ROS tests run on real rclpy with Fast DDS over loopback. Each pytest run picks its own ROS_DOMAIN_ID
(from the process id), each of its pytest-xdist workers (``make test`` runs two) one of its own, and keeps
discovery on localhost, so parallel runs and workers on one machine don't cross.
Tests that need ROS (rclpy + the colcon install space) are marked ``ros`` and skip cleanly when run
outside ``make test``'s environment. Tests that start rclpy nodes (over DDS in this process, or node
processes) are marked ``dds`` (a test using ``ros_context`` is marked here) and slow ones ``slow``: ``make
test-fast`` runs the rest (``-m "not dds and not slow"``) and fails a test there that starts a node unmarked.

Two guards against a hung run:

* Node leaks. rclpy finalises a node (``rcl_node_fini``; with Fast DDS the last node of a context also
  destroys its DDS participant) only when every holder of the node's handle has let go: ``destroy_node()``
  releases the node's publishers, subscriptions, services, clients, timers and guard conditions, but not
  its waitables (an ``ActionClient`` or ``ActionServer`` must be destroyed by its owner) nor a
  ``LifecycleNode``'s state machine (``OxygenNode.destroy_node`` destroys its own). Whatever is left is
  finalised by the garbage collector at an arbitrary moment of a later test, and destroying a DDS
  participant from there can wait forever on a participant-listener callback in flight (a hang seen in
  CI). Every rclpy node is therefore held (strongly: a node nobody else references any more, e.g. one whose
  constructor raised after ``Node.__init__``, would otherwise be finalised by the collector before anyone
  looked) from its creation until the end of the test, module or session that created it; there a node
  whose rcl node is still held fails the test (an error at teardown, naming the node and what holds it)
  after being destroyed explicitly — never by the collector. Detecting only looks at the handles: it
  neither collects nor finalises. ``test/test_suite_guards.py`` checks that the guard fails.
* A watchdog (pytest.ini: pytest's ``faulthandler_timeout`` with ``faulthandler_exit_on_timeout``):
  ``faulthandler_timeout`` seconds after a test started (setup, call and teardown, so also the teardown of
  module and session fixtures and the garbage collections that happen inside them), faulthandler, from a C
  thread of its own (so also when the main thread spins holding the GIL, as it does inside a finaliser the
  collector runs), dumps every thread's stack to stderr and ends the run with status 1 — a hang is a
  diagnosable failure, not a CI timeout. pytest itself cancels that watchdog when a test fails (its
  ``pytest_exception_interact`` hook) and only arms it around tests; the hooks below re-arm it for the rest
  of a failing test (unless ``--pdb``) and arm it for collection and for the end of the session through the
  interpreter's exit (``atexit``, the last collections, non-daemon threads). Under pytest-xdist (``make
  test``) every worker has this watchdog; the controller, which runs no test, re-arms its own at every report a
  worker sends. pytest-timeout is not used: its
  ``thread`` method dumps from a Python thread, which cannot run while the main thread holds the GIL, and its
  ``signal`` method runs its handler in the main thread, which is the one hung. ``-o
  faulthandler_timeout=0`` disables the watchdog.
"""
from __future__ import annotations

import faulthandler
import functools
import gc
import itertools
import os
import time
from pathlib import Path
from typing import Callable

import pytest


# ROS domains a pytest run takes: its own (a serial run's) and one per pytest-xdist worker of `make test`'s two.
RUN_DOMAINS = 3


def _test_domain_id() -> str:
    """The ROS domain of this test process. A run's domain is the user's ``ROS_DOMAIN_ID`` if set, else the first
    of a block of :data:`RUN_DOMAINS` chosen by the run's process id (1, 4, ... 97); a serial run uses it. A
    pytest-xdist worker (``PYTEST_XDIST_WORKER`` ``gw<N>``) inherits the run's domain from its controller
    (``OXYGEN_TEST_DOMAIN_ID``, set here before the workers start) and takes the (N+1)-th after it: runs started
    together (consecutive process ids) get disjoint blocks, and a run's workers never meet. With a user's domain,
    two runs at once share theirs (as any two processes on that domain do)."""
    run = os.environ.get("OXYGEN_TEST_DOMAIN_ID")
    if run is None:
        run = os.environ.get("ROS_DOMAIN_ID") or str(1 + RUN_DOMAINS * (os.getpid() % (99 // RUN_DOMAINS)))
        os.environ["OXYGEN_TEST_DOMAIN_ID"] = run
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    if worker.startswith("gw") and worker[2:].isdigit() and run.isdigit():
        return str(int(run) + 1 + int(worker[2:]))
    return run


os.environ["ROS_DOMAIN_ID"] = _test_domain_id()
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

# serial -> (rclpy Node, name, created in); held strongly until the check of the test, module or session that
# created the node (the module docstring)
_NODES: dict[int, tuple] = {}
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
        _NODES[_last_serial] = (self, f"{namespace}/{node_name}", _phase)
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
    from rclpy.node import Node

    steps = [getattr(w, "destroy", functools.partial(node.remove_waitable, w))
             for w in list(node.waitables)]
    if not _destroy_requested(node.handle):
        # a subclass's destroy_node can fail on a half-built node (its constructor raised): then rclpy's own
        steps.append(lambda: _first_that_works(node.destroy_node, functools.partial(Node.destroy_node, node)))
    machine = node.__dict__.get("_state_machine")
    if machine is not None:
        steps.append(machine.destroy_when_not_in_use)
    for step in steps:
        try:
            step()
        except Exception as error:  # noqa: BLE001 - release the rest, report all
            errors.append(f"{type(error).__name__}: {error}")
    return errors


def _first_that_works(*calls) -> None:
    """Call ``calls`` in order until one returns; raise the first error when none does."""
    errors = []
    for call in calls:
        try:
            call()
            return
        except Exception as error:  # noqa: BLE001 - try the next one
            errors.append(error)
    raise errors[0]


def _check_nodes(since: int, where: str) -> None:
    """Fail (after destroying them) when nodes created after serial ``since`` are not finalised."""
    leaks = []
    for serial in [serial for serial in _NODES if serial > since]:
        node, name, created_in = _NODES.pop(serial)
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
    started = _last_serial - since
    _check_nodes(since, request.node.nodeid)
    _phase = f"module {request.module.__name__}'s fixtures"
    if started and os.environ.get("OXYGEN_TEST_FAST") and "dds" not in request.node.keywords:
        pytest.fail(f"{request.node.nodeid} started {started} rclpy node(s) but is not marked `dds`: `make test-fast` "
                    "runs only tests without DDS nodes (pytest.ini's markers); mark it", pytrace=False)


# ---- watchdog (module docstring) ------------------------------------------------------------------------

_watch = {"fd": None, "started": 0.0}   # a copy of the real stderr; when the current test (or phase) started


def _watchdog_timeout(config) -> float:
    """pytest.ini's ``faulthandler_timeout`` [s]; 0 when disabled (also with ``-p no:faulthandler``)."""
    try:
        return float(config.getini("faulthandler_timeout") or 0.0)
    except ValueError:
        return 0.0


def _arm_watchdog(config, seconds: float | None = None) -> None:
    """Arm faulthandler's watchdog (pytest.ini's ``faulthandler_timeout`` / ``faulthandler_exit_on_timeout``) for
    ``seconds`` (default: the whole timeout), replacing the one armed before; nothing when it is disabled."""
    timeout = _watchdog_timeout(config)
    if timeout <= 0 or _watch["fd"] is None:
        return
    faulthandler.dump_traceback_later(timeout if seconds is None else seconds, file=_watch["fd"],
                                      exit=config.getini("faulthandler_exit_on_timeout"))


def pytest_configure(config):
    try:
        _watch["fd"] = os.dup(2)     # output capture is suspended here: the real stderr
    except OSError:
        _watch["fd"] = None
    # pytest-xdist's controller (``-n N``, N >= 1) runs no test itself, so pytest never re-arms its watchdog
    _watch["controller"] = config if (not hasattr(config, "workerinput")
                                      and getattr(config.option, "numprocesses", None)) else None


def pytest_runtest_logreport(report):
    """In pytest-xdist's controller the watchdog restarts at every report a worker sends (each phase of each
    test): it fires only when no worker has reported for the whole timeout (a worker's own watchdog ends a hung
    test first), not 900 s into a healthy run."""
    if _watch.get("controller") is not None:
        _arm_watchdog(_watch["controller"])


def pytest_sessionstart(session):
    """Collection (imports of every test module) runs under the watchdog too."""
    _watch["started"] = time.monotonic()
    _arm_watchdog(session.config)


def pytest_runtest_logstart(nodeid, location):
    _watch["started"] = time.monotonic()


@pytest.hookimpl(trylast=True)
def pytest_exception_interact(node, call, report):
    """pytest's faulthandler plugin cancels the watchdog as soon as a test fails (for a debugger); the rest of
    that test, its teardown above all, stays under it here unless a debugger is in use."""
    if node.config.getoption("usepdb", False):
        return
    _arm_watchdog(node.config, max(1.0, _watchdog_timeout(node.config) - (time.monotonic() - _watch["started"])))


@pytest.hookimpl(tryfirst=True)
def pytest_sessionfinish(session):
    """From the end of the last test to the process's exit (the report, ``atexit``, the interpreter's last
    garbage collections, non-daemon threads) under the watchdog; never cancelled: the exit ends its thread."""
    _watch["started"] = time.monotonic()
    _arm_watchdog(session.config)


@pytest.hookimpl(tryfirst=True)     # before `-m` deselects
def pytest_collection_modifyitems(config, items):
    for item in items:
        if "ros_context" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.dds)     # its rclpy context is there to start nodes
    if os.environ.get("PYTEST_XDIST_WORKER"):
        _long_modules_first(items)
    if ROS_AVAILABLE:
        return
    skip = pytest.mark.skip(reason="rclpy or the built oxygen_ros messages are not importable: run `make test`")
    for item in items:
        if "ros" in item.keywords:
            item.add_marker(skip)


# A test marked slow (a build, a benchmark end to end, the demo: 10-190 s on 2 cores) against one that only starts
# nodes (dds: 2-20 s), for the order of modules under pytest-xdist.
SLOW_WEIGHT = 5


def _long_modules_first(items: list) -> None:
    """Reorder ``items`` in place, module by module, by the module's expected length: :data:`SLOW_WEIGHT` per
    ``slow`` test plus one per other ``dds`` test (most first; ties and the tests inside a module keep their
    order). pytest-xdist's ``--dist loadfile`` hands out whole modules in collection order: the long ones first,
    the short ones fill in at the end, and the workers finish together instead of one running the packaging
    build or the demo alone at the end (``make test``)."""
    modules: dict[str, list] = {}
    for item in items:
        modules.setdefault(item.nodeid.split("::", 1)[0], []).append(item)
    weight = {name: sum(SLOW_WEIGHT if "slow" in item.keywords else "dds" in item.keywords for item in group)
              for name, group in modules.items()}
    items[:] = [item for name in sorted(modules, key=lambda name: -weight[name]) for item in modules[name]]


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
