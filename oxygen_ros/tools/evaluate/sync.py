"""The synchronous conditions (``sync``, ``random``, ``expert``): a policy called in this process in the lockstep
schedule, without ROS — the node's engine built by the node's own code, or the scripted expert."""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

import numpy as np

from oxygen_ros.demo_task import DT, INSTRUCTION, JOINTS, SUBTASKS
from oxygen_ros.tools import demo_data
from oxygen_ros.tools.chunk_execution import ChunkExecutor
from oxygen_ros.tools.evaluate.conditions import topic_camera
from oxygen_ros.tools.evaluate.episode import ENSEMBLE_MAX_CHUNKS, EPISODE_STEPS, EpisodeSim
from oxygen_ros.tools.evaluate.report import episode_line


@dataclasses.dataclass
class Step:
    """What a policy returns for one observation."""

    actions: np.ndarray                     # float [H, 14], JOINTS order, absolute targets
    latency_s: float                        # wall time from observation to chunk [s]
    speech: list[tuple[float, str]]         # completed utterances (observation stamp, text) that ended now
    memory: list[tuple[float, str]]         # completed memory entries (observation stamp, text)
    inference_latency_s: float = 0.0        # the engine's: cycle start to chunk ready [s]


class EnginePolicy:
    """The node's engine, called synchronously: built from node parameters exactly as ``oxygen_node``
    builds it (``read_settings`` → ``model_loading.build_engine`` → warm-up), fed
    :class:`~oxygen_ros.engine.types.Observation` objects as the node's inputs make them (camera slots,
    float32 state in ``joint_names`` order, the instruction, the observation stamp, seq from 1 per episode).

    Raises:
        ValueError, FileNotFoundError: bad parameters, checkpoint or statistics (as the node's configure).
    """

    def __init__(self, params: dict):
        from oxygen_ros.node import model_loading
        from oxygen_ros.node.parameters import settings_from_values

        self.settings = settings_from_values(params)
        self.engine = model_loading.build_engine(self.settings)
        model_loading.warm_up(self.engine, self.settings)
        self.instruction = self.settings.default_instruction or INSTRUCTION
        self._slots = {topic_camera(c.topic): c.slot for c in self.settings.cameras}
        self.cameras = tuple(self._slots)     # the robot's cameras rendered for each observation
        self._seq = 0

    def start(self, seed: int) -> None:
        """A new episode: seq from 1, and the engine flushed (no request, no chunk in flight)."""
        self._seq = 0
        self.engine.flush()

    def act(self, images: dict[str, np.ndarray], position: np.ndarray, t: float) -> Step:
        from oxygen_ros.engine.types import Observation, RequestStatus

        self._seq += 1
        state = np.asarray([position[JOINTS.index(n)] for n in self.settings.joint_names], np.float32)
        obs = Observation({self._slots[c]: image for c, image in images.items()}, self.instruction, state,
                          stamp=t, seq=self._seq)
        chunks = []
        start = time.perf_counter()
        ready: list[float] = []

        def on_action(chunk) -> None:
            chunks.append(chunk)
            ready.append(time.perf_counter())

        result = self.engine.run_cycle(obs, None, on_action)
        speech, memory = [], []
        for event in result.text_events:
            if not event.final or event.status != RequestStatus.COMPLETED:
                continue
            if event.kind == "memory":
                if event.memory is not None:
                    memory.append((event.stamp, event.memory.text))
            else:
                speech.append((event.stamp, event.text))
        if not chunks:
            raise RuntimeError(f"observation {self._seq}: the engine produced no action chunk")
        actions = np.asarray(chunks[0].actions, np.float64)
        names = list(self.settings.action_names)
        if set(JOINTS) <= set(names):
            actions = actions[:, [names.index(j) for j in JOINTS]]
        return Step(actions, ready[0] - start, speech, memory, float(chunks[0].latency_s))

    def finish(self) -> None:
        """End the episode: requests still running are cancelled (their text is not scored)."""
        for request in self.engine.active_requests:
            self.engine.cancel(request.request_id)
        self.engine.take_events()

    def close(self) -> None:
        self.engine.close()


class ExpertPolicy:
    """demo_data's scripted expert: its joint trajectory for the episode's seed, chunk by chunk; its
    "speech" is the script's subtask label at the observation."""

    cameras: tuple[str, ...] = ()      # renders none (the contact sheet renders its own frames)

    def __init__(self, horizon: int = 50):
        self.horizon = horizon
        self._actions = self._labels = None
        self._step = 0

    def start(self, seed: int) -> None:
        self._actions, self._labels, _ = demo_data.expert_joint_trajectory(seed)
        self._step = 0

    def act(self, images, position, t: float) -> Step:
        k = self._step
        index = np.minimum(np.arange(k, k + self.horizon), len(self._actions) - 1)
        return Step(self._actions[index].astype(np.float64), 0.0, [(t, SUBTASKS[int(self._labels[min(k, len(self._labels) - 1)])])], [])

    def advance(self, steps: int) -> None:
        self._step += steps

    def finish(self) -> None:
        pass

    def close(self) -> None:
        pass


ARM = np.array(["gripper" not in name for name in JOINTS])   # the 12 arm joints [rad]; grippers are normalised


def run_sync_episode(policy, seed: int, execute_steps: int, max_steps: int = EPISODE_STEPS,
                     width: int = 320, height: int = 240, ensemble_m: float = 0.0, delay_steps: int = 0) -> dict:
    """One episode in the lockstep schedule with a synchronous ``policy`` (:class:`EnginePolicy` or
    :class:`ExpertPolicy`): observe, act, execute ``execute_steps`` control steps, repeat for ``max_steps``
    control steps. The chunk (stamped with the observation's clock, 20 ms per action) goes to a
    :class:`~oxygen_ros.tools.chunk_execution.ChunkExecutor` (``round`` index rule) that gives each step's
    action: with ``ensemble_m`` 0 (default) the chunk's actions 0 .. execute_steps − 1 in turn; otherwise
    ACT's temporal ensemble of every chunk covering the step.

    ``delay_steps`` d injects an inference delay as in the RTC paper's simulated-delay experiments: after each
    observation the robot executes ``d`` more steps of what it had (the chunks before; the observed position
    held before the first chunk), then the new chunk takes over for the remaining ``execute_steps − d`` steps
    (so each chunk's actions ``d .. execute_steps + d − 1`` are executed). At every take-over after the first
    the seam (:meth:`ChunkExecutor.seam`) is recorded: the largest change over the 12 arm joints of the
    command [rad] and of its velocity [rad/s], and for scale the new chunk's own largest velocity change
    from one step to the next just after the switch [rad/s] (how rough the chunks are anyway). Returns the episode record (see :func:`score_episode`).

    Raises:
        ValueError: ``ensemble_m`` not finite, or ``delay_steps`` outside ``0 .. execute_steps``.
    """
    if not 0 <= delay_steps <= execute_steps:
        raise ValueError(f"delay_steps must lie in 0 .. execute_steps ({execute_steps}), got {delay_steps}")
    chunk_executor = ChunkExecutor(ensemble_m, ENSEMBLE_MAX_CHUNKS, index_rule="round")
    sim = EpisodeSim(seed, 0.0, width, height, max_steps)
    policy.start(seed)
    speech, memory, latencies, inference, seams = [], [], [], [], []
    wall = time.perf_counter()
    try:
        while sim.step_index < max_steps:
            images, position, t = sim.observe(policy.cameras)
            step = policy.act(images, position, t)
            latencies.append(step.latency_s)
            inference.append(step.inference_latency_s)
            speech += step.speech
            memory += step.memory
            n = min(execute_steps, max_steps - sim.step_index, len(step.actions))
            for _ in range(min(delay_steps, n)):          # the inference delay: the robot goes on as it was
                held = chunk_executor.action_at(sim.now_s)
                sim.execute(np.asarray(position, np.float64) if held is None else held)
            if sim.step_index >= max_steps:
                break
            seam = chunk_executor.seam(sim.now_s, t, DT, step.actions)
            if seam is not None:
                # and, for scale, the new chunk's own velocity change one step after the switch (its roughness)
                i = min(delay_steps + 1, len(step.actions) - 2)
                own = np.abs(step.actions[i + 1] - 2 * step.actions[i] + step.actions[i - 1])[ARM].max() / DT \
                    if i >= 1 else float("nan")
                seams.append((float(np.abs(seam[0][ARM]).max()), float(np.abs(seam[1][ARM]).max()), float(own)))
            chunk_executor.add(t, DT, step.actions)
            for _ in range(n - min(delay_steps, n)):
                sim.execute(chunk_executor.action_at(sim.now_s))
            if isinstance(policy, ExpertPolicy):
                policy.advance(n)
        policy.finish()
        seconds = time.perf_counter() - wall
        record = sim.trace()
        record.update(speech=speech, memory=memory, latencies=latencies, inference_latencies=inference,
                      chunks=len(latencies), seams=seams, delay_steps=delay_steps, execute_steps=execute_steps,
                      wall_s=seconds, sim_s=sim.step_index * DT, sheet=sim.sheet)
    finally:
        sim.close()
    return record


def run_sync_condition(condition: str, params: dict, seeds: list[int], args, out_dir: Path, log, run) -> list[dict]:
    """Episodes of ``sync``, ``random`` (an :class:`EnginePolicy`) or ``expert`` for one
    :class:`~oxygen_ros.tools.evaluate.conditions.Run` (its scheme, delay and steps per chunk)."""
    policy = ExpertPolicy() if condition == "expert" else EnginePolicy(params)
    records = []
    try:
        for seed in seeds:
            record = run_sync_episode(policy, seed, run.execute_steps, args.max_steps,
                                      ensemble_m=run.ensemble_m, delay_steps=run.delay_steps)
            records.append(record)
            log(f"{run.name} episode {seed}: {episode_line(record)}")
    finally:
        policy.close()
    return records
