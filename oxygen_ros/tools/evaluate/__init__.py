"""Closed-loop evaluation of the demo policy in the simulator: ``python -m oxygen_ros.tools.evaluate``.

Runs M episodes (default 20) of gym-aloha's transfer-cube task with fresh cube poses (seeds from
``--start-seed``, default 1000: disjoint from the training data's 0..99) under each condition and reports,
per condition, the success of each phase with its 95 % Wilson interval, the subtask accuracy of the
published speech and the caption accuracy of the memory entries against the simulator's ground truth, the
mean frame latency and the chunk rate; per episode a contact sheet PNG (docs/demo-policy.md, "Closed-loop
evaluation").

Conditions (``--conditions``, all by default):

* ``node-lockstep``: the oxygen node (``OxygenNode``, in this process, as ``tools/demo.py`` runs it) and a
  simulated robot in a child process, over DDS, on simulated time: the robot publishes ``/clock`` and the
  node runs with ``use_sim_time``. Lockstep: the robot renders the cameras at sim time t, publishes them
  and the joint state (stamped t), waits (wall clock) for an action chunk stamped ≥ t, executes
  ``--execute-steps`` of its actions (advancing ``/clock`` by 20 ms per step) and repeats. Physics is
  paused while the node computes. The node's code needs no change, only parameters: every input is
  subscribed reliably (the robot publishes each once per frame: a lost best-effort sample would never be
  replaced), and with ``staleness_limit_s`` below one control step and every camera required, a frame is
  usable only while ``/clock`` stands at its stamp, so the
  node's (wall-clock) cycle runs exactly once per complete fresh observation and skips otherwise
  (``no_observation``, ``clock_paused``); ``control_rate_hz`` only sets how often it looks.
* ``node-realtime``: the same node with the demo's robot (:class:`~oxygen_ros.tools.sim_robot.SimRobot`,
  real-time physics, cameras rendered round robin at ``--camera-rate``) and the demo's rates.
* ``sync``: the engine called synchronously, without ROS, in the lockstep schedule; built from the same
  node parameters by the node's own code (``settings_from_values``, ``model_loading.build_engine``, which uses
  :mod:`oxygen_ros.engine.factory`), fed the same images, state and stamps.
* ``random``: as ``sync`` with the preset's seeded random weights (no checkpoint; the checkpoint's
  normalisation statistics), the floor.
* ``expert``: demo_data's scripted expert (:func:`~oxygen_ros.tools.demo_data.expert_joint_trajectory`)
  replayed on the eval seeds in the lockstep schedule, the ceiling (its "speech" is its script's label,
  so its subtask accuracy is the agreement of the script with the ground-truth mapping).

Chunk execution (``--ensemble M``, every condition but ``expert``): 0 (default) executes the newest chunk
(in lockstep: each chunk's first ``--execute-steps`` actions); M ≠ 0 averages, at every control step, the
predictions of all the chunks that cover the step with ACT's temporal-ensembling weights ``exp(−M·i)``
(:mod:`oxygen_ros.tools.chunk_execution`; ``node-realtime``: the robot's ``temporal_ensemble_m``). In
lockstep a chunk arrives every ``--execute-steps`` steps, so up to ``ceil(H / execute_steps)`` overlap.

Output (``--out``, default ``runs/eval-<timestamp>``): ``eval.json`` (everything), ``eval.md`` (the table,
also printed), ``<condition>/episode_<seed>.png`` (contact sheets), ``node_params_<condition>.yaml``.

Command line: ``python -m oxygen_ros.tools.evaluate`` (the shipped policy; ``--checkpoint runs/train-demo/checkpoint`` for a retrained one; ``--help``);
``make eval-demo EVAL_ARGS="..."``.
"""

from __future__ import annotations

import os

# MuJoCo picks its OpenGL backend when it is imported: OSMesa works without a display.
os.environ.setdefault("MUJOCO_GL", "osmesa")
os.environ.setdefault("PYOPENGL_PLATFORM", os.environ["MUJOCO_GL"])

# The package's public surface. Its modules: episode (the simulated episode and its ground truth), conditions (each
# condition's node parameters), sync (the synchronous conditions; the node's settings from a plain mapping),
# node_runs (the node conditions), workers (their robot child processes), scoring, report, cli.
from oxygen_ros.tools.evaluate.cli import evaluate, main, parse_args  # noqa: E402
from oxygen_ros.tools.evaluate.conditions import CONDITIONS, label_tokens, node_parameters  # noqa: E402
from oxygen_ros.tools.evaluate.episode import (EPISODE_STEPS, SHEET_TIMES_S, EpisodeSim,  # noqa: E402
                                               sheet_times)
from oxygen_ros.tools.evaluate.node_runs import EPISODE_CLOCK_S, run_node_condition  # noqa: E402
from oxygen_ros.tools.evaluate.scoring import outcome, phase_times, score_episode, summarise  # noqa: E402
from oxygen_ros.tools.evaluate.sync import EnginePolicy, ExpertPolicy, run_sync_episode  # noqa: E402

__all__ = ["CONDITIONS", "EPISODE_CLOCK_S", "EPISODE_STEPS", "SHEET_TIMES_S", "EnginePolicy", "EpisodeSim",
           "ExpertPolicy", "evaluate", "label_tokens", "main", "node_parameters", "outcome", "parse_args", "phase_times",
           "run_node_condition", "run_sync_episode", "score_episode", "sheet_times", "summarise"]
