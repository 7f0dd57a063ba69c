"""The action task's path of a cycle: the action prefix from the cycle's prefix tree, seeded flow-matching
noise, the denoising loop over the prefix KV, and the post-processed :class:`ActionChunk`.

The engine (``oxygen_ros/engine/engine.py``) runs it once per control cycle, before any language work,
and once in warm-up; the language tasks' path is ``oxygen_ros/engine/language.py``.
"""

from __future__ import annotations

import time

import torch

from oxygen_ros.engine.config import ActionTaskConfig
from oxygen_ros.engine.meter import CycleMeter
from oxygen_ros.engine.model_io import ModelIO
from oxygen_ros.engine.model_runner import ModelRunner
from oxygen_ros.engine.prefix_cache import PrefixJob, PrefixPlanner
from oxygen_ros.engine.types import ActionChunk, Observation


class ActionWork:
    """Computes one action chunk per observation.

    Args:
        config: the action task (denoising steps, noise seed).
        planner: the cycle's prefix tree and its prefills (the action prefix is a node of it, so
            language requests of the same cycle can fork from it).
        runner: the model calls.
        io: the model's pre/post-processing (state tensor in, robot actions out).
        horizon, action_dim: the model's action chunk shape ``[H, D]`` (D: the model's padded width).
    """

    def __init__(self, config: ActionTaskConfig, planner: PrefixPlanner, runner: ModelRunner, io: ModelIO,
                 horizon: int, action_dim: int):
        self._config = config
        self._planner = planner
        self._runner = runner
        self._io = io
        self._shape = (1, horizon, action_dim)

    def run(self, obs: Observation, job: PrefixJob, t0: float, meter: CycleMeter,
            subtask: str | None = None) -> ActionChunk:
        """Prefill (or find) the action prefix of ``job``, denoise from noise seeded by
        ``noise_seed + obs.seq`` (so a frame's chunk is reproducible), post-process.

        ``t0``: ``time.perf_counter()`` instant the cycle started (the chunk's ``latency_s`` counts from it);
        ``subtask``: the subtask in ``job``'s prompt (recorded on the chunk), None for the plain prompt.
        Returns the chunk in the robot's units ``[H, robot action dim]`` with ``obs``'s seq, stamp and tag.
        """
        node = self._planner.nodes([job], meter)[0]
        noise = self.noise(obs)
        with meter.phase("denoise_s"):
            actions = self._runner.denoise(node.seq, noise, self._config.num_denoise_steps,
                                           self._io.state_tensor(obs.state))
        return self.finish(obs, actions[0], t0, subtask, tuple(job.prompt_ids))

    def noise(self, obs: Observation) -> torch.Tensor:
        """The flow-matching noise ``[1, H, action_dim]`` of ``obs``: standard normal from a generator
        seeded with ``noise_seed + obs.seq``."""
        generator = torch.Generator().manual_seed(self._config.noise_seed + obs.seq)
        return torch.randn(self._shape, generator=generator)

    def finish(self, obs: Observation, actions: torch.Tensor, t0: float, subtask: str | None = None,
               prompt_ids: tuple[int, ...] = ()) -> ActionChunk:
        """The chunk of ``obs`` from the model's actions ``[H, action_dim]`` (post-processed into the
        robot's units), its latency counted from ``t0``; ``subtask`` and ``prompt_ids``: the action
        prompt's subtask (None: plain prompt) and token ids, recorded on the chunk."""
        return ActionChunk(self._io.actions_out(actions, obs.state), obs.seq, obs.stamp,
                           time.perf_counter() - t0, obs.tag, subtask, prompt_ids)
