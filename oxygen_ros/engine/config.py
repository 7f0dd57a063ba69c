"""Engine configuration: tasks, KV pool budget, scheduling mode; validated on construction.

Tasks are declared as data (a dict or a YAML file), never in code::

    mode: unified                 # isolated | shared_prefix | unified
    scheduling: deadline          # deadline | fixed_k
    decode_steps_per_cycle: 5     # k, used by fixed_k
    kv_budget_bytes: 67108864
    block_size: 16
    camera_slots: [base_0_rgb, left_wrist_0_rgb]
    action:
      prompt_template: "Task: {instruction}, State: {state};\\nAction: "
      control_period_s: 0.5
      num_denoise_steps: 10
    language_tasks:
      - name: speech
        prompt_template: "Task: {instruction}, State: {state};\\nAction: "
        trigger: {every_n_frames: 1}
        max_new_tokens: 20
      - name: memory
        prompt_template: "Task: {instruction}. Subtask: "
        trigger: {every_s: 2.0}
        kind: memory
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Mapping

MODES = ("isolated", "shared_prefix", "unified")
SCHEDULING = ("deadline", "fixed_k")
ADMISSION_POLICIES = ("wait", "drop")
LANGUAGE_KINDS = ("speech", "memory")


def _check_keys(cls: type, data: Mapping[str, Any], where: str) -> None:
    known = {f.name for f in fields(cls)}
    unknown = set(data) - known
    if unknown:
        raise ValueError(f"{where}: unknown keys {sorted(unknown)}; known keys: {sorted(known)}")


def _check_bool(value: Any, where: str) -> None:
    # YAML and hand-written dicts give strings such as "no", which Python would read as true.
    if not isinstance(value, bool):
        raise ValueError(f"{where} must be true or false, got {value!r}")


@dataclass(frozen=True)
class TriggerConfig:
    """When a language task starts a new request; any of the conditions fires it. With none set
    (``trigger: {}``) the task runs only on request (:meth:`Engine.submit`, e.g. a question asked over
    ROS).

    Attributes:
        every_n_frames: fire on every n-th observation (1 = every frame); None = off.
        every_s: fire when at least this many seconds of observation stamps passed since the
            task's last request; None = off. Stamps that go backwards (a bag replayed in a loop, a
            simulator's clock reset) restart the period from the new stamp.
        on_new_instruction: fire when the instruction differs from the previous observation's
            (the first observation counts as new).
    """

    every_n_frames: int | None = None
    every_s: float | None = None
    on_new_instruction: bool = False

    def __post_init__(self) -> None:
        _check_bool(self.on_new_instruction, "trigger.on_new_instruction")
        if self.every_n_frames is not None and self.every_n_frames < 1:
            raise ValueError(f"trigger.every_n_frames must be >= 1, got {self.every_n_frames}")
        if self.every_s is not None and not self.every_s > 0:
            raise ValueError(f"trigger.every_s must be > 0 s, got {self.every_s}")


@dataclass(frozen=True)
class SamplingConfig:
    """Token sampling of a language task.

    Attributes:
        temperature: 0 = greedy argmax; > 0 samples from softmax(logits / temperature).
        seed: base seed; each request's ``torch.Generator`` is seeded with ``seed + observation seq``
            so runs are reproducible across engine modes.
    """

    temperature: float = 0.0
    seed: int = 0

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"sampling.temperature must be >= 0, got {self.temperature}")


@dataclass(frozen=True)
class ActionTaskConfig:
    """The action task: runs every control cycle with a hard deadline.

    Attributes:
        prompt_template: prompt with ``{instruction}`` and optionally ``{state}`` fields.
        control_period_s: control period in seconds; the deadline of a cycle is its start plus this.
        num_denoise_steps: S, Euler steps of the flow-matching sampler (π0.5 default 10).
        noise_seed: the noise of observation ``seq`` is drawn from ``torch.Generator`` seeded with
            ``noise_seed + seq`` (same noise in every engine mode).
    """

    prompt_template: str = "{instruction}"
    control_period_s: float = 0.5
    num_denoise_steps: int = 10
    noise_seed: int = 0

    def __post_init__(self) -> None:
        if "{instruction}" not in self.prompt_template:
            raise ValueError("action.prompt_template must contain {instruction}")
        if not self.control_period_s > 0:
            raise ValueError(f"action.control_period_s must be > 0 s, got {self.control_period_s}")
        if self.num_denoise_steps < 1:
            raise ValueError(f"action.num_denoise_steps must be >= 1, got {self.num_denoise_steps}")

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "ActionTaskConfig":
        _check_keys(cls, data, "action")
        return cls(**data)


@dataclass(frozen=True)
class TaskConfig:
    """One language task (speech, memory captions, ...), decoded by the VLM's LM head.

    Attributes:
        name: unique task name, used in outputs and metrics.
        prompt_template: prompt with ``{instruction}`` and optionally ``{state}``; a task whose
            prompt equals the action task's shares the whole prefix KV with it.
        trigger: when requests start (:class:`TriggerConfig`).
        max_new_tokens: at most this many tokens are generated per request.
        stop_token_ids: generation ends after one of these tokens; None = the model's EOS.
            An empty list never stops early (benchmarks).
        sampling: greedy or temperature sampling (:class:`SamplingConfig`).
        priority: larger runs first in admission and batching, and may preempt smaller.
        admission: ``wait`` (queue until the pool holds it) or ``drop`` (end with status dropped).
        max_wait_s: a waiting request older than this (observation stamps, s) is dropped.
        cancel_on_new_instruction: a new instruction cancels this task's running requests.
        kind: ``speech`` (text events) or ``memory`` (also a :class:`MemoryEntry` when completed).
    """

    name: str
    prompt_template: str
    trigger: TriggerConfig
    max_new_tokens: int = 20
    stop_token_ids: tuple[int, ...] | None = None
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    priority: int = 0
    admission: str = "wait"
    max_wait_s: float = 5.0
    cancel_on_new_instruction: bool = False
    kind: str = "speech"

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("language task: name must be non-empty")
        if "{instruction}" not in self.prompt_template:
            raise ValueError(f"task {self.name!r}: prompt_template must contain {{instruction}}")
        if self.max_new_tokens < 1:
            raise ValueError(f"task {self.name!r}: max_new_tokens must be >= 1")
        if self.admission not in ADMISSION_POLICIES:
            raise ValueError(f"task {self.name!r}: admission must be one of {ADMISSION_POLICIES}")
        if not self.max_wait_s >= 0:
            raise ValueError(f"task {self.name!r}: max_wait_s must be >= 0 s")
        if self.kind not in LANGUAGE_KINDS:
            raise ValueError(f"task {self.name!r}: kind must be one of {LANGUAGE_KINDS}")
        _check_bool(self.cancel_on_new_instruction, f"task {self.name!r}: cancel_on_new_instruction")

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "TaskConfig":
        _check_keys(cls, data, f"language task {data.get('name', '?')!r}")
        data = dict(data)
        trigger = data.pop("trigger", None)
        if trigger is None:
            raise ValueError(f"language task {data.get('name', '?')!r}: trigger is required")
        if isinstance(trigger, Mapping):
            _check_keys(TriggerConfig, trigger, "trigger")
            trigger = TriggerConfig(**trigger)
        sampling = data.pop("sampling", {})
        if isinstance(sampling, Mapping):
            _check_keys(SamplingConfig, sampling, "sampling")
            sampling = SamplingConfig(**sampling)
        stop = data.pop("stop_token_ids", None)
        return cls(trigger=trigger, sampling=sampling,
                   stop_token_ids=None if stop is None else tuple(int(t) for t in stop), **data)


@dataclass(frozen=True)
class EngineConfig:
    """Everything the engine needs besides the model.

    Attributes:
        mode: ``isolated`` (each task its own encode + prefill + private cache, run to completion one
            after another, openpi-style), ``shared_prefix`` (one encode, one prefill per distinct
            prompt, the frame's tasks run to completion) or ``unified`` (sharing plus cross-frame
            continuous batching under the scheduler).
        scheduling: ``fixed_k`` (exactly ``decode_steps_per_cycle`` batched decode steps per cycle
            while requests are active, the OxyGen paper's k) or ``deadline`` (decode steps while the
            estimated step cost fits in the slack before the cycle's deadline). Only for unified.
        decode_steps_per_cycle: k for fixed_k.
        min_decode_steps_per_cycle: decode steps the deadline scheduler takes every cycle even
            without slack (0 = none), so language requests keep advancing when the control loop
            is overloaded instead of starving; each such step costs the next cycle its time.
        min_admissions_per_cycle: waiting requests the deadline scheduler admits (and prefills)
            every cycle even when the slack cannot pay for their prefill (0 = none), so that
            under overload language is still admitted, not only advanced: a request then ends
            only by its own task's ``max_wait_s`` / ``admission`` rule, never because the control
            loop left no slack. The pool reservation still applies.
        kv_budget_bytes: fixed byte budget of the KV pool (K and V of every layer).
        block_size: tokens per page.
        camera_slots: ordered camera slot names; the prefix concatenates cameras in this order.
        action: the action task (:class:`ActionTaskConfig`).
        language_tasks: the language tasks (:class:`TaskConfig`), unique names.
        max_batch_size: most language requests advanced by one decode step.
        max_waiting: most requests queued for admission; beyond it the oldest lowest-priority one
            is dropped.
        step_cost_quantile: quantile of recent measured step costs the deadline scheduler budgets
            with. Default 1.0, the slowest of the recent steps at that batch size, because the
            action deadline is hard: the last step of a cycle overruns whenever it is slower than
            its estimate by more than the leftover slack, so with p90 (0.9) about one cycle in 20
            missed on an H200 whose step times spread by a few ms (engine benchmark, 4 of 60).
        step_cost_window: recent measurements kept per decode batch size (and for prefill).
        slack_margin_s: seconds kept free before the deadline (timer jitter, event handling).
        metrics_window: most recent cycles and requests the metrics keep for percentiles (counters
            are running totals, so memory stays flat on a long run).
        cuda_graphs: on a CUDA device, replay the vision tower and the denoising loop from CUDA
            graphs (``VLAModel.enable_cuda_graphs``): eager launches of their thousands of small
            kernels dominate their time on a fast GPU. Ignored on the CPU.
    """

    mode: str = "unified"
    scheduling: str = "deadline"
    decode_steps_per_cycle: int = 5
    min_decode_steps_per_cycle: int = 1
    min_admissions_per_cycle: int = 1
    kv_budget_bytes: int = 64 * 2**20
    block_size: int = 16
    camera_slots: tuple[str, ...] = ("base_0_rgb",)
    action: ActionTaskConfig = field(default_factory=ActionTaskConfig)
    language_tasks: tuple[TaskConfig, ...] = ()
    max_batch_size: int = 64
    max_waiting: int = 64
    step_cost_quantile: float = 1.0
    step_cost_window: int = 32
    slack_margin_s: float = 0.002
    metrics_window: int = 1000
    cuda_graphs: bool = True

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")
        if self.scheduling not in SCHEDULING:
            raise ValueError(f"scheduling must be one of {SCHEDULING}, got {self.scheduling!r}")
        if self.decode_steps_per_cycle < 1:
            raise ValueError("decode_steps_per_cycle must be >= 1")
        if self.min_decode_steps_per_cycle < 0:
            raise ValueError("min_decode_steps_per_cycle must be >= 0")
        if self.min_admissions_per_cycle < 0:
            raise ValueError("min_admissions_per_cycle must be >= 0")
        if self.kv_budget_bytes <= 0:
            raise ValueError("kv_budget_bytes must be > 0")
        if self.block_size < 1:
            raise ValueError("block_size must be >= 1")
        if not self.camera_slots or len(set(self.camera_slots)) != len(self.camera_slots):
            raise ValueError(f"camera_slots must be non-empty and unique, got {self.camera_slots}")
        names = [t.name for t in self.language_tasks]
        if len(set(names)) != len(names):
            raise ValueError(f"language task names must be unique, got {names}")
        if self.max_batch_size < 1 or self.max_waiting < 0:
            raise ValueError("max_batch_size must be >= 1 and max_waiting >= 0")
        if not 0 < self.step_cost_quantile <= 1:
            raise ValueError("step_cost_quantile must be in (0, 1]")
        if self.step_cost_window < 1:
            raise ValueError("step_cost_window must be >= 1")
        if self.slack_margin_s < 0:
            raise ValueError("slack_margin_s must be >= 0 s")
        if self.metrics_window < 1:
            raise ValueError(f"metrics_window must be >= 1, got {self.metrics_window}")
        _check_bool(self.cuda_graphs, "cuda_graphs")

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "EngineConfig":
        """Build from a plain mapping (e.g. parsed YAML or ROS parameters).

        Raises:
            ValueError: unknown keys or invalid values (the message names the field).
        """
        _check_keys(cls, data, "engine")
        data = dict(data)
        action = data.pop("action", {})
        if isinstance(action, Mapping):
            action = ActionTaskConfig.from_dict(action)
        tasks = tuple(t if isinstance(t, TaskConfig) else TaskConfig.from_dict(t)
                      for t in data.pop("language_tasks", ()))
        if "camera_slots" in data:
            data["camera_slots"] = tuple(data["camera_slots"])
        return cls(action=action, language_tasks=tasks, **data)

    @classmethod
    def from_yaml(cls, path: str | Path) -> "EngineConfig":
        """Load from a YAML file whose top level is the mapping of :meth:`from_dict`."""
        import yaml

        with open(path, encoding="utf-8") as handle:
            data = yaml.safe_load(handle)
        if not isinstance(data, Mapping):
            raise ValueError(f"{path}: top level must be a mapping")
        return cls.from_dict(data)

    def task(self, name: str) -> TaskConfig:
        """The language task called ``name``; raises ``KeyError`` if none."""
        for task in self.language_tasks:
            if task.name == name:
                return task
        raise KeyError(f"no language task named {name!r}")
