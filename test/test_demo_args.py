"""The demo's command line (oxygen_ros/tools/demo.py): ``--param name:=value`` is checked against the node's
parameter declarations before anything starts — an integer for a float parameter becomes a float, and an
unknown name, malformed YAML, a value of another type or one outside the declared range ends the demo with a
one-line message (SystemExit), never a traceback from the node's constructor. The same for the demo's and the
demonstration generator's (tools/demo_data.py) other arguments."""
from __future__ import annotations

import pytest

pytestmark = pytest.mark.ros     # the demo module imports rclpy and the messages


@pytest.fixture(scope="module")
def demo():
    from oxygen_ros.tools import demo

    return demo


def _param(demo, item: str):
    return demo.node_parameters(demo.parse_args(["--param", item]))[item.partition(":=")[0]]


def test_param_values_take_the_declared_types(demo):
    assert _param(demo, "speech.trigger.every_s:=2") == 2.0 and isinstance(_param(demo, "control_rate_hz:=5"), float)
    assert _param(demo, "dtype:=bfloat16") == "bfloat16"
    assert _param(demo, "autostart:=false") is False
    assert _param(demo, "joint_names:=[a, b]") == ["a", "b"]


@pytest.mark.parametrize("item, message", [
    ("no_such_param:=1", "no such parameter"),
    ("control_rate_hz:=abc", "expects a value like"),
    ("control_rate_hz:=-4", "outside its range"),
    ("control_rate_hz:=0", "must be > 0"),          # an open bound the ROS range (0 .. 1000) cannot express
    ("speech.max_new_tokens:=[1,", "not a YAML value"),
    ("autostart:=1", "expects a value like"),
    ("control_rate_hz", "not of the form name:=value"),
])
def test_bad_param_values_end_with_a_message(demo, item, message):
    with pytest.raises(SystemExit, match=message):
        _param(demo, item)


def test_an_output_directory_with_a_recording_is_refused(demo, tmp_path):
    (tmp_path / "bag").mkdir()
    with pytest.raises(SystemExit, match="already holds a recording"):
        demo.main(["--output", str(tmp_path)])
    assert not (tmp_path / "oxygen_node_params.yaml").exists()      # nothing of the earlier run overwritten


@pytest.mark.parametrize("argv", [["--duration", "0"], ["--duration", "-1"], ["--startup-timeout", "0"],
                                  ["--configure-timeout", "0"], ["--max-duration", "-5"], ["--control-rate", "0"]])
def test_non_positive_durations_are_usage_errors(demo, argv, capsys):
    with pytest.raises(SystemExit) as exit_info:
        demo.parse_args(argv)
    assert exit_info.value.code == 2 and "must be > 0" in capsys.readouterr().err


def test_the_startup_limit_counts_from_the_nodes_activation(demo):
    """A first run compiles for minutes before the node is active: the limit for the first chunk starts at
    activation; configuring has a limit of its own, and says how long it has taken while it runs."""
    class Node:
        active = False

        def receiving(self):
            return self.active

    class Log:
        def __init__(self):
            self.lines = []

        def info(self, line):
            self.lines.append(line)

    now, node, log = [0.0], Node(), Log()
    startup = demo.StartupClock(node, configure_timeout=600, startup_timeout=120, log=log, clock=lambda: now[0])
    for now[0] in (10.0, 35.0, 50.0, 300.0, 599.0):
        assert startup.expired() is None                  # configuring for up to 600 s is no failure
    assert [line.split(":")[0] for line in log.lines] == [     # at most one line per 30 s
        "the node is still configuring (35 s", "the node is still configuring (300 s",
        "the node is still configuring (599 s"]
    assert log.lines[0].endswith("loading the model; a first run on this machine also compiles the denoising steps)")
    node.active, now[0] = True, 599.5
    assert startup.expired() is None and startup.active_after == 599.5
    now[0] = 719.0
    assert startup.expired() is None                  # 119.5 s after the activation
    now[0] = 720.0
    assert startup.expired() == "no action chunk within 120 s of the node's activation"
    stuck = demo.StartupClock(Node(), configure_timeout=600, startup_timeout=120, clock=lambda: now[0])
    now[0] += 600.5
    assert stuck.expired() == "the node did not configure and activate within 600 s"


def test_the_demo_runs_an_adaptive_rate_by_default_and_a_fixed_one_on_request(demo, capsys):
    params = demo.node_parameters(demo.parse_args([]))
    assert (params["control_rate_mode"], params["control_rate_hz"]) == ("adaptive", 4.0)
    assert params["control_rate_min_hz"] == 0.0           # the node's automatic floor (1.5 Hz for 1 s chunks)
    # one intra-op thread and compiled denoising steps beside the simulator, unless overridden
    assert (params["engine.intra_op_threads"], params["cpu_compile"]) == (1, True)
    auto = demo.node_parameters(demo.parse_args(["--param", "engine.intra_op_threads:=0",
                                                 "--param", "cpu_compile:=false"]))
    assert (auto["engine.intra_op_threads"], auto["cpu_compile"]) == (0, False)
    assert demo.parse_args([]).settle_cycles == demo.SETTLE_CYCLES > 0
    # the untrained pi05_tiny's chunks span 0.2 s, shorter than any adaptive floor: a fixed rate, as asked
    assert demo.node_parameters(demo.parse_args(["--random-weights"]))["control_rate_mode"] == "fixed"
    fixed = demo.node_parameters(demo.parse_args(["--rate", "fixed", "--control-rate", "1"]))
    assert fixed["control_rate_mode"] == "fixed"
    for argv, message in ((["--settle-cycles", "-1"], "--settle-cycles must be >= 0"),
                          (["--min-control-rate", "-1"], "--min-control-rate must be >= 0 Hz"),
                          (["--min-control-rate", "5"], "--min-control-rate 5 Hz is above --control-rate 4 Hz")):
        with pytest.raises(SystemExit) as exit_info:
            demo.parse_args(argv)
        assert exit_info.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.parametrize("seed", ["-1", str(2 ** 32)])
def test_a_cube_seed_out_of_range_is_a_usage_error(demo, seed, capsys):
    """gym-aloha seeds NumPy with the cube seed (unsigned 32-bit): refused before any process starts, not as
    a traceback in the simulated robot's log."""
    with pytest.raises(SystemExit) as exit_info:
        demo.parse_args(["--seed", seed])
    assert exit_info.value.code == 2 and "--seed must be >= 0" in capsys.readouterr().err
    assert demo.parse_args(["--seed", str(2 ** 32 - 1)]).seed == 2 ** 32 - 1


@pytest.mark.parametrize("argv, message", [
    (["--episodes", "0"], "--episodes must be >= 1"), (["--workers", "0"], "--workers must be >= 1"),
    (["--image-every", "0"], "--image-every must be >= 1"), (["--width", "0"], "--width must be >= 1"),
    (["--perturb", "-1"], "--perturb must be finite and >= 0"), (["--perturb", "inf"], "--perturb must be finite"),
    (["--seed", "-1"], "--seed must be >= 0"),
    (["--seed", str(2 ** 32 - 1), "--episodes", "2"], "the last seed < 2**32")])
def test_bad_demo_data_arguments_are_usage_errors(argv, message, capsys):
    from oxygen_ros.tools import demo_data

    with pytest.raises(SystemExit) as exit_info:
        demo_data.parse_args(argv)
    assert exit_info.value.code == 2 and message in capsys.readouterr().err


def test_demo_data_refuses_an_output_directory_it_cannot_create(tmp_path):
    from oxygen_ros.tools import demo_data

    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with pytest.raises(SystemExit, match="cannot create the output directory"):
        demo_data.main(["--out", str(blocker / "data"), "--episodes", "1"])


def test_a_missing_checkpoint_is_a_usage_error_before_any_process_starts(demo, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        demo.parse_args(["--checkpoint", str(tmp_path / "missing")])
    assert exit_info.value.code == 2 and "no such directory" in capsys.readouterr().err
    assert demo.parse_args(["--checkpoint", ""]).checkpoint == ""       # '' = random weights, still allowed
