"""Parameter checks of ``oxygen_node``: what configure refuses (FAILURE with the reason, in the node's own
parameter names) and how the installed executable ends on parameters rclpy rejects before the node exists
(one line, exit code 2, no traceback) or when autostart's configure fails (exit code 1, not idle forever).
"""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from node_support import EXECUTABLE, REPO_ROOT, tiny_parameters

pytestmark = [pytest.mark.ros, pytest.mark.dds]     # starts nodes

TINY = REPO_ROOT / "config" / "pi05_tiny.yaml"


def _configure(ros_context, **changes):
    """A node with the tiny config plus ``changes`` (no autostart), configured once: (node, success)."""
    from rclpy.lifecycle import TransitionCallbackReturn

    from oxygen_ros.node.oxygen_node import OxygenNode

    node = OxygenNode(context=ros_context, parameter_overrides=tiny_parameters(autostart=False, **changes))
    return node, node.trigger_configure() == TransitionCallbackReturn.SUCCESS


@pytest.mark.parametrize("preset", ["pi05", "pi0"])
def test_full_preset_without_checkpoint_fails_to_configure(ros_context, preset):
    node, ok = _configure(ros_context, preset=preset)
    try:
        assert not ok and node.engine is None and node.lifecycle_state == "unconfigured"
        assert "checkpoint" in node.configure_error and "allow_random_weights" in node.configure_error
    finally:
        node.destroy_node()


def test_allow_random_weights_lets_a_full_preset_pass_the_check(ros_context):
    """The explicit opt-in passes validation (the 3B model itself is not loaded here)."""
    from oxygen_ros.node.oxygen_node import OxygenNode
    from oxygen_ros.node.parameters import read_settings

    node = OxygenNode(context=ros_context, parameter_overrides=tiny_parameters(
        autostart=False, preset="pi05", allow_random_weights=True))
    try:
        assert read_settings(node).allow_random_weights
    finally:
        node.destroy_node()


def test_settings_come_from_a_plain_mapping_as_from_the_node(ros_context):
    """``settings_from_values`` builds the node's settings from a dict (no node, no stand-in): the names it
    lacks take their declared defaults, and the result equals what the node reads from the same values."""
    from oxygen_ros.node.oxygen_node import OxygenNode
    from oxygen_ros.node.parameters import default_value, read_settings, settings_from_values

    overrides = tiny_parameters(autostart=False)
    values = {p.name: p.value for p in overrides}
    logged = []
    settings = settings_from_values(values, logged.append)
    assert settings.preset == "pi05_tiny" and settings.joint_names == tuple(values["joint_names"])
    assert "joint_states_reliability" not in values       # a name not given takes its declared default
    assert settings.joint_states_reliability == default_value("joint_states_reliability")
    assert len(logged) == 1 and logged[0].startswith("conventions ")
    node = OxygenNode(context=ros_context, parameter_overrides=overrides)
    try:
        assert read_settings(node) == settings
    finally:
        node.destroy_node()
    with pytest.raises(ValueError, match="camera_topic"):
        settings_from_values(dict(values, camera_topic=["/cam"]))     # a misspelt name is not ignored
    with pytest.raises(ValueError, match="parameter joint_names"):
        settings_from_values(dict(values, joint_names=[]))


def test_real_time_chunking_parameters_reach_the_engine():
    """The rtc.* parameters become the engine's EngineConfig.rtc, its action step the node's action_dt_s (the
    parameter, else the family's); off by default."""
    from oxygen_ros.node.parameters import settings_from_values

    values = {p.name: p.value for p in tiny_parameters(autostart=False)}
    assert not settings_from_values(values).engine.rtc.enabled
    settings = settings_from_values(dict(values, **{"rtc.enabled": True, "rtc.delay_mode": "fixed",
                                                    "rtc.fixed_delay_steps": 3, "rtc.schedule": "exp",
                                                    "action_dt_s": 0.02}))
    rtc = settings.engine.rtc
    assert (rtc.enabled, rtc.delay_mode, rtc.fixed_delay_steps, rtc.schedule) == (True, "fixed", 3, "exp")
    assert rtc.action_dt_s == settings.action_dt_s == 0.02
    with pytest.raises(ValueError, match="rtc.schedule"):
        settings_from_values(dict(values, **{"rtc.schedule": "cosine"}))


def test_unknown_camera_slot_fails_listing_the_valid_slots(ros_context):
    node, ok = _configure(ros_context, camera_slots=["foo_rgb", "left_wrist_0_rgb"])
    try:
        assert not ok and node.engine is None
        assert "foo_rgb" in node.configure_error
        for slot in ("base_0_rgb", "left_wrist_0_rgb", "right_wrist_0_rgb"):
            assert slot in node.configure_error
    finally:
        node.destroy_node()


@pytest.mark.parametrize("name, names, others", [
    ("joint_names", ["joint_1", "joint_2", "joint_3", "joint_4", "joint_5", "joint_6", "joint_1"], {}),
    ("action_names", ["a0", "a1", "a2", "a3", "a4", "a5", "a1"], {"trajectory_joint_names": ["a0", "a2"]}),
    ("trajectory_joint_names", ["joint_1", "joint_2", "joint_1"], {}),
])
def test_a_joint_named_twice_fails_to_configure(ros_context, name, names, others):
    """A name repeated in the state, the action dimensions or the trajectory's joints is refused at configure,
    naming the parameter and the repeated name (a JointTrajectory naming a joint twice is ambiguous)."""
    node, ok = _configure(ros_context, **{name: names}, **others)
    try:
        assert not ok and node.engine is None and node.lifecycle_state == "unconfigured"
        assert f"parameter {name}" in node.configure_error and "unique" in node.configure_error
        assert names[-1] in node.configure_error
    finally:
        node.destroy_node()


def test_camera_slots_reach_the_model_in_its_order_by_name(ros_context):
    """camera_topics lists the wrist camera first: the model still sees base_0_rgb first, and each
    topic's frames go to the slot it names."""
    node, ok = _configure(ros_context, camera_slots=["left_wrist_0_rgb", "base_0_rgb"],
                          camera_required=[False, True])
    try:
        assert ok, node.configure_error
        engine = node.engine
        assert tuple(engine.config.camera_slots) == ("base_0_rgb", "left_wrist_0_rgb")
        import numpy as np

        from oxygen_ros.node.inputs import Frame

        inputs = node._inputs
        topics = {c.topic: c.slot for c in node._settings.cameras}
        assert topics == {"camera/image_raw": "left_wrist_0_rgb",
                          "wrist_camera/image_raw/compressed": "base_0_rgb"}
        wrist = np.zeros((24, 32, 3), np.uint8)
        base = np.full((24, 32, 3), 255, np.uint8)
        from builtin_interfaces.msg import Time

        inputs.store_frame("left_wrist_0_rgb", Frame(wrist, Time(sec=5), 100.0))
        inputs.store_frame("base_0_rgb", Frame(base, Time(sec=5), 100.0))
        inputs.store_joint_state(np.zeros(7, np.float32), 100.0)
        ready = inputs.observation(lambda: 100.1, 0.5, 0)
        assert not isinstance(ready, str), ready
        images = ready.observation.images
        assert images["base_0_rgb"] is base and images["left_wrist_0_rgb"] is wrist
    finally:
        node.destroy_node()


def test_cuda_graphs_parameter_reaches_the_engine(ros_context):
    for value in (True, False):
        node, ok = _configure(ros_context, cuda_graphs=value)
        try:
            assert ok, node.configure_error
            assert node.engine.config.cuda_graphs is value
        finally:
            node.destroy_node()


def test_kv_budget_failure_names_the_node_parameter(ros_context):
    node, ok = _configure(ros_context, **{"engine.kv_budget_mb": 1})
    try:
        assert not ok
        assert "engine.kv_budget_mb" in node.configure_error and "kv_budget_bytes" not in node.configure_error
    finally:
        node.destroy_node()


def test_camera_accept_mono16_needs_one_entry_per_camera(ros_context):
    node, ok = _configure(ros_context, camera_accept_mono16=[True])
    try:
        assert not ok and "camera_accept_mono16" in node.configure_error
    finally:
        node.destroy_node()


def test_camera_accept_mono16_lets_a_16bit_grey_camera_through():
    """Over DDS: the scene camera marked as 16-bit grayscale sends mono16 and 16UC1 frames, and action
    chunks are computed from them (the wrist camera pauses: its frames carry the same stamps)."""
    from std_msgs.msg import String

    from node_support import Harness, wait_for

    harness = Harness(tiny_parameters(control_rate_hz=4.0, camera_accept_mono16=[True, False]))
    try:
        harness.instruction.publish(String(data="pick up the red cube"))
        assert wait_for(lambda: harness.node.lifecycle_state == "active", 60.0)
        harness.publish_cam1 = False
        for encoding in ("mono16", "16UC1"):
            start = harness.count("chunk")
            harness.cam0_encoding = encoding

            def from_encoding() -> bool:
                sent = harness.cam0_stamps.get(encoding, set())
                return any((c.header.stamp.sec, c.header.stamp.nanosec) in sent
                           for c in harness.received["chunk"][start:])

            assert wait_for(from_encoding, 30.0), encoding
        assert "unsupported_encoding" not in harness.node.input_drops()
    finally:
        harness.close()


def _write(path, text):
    path.write_text(text)
    return str(path)


def test_executable_exits_cleanly_on_rejected_parameters(tmp_path):
    """Missing / malformed params file, wrong type, out of range: one line on stderr, exit code 2, no
    traceback. Autostart whose configure fails (a full preset without checkpoint): exit code 1."""
    from oxygen_ros.msg import ActionChunk  # noqa: F401  (the environment has the built package)

    cases = {
        "missing params file": (["--params-file", str(tmp_path / "missing.yaml")], 2, "missing.yaml"),
        "malformed params file": (["--params-file", _write(tmp_path / "bad.yaml",
                                                           "oxygen_node:\n  ros__parameters: [1, 2\n  x: {\n")],
                                  2, "bad.yaml"),
        "wrong type in params file": (["--params-file", _write(tmp_path / "type.yaml",
                                                               'oxygen_node:\n  ros__parameters:\n'
                                                               '    control_rate_hz: "fast"\n')],
                                      2, "control_rate_hz"),
        "out of range": (["--params-file", str(TINY), "-p", "control_rate_hz:=5000.0"], 2, "control_rate_hz"),
        "autostart configure fails": (["--params-file", str(TINY), "-p", "preset:=pi05"], 1, "checkpoint"),
    }
    processes = {name: subprocess.Popen([sys.executable, str(EXECUTABLE), "--ros-args", *args], cwd=tmp_path,
                                        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                        env=dict(os.environ))
                 for name, (args, _, _) in cases.items()}
    try:
        for name, process in processes.items():
            stdout, stderr = process.communicate(timeout=240)
            _, code, mention = cases[name]
            output = stdout + stderr
            print(f"{name}: exit {process.returncode}: {stderr.strip().splitlines()[-1:]}")
            assert process.returncode == code, f"{name}: {output}"
            assert "Traceback" not in output, f"{name}: {output}"
            assert mention in output, f"{name}: {output}"
            if code == 2:
                assert stderr.strip().splitlines()[-1].startswith("oxygen_node: "), f"{name}: {stderr}"
    finally:
        for process in processes.values():
            if process.poll() is None:
                process.kill()
                process.wait()
