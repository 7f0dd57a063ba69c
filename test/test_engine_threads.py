"""Intra-op threads that follow the machine (oxygen_ros/engine/threads.py), on /proc/stat files of the test's own."""

import pytest
import torch

from engine_support import ByteIO, engine_config, observation, tiny_model
from oxygen_ros.engine import Engine
from oxygen_ros.engine import threads as threads_mod
from oxygen_ros.engine.threads import IntraOpThreads, read_cpu_stat, threads_for_free_cores


@pytest.fixture(autouse=True)
def _restore_torch_threads():
    saved = torch.get_num_threads()
    yield
    torch.set_num_threads(saved)


class Machine:
    """A two-CPU /proc/stat file, a clock and this process's CPU seconds, advanced by :meth:`tick`."""

    def __init__(self, path):
        self.path, self.now, self.busy_ticks, self.own = path, 100.0, 0, 0.0
        self.tick(0.0, 0.0, 0.0)

    def tick(self, seconds: float, others: float, own: float) -> None:
        """``seconds`` pass with ``others`` and ``own`` cores busy."""
        hz = threads_mod.os.sysconf("SC_CLK_TCK")
        self.now += seconds
        self.own += own * seconds
        self.busy_ticks += round((others + own) * seconds * hz)
        user = self.busy_ticks
        self.path.write_text(f"cpu  {user} 0 0 1000 0 0 0 0 0 0\ncpu0 {user} 0 0 500 0 0 0 0 0 0\n"
                             f"cpu1 0 0 0 500 0 0 0 0 0 0\nintr 1\n")

    def policy(self, setting=0, **kwargs) -> IntraOpThreads:
        return IntraOpThreads(setting, stat_path=self.path, clock=lambda: self.now, own_cpu=lambda: self.own, **kwargs)


def test_free_cores_give_the_count():
    assert threads_for_free_cores(2.0, 2) == 2
    assert threads_for_free_cores(1.8, 2) == 2
    assert threads_for_free_cores(1.7, 2) == 1      # a core less than 75 % free does not count
    assert threads_for_free_cores(0.1, 2) == 1
    assert threads_for_free_cores(7.9, 4) == 4      # never more than the usable CPUs


def test_read_cpu_stat_parses_and_refuses(tmp_path):
    machine = Machine(tmp_path / "stat")
    machine.tick(1.0, 1.0, 0.0)
    busy, cpus = read_cpu_stat(machine.path)
    assert cpus == 2 and busy == pytest.approx(1.0, abs=0.02)
    (tmp_path / "bad").write_text("cpu  a b c\n")
    assert read_cpu_stat(tmp_path / "bad") is None and read_cpu_stat(tmp_path / "missing") is None


def test_the_count_follows_the_others_load_after_two_agreeing_windows(tmp_path, monkeypatch):
    monkeypatch.setattr(threads_mod.os, "sched_getaffinity", lambda _pid: {0, 1})
    torch.set_num_threads(2)
    machine = Machine(tmp_path / "stat")
    policy = machine.policy()
    machine.tick(0.5, 1.0, 1.0)               # a hog on one core: one window says 1 thread
    assert policy.update() == 2 and policy.others == pytest.approx(1.0, abs=0.05)
    machine.tick(0.01, 1.0, 1.0)              # a window too short to measure: nothing changes
    assert policy.update() == 2
    machine.tick(0.5, 1.0, 1.0)               # the second agreeing window applies it
    assert policy.update() == 1 and torch.get_num_threads() == 1 and policy.changes == 1
    machine.tick(0.5, 0.05, 1.0)              # the hog ends: one window is not enough ...
    assert policy.update() == 1
    machine.tick(0.5, 1.0, 1.0)               # ... and a window that disagrees starts over
    assert policy.update() == 1
    machine.tick(0.5, 0.0, 2.0)
    assert policy.update() == 1
    machine.tick(0.5, 0.0, 2.0)
    assert policy.update() == 2 and torch.get_num_threads() == 2 and policy.changes == 2


def test_probe_cycles_move_the_count_to_the_faster_one_and_back(tmp_path, monkeypatch):
    monkeypatch.setattr(threads_mod.os, "sched_getaffinity", lambda _pid: {0, 1})
    torch.set_num_threads(2)
    machine = Machine(tmp_path / "stat")
    policy = machine.policy()
    seconds = {1: 0.10, 2: 0.20}            # two threads slower although both cores are free

    def cycles(n):
        used = []
        for _ in range(n):
            machine.tick(0.2, 0.0, 1.0)
            count = policy.update()
            assert torch.get_num_threads() == count
            used.append(count)
            policy.observe(seconds[count])
            assert torch.get_num_threads() == policy.threads   # a probe lasts one cycle
        return used

    used = cycles(2 * threads_mod.PROBE_EVERY)
    assert policy.target == 2 and used.count(1) == 2 and policy.threads == 1 and policy.changes == 1
    assert used[:threads_mod.PROBE_EVERY - 1] == [2] * (threads_mod.PROBE_EVERY - 1)   # probes only now and then
    seconds = {1: 0.20, 2: 0.10}            # now two threads pay: the probes at 2 bring it back
    cycles(2 * threads_mod.PROBE_EVERY)
    assert policy.threads == 2 and policy.changes == 2 and policy.probes == 4
    seconds = {1: 0.195, 2: 0.20}           # within 10 %: no change
    cycles(3 * threads_mod.PROBE_EVERY)
    assert policy.threads == 2 and policy.changes == 2


def test_what_the_probes_chose_survives_a_load_that_comes_and_goes(tmp_path, monkeypatch):
    """Beside a bursty load the free cores' target flips 2 -> 1 -> 2; the count the probes found faster under
    target 2 is kept when that target returns, and a probe's win still counts across such a flip."""
    monkeypatch.setattr(threads_mod.os, "sched_getaffinity", lambda _pid: {0, 1})
    torch.set_num_threads(2)
    machine = Machine(tmp_path / "stat")
    policy = machine.policy()
    seconds = {1: 0.10, 2: 0.20}            # two threads slower although the windows see a free core

    def cycle(others=0.0):
        machine.tick(0.2, others, 1.0)
        count = policy.update()
        policy.observe(seconds[count])
        return count

    def burst():                             # two windows with a core busy, then two with it free
        return [cycle(1.0), cycle(1.0), cycle(), cycle()]

    used = [cycle() for _ in range(threads_mod.PROBE_EVERY)]
    assert used[-1] == 1 and policy.threads == 2             # the first probe won ...
    assert burst()[1:] == [1, 1, 2] and policy.target == 2   # ... the target flips to 1 and back ...
    used = [cycle() for _ in range(threads_mod.PROBE_EVERY - 4)]
    assert policy.threads == 1 and policy.changes == 3       # ... and the second probe's win still counts
    assert burst() == [1, 1, 1, 1] and policy.target == 2    # 2 -> 1 -> 2 again: the probed count stays
    assert policy.threads == 1 and policy.changes == 3
    seconds = {1: 0.20, 2: 0.10}            # the up-probes find two threads faster again
    for _ in range(2 * threads_mod.PROBE_EVERY):
        cycle()
    assert policy.threads == 2 and policy.changes == 4


def test_a_fixed_setting_and_off_the_cpu_stay_put(tmp_path):
    machine = Machine(tmp_path / "stat")
    torch.set_num_threads(2)
    fixed = machine.policy(1)
    assert torch.get_num_threads() == 1 and not fixed.automatic
    for _ in range(3):
        machine.tick(1.0, 0.0, 0.0)
        assert fixed.update() == 1
    torch.set_num_threads(2)
    off = machine.policy(0, enabled=False)
    for _ in range(3):
        machine.tick(1.0, 1.5, 0.0)
        assert off.update() == 2 and torch.get_num_threads() == 2
    with pytest.raises(ValueError, match="intra_op_threads"):
        machine.policy(-1)


def test_without_proc_stat_the_count_is_torchs(tmp_path):
    torch.set_num_threads(2)
    policy = IntraOpThreads(0, stat_path=tmp_path / "missing")
    assert policy.update() == 2 and policy.others is None


def test_the_engine_applies_its_setting():
    torch.set_num_threads(2)
    model = tiny_model(0)
    engine = Engine(model, ByteIO(model.config), engine_config("unified", intra_op_threads=1))
    result = engine.run_cycle(observation(0))
    assert torch.get_num_threads() == 1 and result.record.intra_op_threads == 1   # the record says what ran


def test_the_threads_bench_interleaves_settings_and_ends_its_hog(tmp_path, capsys):
    from oxygen_ros.bench import threads_bench

    out = tmp_path / "threads.json"
    result = threads_bench.main(["--settings", "0", "1", "--rounds", "1", "--frames", "1", "--warmup", "0",
                                 "--tokens", "1", "--out", str(out)])
    order = [(r["condition"], r["setting"]) for r in result["records"]]
    assert order == [("idle", 0), ("idle", 1), ("hog", 0), ("hog", 1)]
    assert all(r["threads"] == 1 for r in result["records"] if r["setting"] == 1)
    with pytest.raises(ProcessLookupError):   # the hog was killed and reaped
        threads_mod.os.kill(result["hog_pid"], 0)
    assert "hog" in capsys.readouterr().out and out.exists()
    with pytest.raises(SystemExit):
        threads_bench.main(["--rounds", "0"])
