"""oxygen_fleet_node over real DDS (loopback): three simulated robots in their namespaces on one model and
one engine. Each robot receives its own chunks, computed from its own frames (the chunk's stamp is one of
the frame stamps that robot sent, its observation_seq counts that robot's cycles); one robot's camera
stops without effect on the others; one robot is removed and re-added by service while the others run. Beyond
one server: two servers, each serving the robots its configuration assigns. Robots coming and going: a removed
robot's waiting ``~/ask`` goal gets its one result; an added robot whose configure fails is reported as failed
with the reason, leaving nothing that blocks a corrected retry."""

from __future__ import annotations

import itertools
import os

import pytest

from node_support import RobotSide, assert_own_chunks, spinning_fleet, tiny_parameters, wait_for

pytestmark = [pytest.mark.ros, pytest.mark.dds]     # starts nodes

ROBOTS = ("r1", "r2", "r3")
_IDS = itertools.count(1)
LONG = 300.0     # bounds a hang only: model load and cycles on a loaded 2-core machine


@pytest.fixture
def fleet():
    import rclpy
    from rclpy.context import Context
    from rclpy.parameter import Parameter

    from oxygen_ros.node.fleet_node import FleetNode

    base = f"/fleet_{os.getpid()}_{next(_IDS)}"
    context = Context()
    rclpy.init(context=context)
    node = FleetNode(context=context, namespace=base,
                     parameter_overrides=[Parameter("robots", value=[f"{base}/{r}" for r in ROBOTS]),
                                          Parameter("kv_budget_mb", value=64)],
                     robot_parameters=lambda robot: tiny_parameters(**{"engine.kv_budget_mb": 16}))
    sides = {r: RobotSide(context, f"{base}/{r}", 1000 * (i + 1)) for i, r in enumerate(ROBOTS)}
    with spinning_fleet(node, sides, context):
        yield node, sides, base


def _own_chunks(side: RobotSide, others: list[RobotSide], start: int = 0, end: int | None = None):
    """Every chunk ``side`` received (``start:end``: one life of its node) came from its own frames."""
    assert_own_chunks(side.records(start, end), side.sent, [other.sent for other in others])


def _call(node, side: RobotSide, service: str, robot: str):
    from oxygen_ros.srv import FleetRobot

    client = side.node.create_client(FleetRobot, f"{node.get_fully_qualified_name()}/{service}")
    assert client.wait_for_service(timeout_sec=30.0)
    future = client.call_async(FleetRobot.Request(robot=robot))
    assert wait_for(future.done, LONG)
    side.node.destroy_client(client)
    return future.result()


def test_three_robots_on_one_engine(fleet):
    node, sides, base = fleet
    # every robot gets its own chunks, from its own frames
    for side in sides.values():
        assert side.chunks_after(0), f"robots served: {node.robots}"
    assert node.server is not None and sorted(node.server.robots) == sorted(f"{base}/{r}" for r in ROBOTS)
    for name, side in sides.items():
        _own_chunks(side, [s for n, s in sides.items() if n != name])
    # r2's cameras stop: its chunks stop, r1 and r3 keep theirs
    r2_node = node.robot_node(f"{base}/r2")
    skipped = r2_node.skip_reasons().get("no_observation", 0)     # cumulative: skips before the stop count too
    sides["r2"].publishing = False
    # two skips after the stop: every frame r2 sent before it has been taken (or found stale) by then
    assert wait_for(lambda: r2_node.skip_reasons().get("no_observation", 0) >= skipped + 2, LONG)
    r2_count = len(sides["r2"].chunks)
    for name in ("r1", "r3"):
        assert sides[name].chunks_after(len(sides[name].chunks))
    assert len(sides["r2"].chunks) <= r2_count + 1      # at most the cycle in flight when it stopped
    sides["r2"].publishing = True
    assert sides["r2"].chunks_after(len(sides["r2"].chunks))
    # r3 removed by service while r1 and r2 run, then added back
    answer = _call(node, sides["r1"], "remove_robot", f"{base}/r3")
    assert answer.success, answer.message
    assert f"{base}/r3" not in node.robots and f"{base}/r3" not in node.server.robots
    assert f"{base}/r3" not in node.server.fleet.core.shares
    # A chunk published before the service answered may still be on its way over DDS (seen once in three clean-clone runs on a
    # 2-core machine): at most that one arrives while r1 and r2 each get a new chunk; after that, none.
    answered_at = len(sides["r3"].chunks)
    for name in ("r1", "r2"):
        assert sides[name].chunks_after(len(sides[name].chunks))
    assert len(sides["r3"].chunks) <= answered_at + 1
    removed_at = len(sides["r3"].chunks)
    for name in ("r1", "r2"):
        assert sides[name].chunks_after(len(sides[name].chunks))
    assert len(sides["r3"].chunks) == removed_at
    assert not _call(node, sides["r1"], "remove_robot", f"{base}/r3").success     # not served any more
    answer = _call(node, sides["r1"], "add_robot", f"{base}/r3")
    assert answer.success, answer.message
    assert not _call(node, sides["r1"], "add_robot", f"{base}/r3").success        # already served
    assert sides["r3"].chunks_after(removed_at)
    others = {name: [s for n, s in sides.items() if n != name] for name in sides}
    for name in ("r1", "r2"):
        _own_chunks(sides[name], others[name])
    # r3 before its removal and after: its re-added node counts its own cycles from 0 again
    _own_chunks(sides["r3"], others["r3"], end=removed_at)
    _own_chunks(sides["r3"], others["r3"], start=removed_at)
    assert sides["r3"].chunks[removed_at].observation_seq < sides["r3"].chunks[removed_at - 1].observation_seq
    # robots come and go by service only: the robots parameter is read-only
    from rclpy.parameter import Parameter

    assert not node.set_parameters([Parameter("robots", value=[f"{base}/r9"])])[0].successful
    assert sorted(node.robots) == sorted(f"{base}/{r}" for r in ROBOTS)


def test_two_servers_each_serve_the_robots_their_configuration_assigns():
    """Several servers (docs/fleet.md): each oxygen_fleet_node serves the robot namespaces of its own ``robots``
    parameter on its own engine; each robot gets chunks from its own frames, from the server assigned to it."""
    import rclpy
    from rclpy.context import Context
    from rclpy.parameter import Parameter

    from oxygen_ros.node.fleet_node import FleetNode

    base = f"/servers_{os.getpid()}_{next(_IDS)}"
    context = Context()
    rclpy.init(context=context)
    assignment = {"server_a": ("r1",), "server_b": ("r2", "r3")}
    servers = {name: FleetNode(context=context, namespace=f"{base}/{name}",
                               parameter_overrides=[Parameter("robots", value=[f"{base}/{r}" for r in robots]),
                                                    Parameter("kv_budget_mb", value=48)],
                               robot_parameters=lambda robot: tiny_parameters(**{"engine.kv_budget_mb": 16}))
               for name, robots in assignment.items()}
    sides = {r: RobotSide(context, f"{base}/{r}", 1000 * (i + 1)) for i, r in enumerate(ROBOTS)}
    with spinning_fleet(list(servers.values()), sides, context):
        for name, side in sides.items():
            assert side.chunks_after(0), f"{name}: no chunk"
        for name, robots in assignment.items():
            server = servers[name]
            assert sorted(server.robots) == sorted(server.server.robots) == [f"{base}/{r}" for r in robots]
        assert servers["server_a"].server.fleet is not servers["server_b"].server.fleet      # one engine each
        for name, side in sides.items():
            _own_chunks(side, [s for n, s in sides.items() if n != name])
            server = next(s for s, robots in assignment.items() if name in robots)
            other = next(s for s in assignment if s != server)
            # the assigned server's node for this robot ran the cycles; the other server has no node for it
            assert servers[server].robot_node(f"{base}/{name}").engine is not None
            with pytest.raises(KeyError):
                servers[other].robot_node(f"{base}/{name}")


def _fleet_node(base: str, robots, context, robot_parameters):
    from rclpy.parameter import Parameter

    from oxygen_ros.node.fleet_node import FleetNode

    return FleetNode(context=context, namespace=base,
                     parameter_overrides=[Parameter("robots", value=[f"{base}/{r}" for r in robots]),
                                          Parameter("kv_budget_mb", value=48)],
                     robot_parameters=robot_parameters)


def test_removing_a_robot_answers_its_waiting_ask_goal():
    """An ``~/ask`` goal waiting on a fleet robot (its cameras send nothing, so its request never starts) gets
    exactly one result when ``~/remove_robot`` removes that robot: aborted, STATUS_CANCELLED, the reason; the
    other robot keeps receiving chunks (issue 38, item 3)."""
    import rclpy
    from action_msgs.msg import GoalStatus
    from rclpy.action import ActionClient
    from rclpy.context import Context

    from oxygen_ros.action import Ask

    base = f"/fleet_goals_{os.getpid()}_{next(_IDS)}"
    context = Context()
    rclpy.init(context=context)
    node = _fleet_node(base, ("r1", "r2"), context, lambda robot: tiny_parameters(**{"engine.kv_budget_mb": 16}))
    sides = {r: RobotSide(context, f"{base}/{r}", 1000 * (i + 1)) for i, r in enumerate(("r1", "r2"))}
    sides["r2"].publishing = False
    asker = ActionClient(sides["r1"].node, Ask, f"{base}/r2/oxygen_node/ask")
    try:
        with spinning_fleet(node, sides, context):
            assert wait_for(lambda: f"{base}/r2" in node.robots
                            and node.robot_node(f"{base}/r2").lifecycle_state == "active", LONG)
            assert asker.wait_for_server(timeout_sec=30.0)
            sent = asker.send_goal_async(Ask.Goal(task="speech", instruction="what do you see?"))
            assert wait_for(sent.done, LONG) and sent.result().accepted
            result = sent.result().get_result_async()
            assert not result.done()
            answer = _call(node, sides["r1"], "remove_robot", f"{base}/r2")
            assert answer.success, answer.message
            assert wait_for(result.done, LONG), "the removed robot's goal got no result"
            response = result.result()
            assert response.status == GoalStatus.STATUS_ABORTED, response
            assert response.result.status == Ask.Result.STATUS_CANCELLED, response.result
            assert "removed from the fleet" in response.result.message, response.result.message
            assert wait_for(lambda: node.retiring == 0, LONG)     # its node destroyed after the answer
            assert sides["r1"].chunks_after(len(sides["r1"].chunks))
    finally:
        asker.destroy()


def test_add_robot_whose_configure_fails_reports_it_and_keeps_nothing():
    """``~/add_robot`` for a robot whose section names another model (seed) than the fleet serves answers
    failure with the configure error; nothing of the robot is kept, so the corrected retry succeeds and the
    robot gets its chunks (issue 38, item 9)."""
    import rclpy
    from rclpy.context import Context

    base = f"/fleet_add_{os.getpid()}_{next(_IDS)}"
    r2 = f"{base}/r2"
    wrong = {"seed": 1}     # the fleet's model is seed 0 (the first robot's)

    def parameters(robot):
        return tiny_parameters(**{"engine.kv_budget_mb": 16, **(wrong if robot == r2 else {})})

    context = Context()
    rclpy.init(context=context)
    node = _fleet_node(base, ("r1",), context, parameters)
    sides = {r: RobotSide(context, f"{base}/{r}", 1000 * (i + 1)) for i, r in enumerate(("r1", "r2"))}
    with spinning_fleet(node, sides, context):
        assert sides["r1"].chunks_after(0)
        answer = _call(node, sides["r1"], "add_robot", r2)
        assert not answer.success, answer.message
        assert "configure failed" in answer.message and "this fleet serves" in answer.message, answer.message
        assert r2 not in node.robots and r2 not in node.server.robots
        assert r2 not in node.server.fleet.core.shares
        wrong.clear()
        answer = _call(node, sides["r1"], "add_robot", r2)
        assert answer.success, answer.message
        assert node.robot_node(r2).lifecycle_state == "active"
        assert sides["r2"].chunks_after(0)
        _own_chunks(sides["r2"], [sides["r1"]])
