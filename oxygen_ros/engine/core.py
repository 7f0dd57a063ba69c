"""What the robots of one engine share: the model runner, one KV pool, the cycle's prefix tree, the
step-cost estimator and the cycle lock.

A single-robot :class:`~oxygen_ros.engine.engine.Engine` builds its own :class:`EngineCore` and uses
the whole pool. A :class:`~oxygen_ros.engine.fleet.Fleet` builds one and gives each robot's engine (its
lane) a share of the pool's pages: the robot's ``kv_budget_mb``, assigned at :meth:`EngineCore.assign`
and given back at :meth:`EngineCore.release`. The shares never overlap, so one robot's language
requests can never take the pages another robot's admission counted on.
"""

from __future__ import annotations

import threading
from typing import Hashable

import torch

from oxygen_ros.engine.block_pool import BlockPool
from oxygen_ros.engine.config import EngineConfig
from oxygen_ros.engine.kv_cache_manager import KVCacheManager
from oxygen_ros.engine.model_io import ModelIO
from oxygen_ros.engine.model_runner import ModelRunner, RunnerModel
from oxygen_ros.engine.prefix_cache import PrefixPlanner
from oxygen_ros.engine.scheduler import Scheduler, StepCostEstimator
from oxygen_ros.engine.threads import IntraOpThreads


class EngineCore:
    """One model's shared engine state.

    Args:
        model: the VLA (:class:`~oxygen_ros.engine.model_runner.RunnerModel`).
        processor: the runner's default pre/post-processing (a fleet's robots bring their own).
        config: the pool (``kv_budget_mb``, ``block_size``), ``cuda_graphs``, ``cpu_compile``,
            ``intra_op_threads`` and the step-cost estimator's ``step_cost_quantile`` / ``step_cost_window``.

    Attributes:
        pool, manager, runner, planner, estimator: the KV pool and its manager, the model runner,
            the cycle's prefix planner (one tree for every robot: their keys carry the robot id),
            the online step-cost estimate.
        threads: the intra-op thread count (:class:`~oxygen_ros.engine.threads.IntraOpThreads`), chosen after
            every cycle for the next.
        lock: held while any robot's cycle, flush or close runs.
    """

    def __init__(self, model: RunnerModel, processor: ModelIO | None, config: EngineConfig):
        cfg = model.config
        # Sampled first, so that a long construction (a model's compile) is the first window measured.
        self.threads = IntraOpThreads(config.intra_op_threads, enabled=torch.device(model.device).type == "cpu")
        self.pool = BlockPool(cfg.vlm_num_layers, cfg.num_kv_heads, cfg.head_dim,
                              config.block_size, config.kv_budget_bytes, dtype=model.dtype,
                              device=model.device)
        self.manager = KVCacheManager(self.pool)
        self.runner = ModelRunner(model, processor, self.manager, config.cuda_graphs, config.cpu_compile,
                                  guided=config.rtc.enabled)
        self.planner = PrefixPlanner(self.manager, self.runner, cfg.prompt_mask)
        self.estimator = StepCostEstimator(config.step_cost_quantile, config.step_cost_window)
        self.lock = threading.Lock()
        self._shares: dict[Hashable, int] = {}
        self.threads.update()

    @property
    def unassigned_blocks(self) -> int:
        """Pages of the pool no robot's share holds."""
        return self.pool.num_blocks - sum(self._shares.values())

    @property
    def shares(self) -> dict[Hashable, int]:
        """Pages assigned per robot id."""
        return dict(self._shares)

    def assign(self, robot: Hashable, budget_bytes: int) -> int:
        """Give ``robot`` a share of ``budget_bytes`` (whole pages); returns its pages.

        Raises:
            ValueError: ``robot`` already has a share, or the unassigned pages cannot hold it (the
                message names both sizes).
        """
        if robot in self._shares:
            raise ValueError(f"robot {robot!r} already has a share of the KV pool")
        pages = budget_bytes // self.pool.bytes_per_block
        if pages > self.unassigned_blocks:
            raise ValueError(f"robot {robot!r}: a KV share of {pages} pages "
                             f"({budget_bytes / 2**20:.2f} MiB) does not fit in the "
                             f"{self.unassigned_blocks} unassigned pages of the shared pool; lower "
                             "its kv_budget_mb or raise the fleet's")
        self._shares[robot] = pages
        return pages

    def release(self, robot: Hashable) -> None:
        """Return ``robot``'s share to the unassigned pages (no-op without one)."""
        self._shares.pop(robot, None)

    def scheduler(self, config: EngineConfig, action_reserve_blocks: int, robot: Hashable = None,
                  shared: bool = False) -> Scheduler:
        """The :class:`Scheduler` of one robot's requests: over the whole pool, or (``shared``: a
        fleet's lane) over ``robot``'s share of ``config.kv_budget_bytes``, assigned here and given
        back when the scheduler refuses it.

        Raises:
            ValueError: the share does not fit (:meth:`assign`), or the pool (share) cannot hold
                ``action_reserve_blocks``.
        """
        share = self.assign(robot, config.kv_budget_bytes) if shared else None
        try:
            return Scheduler(config, self.manager, action_reserve_blocks, share)
        except ValueError:
            if shared:
                self.release(robot)
            raise
