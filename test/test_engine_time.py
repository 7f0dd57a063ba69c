"""Time triggers when observation stamps go backwards (a bag replayed in a loop without restamping, a
simulator's clock reset): the period restarts from the new stamp instead of waiting for the stamps to
pass the old one."""
from __future__ import annotations

import pytest
import torch

from oxygen_ros.engine import Engine
from oxygen_ros.models import load_model
from engine_support import MEMORY, ByteIO, engine_config, observation

ONE_CAM = ("left_wrist_0_rgb",)


@pytest.fixture(scope="module")
def model():
    return load_model("pi05_tiny", dtype=torch.float32, seed=7)


def test_every_s_triggers_restart_when_stamps_go_backwards(model):
    memory = dict(MEMORY, trigger={"every_s": 1.0})
    engine = Engine(model, ByteIO(model.config), engine_config("unified", [memory]))
    # A 2 s bag at 4 Hz, played twice: stamps 10.0 ... 11.75, then 10.0 ... 11.75 again.
    stamps = [10.0 + 0.25 * i for i in range(8)] * 2
    events = []
    for seq, stamp in enumerate(stamps):
        events += engine.run_cycle(observation(seq, masked=ONE_CAM, stamp=stamp)).text_events
    events += engine.flush()[0]
    fired = sorted(e.seq for e in events if e.final)
    # First pass: 10.0 and 11.0. Second pass: the restart at seq 8 (stamp 10.0, below the 11.0 of the last
    # request) starts the period again from 10.0, so 11.0 (seq 12) fires; the old rule fired nothing there.
    assert fired == [0, 4, 12]


def test_small_backwards_steps_do_not_fire_early(model):
    memory = dict(MEMORY, trigger={"every_s": 1.0})
    engine = Engine(model, ByteIO(model.config), engine_config("unified", [memory]))
    # The newest frame's stamp can step back a little (an optional camera goes stale), here to just
    # below the last request's 11.0: the period restarts at 10.95, it does not fire there.
    stamps = [10.0, 10.5, 11.0, 10.95, 11.5, 11.9, 12.0]
    events = []
    for seq, stamp in enumerate(stamps):
        events += engine.run_cycle(observation(seq, masked=ONE_CAM, stamp=stamp)).text_events
    events += engine.flush()[0]
    assert sorted(e.seq for e in events if e.final) == [0, 2, 6]   # 10.0, 11.0, then 10.95 + 1.0 <= 12.0
