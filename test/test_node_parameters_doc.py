"""One declaration per setting: the engine's configuration fields are the node's parameters (same names,
units, ranges), they reach the node's EngineConfig unchanged, and docs/parameters.md is generated from the
declarations (checked in, kept in sync by this test)."""
from __future__ import annotations

import dataclasses

import pytest

from node_support import REPO_ROOT

pytestmark = pytest.mark.ros

REGENERATE = "source scripts/env.sh && python -m oxygen_ros.node.parameters --markdown > docs/parameters.md"


def test_parameter_page_is_the_generated_one():
    from oxygen_ros.node.parameters import markdown

    page = REPO_ROOT / "docs" / "parameters.md"
    assert page.exists(), f"docs/parameters.md is missing: run `{REGENERATE}`"
    assert page.read_text(encoding="utf-8") == markdown(), \
        f"docs/parameters.md differs from the parameter declarations: regenerate it with `{REGENERATE}`"


def test_every_engine_field_is_a_parameter_with_the_fields_range():
    from oxygen_ros.engine.config import EngineConfig, TaskConfig, leaves
    from oxygen_ros.node.parameters import DECLARATIONS, LANGUAGE_TASKS, descriptor

    by_path = {d.engine_path: d for d in DECLARATIONS.values() if d.engine_path is not None}
    expected = [leaf.path for leaf in leaves(EngineConfig)] + \
        [(task,) + leaf.path for task in LANGUAGE_TASKS for leaf in leaves(TaskConfig)]
    assert sorted(by_path) == sorted(expected)
    for path, declaration in by_path.items():
        # the parameter's last name part is the field's name: one name for one setting
        assert declaration.name.split(".")[-1] == path[-1], declaration.name
    budget = descriptor(DECLARATIONS["engine.kv_budget_mb"])
    assert (budget.integer_range[0].from_value, budget.integer_range[0].to_value) == (1, 1_000_000)
    assert "MiB" in budget.description and not budget.read_only
    every_s = descriptor(DECLARATIONS["speech.trigger.every_s"])
    assert every_s.floating_point_range[0].from_value == 0.0     # 0 = off is a valid ROS value
    assert descriptor(DECLARATIONS["autostart"]).read_only
    assert "one of isolated, shared_prefix, unified" in descriptor(DECLARATIONS["engine.mode"]).additional_constraints


def _defaults() -> dict:
    from oxygen_ros.node.parameters import DECLARATIONS

    return {name: [] if not isinstance(d.default, (bool, int, float, str, list)) else d.default
            for name, d in DECLARATIONS.items()}


def test_parameter_values_reach_the_engine_config_at_their_field():
    """Every engine parameter set to a non-default value shows up at its field of the EngineConfig the
    node builds (no hand-written mapping to forget a knob in)."""
    from oxygen_ros.engine.config import EngineConfig
    from oxygen_ros.models import get_conventions
    from oxygen_ros.node.parameters import DECLARATIONS, engine_mapping

    conventions = get_conventions("openpi/pi05_libero")
    values = _defaults()
    changed = {}
    for name, declaration in DECLARATIONS.items():
        if declaration.engine_path is None:
            continue
        default, knob = declaration.default, declaration.knob
        if isinstance(default, bool):
            value = not default
        elif knob.choices:
            value = next(c for c in knob.choices if c != default)
        elif name == "subtask_task":        # a language task's name (the subtask loop's source)
            value = "speech"
        elif name == "subtask_prompt_template":
            value = "Say: {instruction}, {subtask}"
        elif isinstance(default, str):
            value = "Say: {instruction}"
        elif default != knob.high:
            value = type(default)(knob.high)      # the top of the range: valid and not the default
        else:
            value = (knob.low + knob.high) / 2
        values[name] = changed[name] = value
    config = EngineConfig.from_dict(engine_mapping(values, conventions, ("base_0_rgb",)))
    for name, value in changed.items():
        path = DECLARATIONS[name].engine_path
        target = config.task(path[0]) if path[0] in ("speech", "memory") else config
        for key in path[1:] if path[0] in ("speech", "memory") else path:
            target = getattr(target, key)
        assert target == value, name
    assert config.action.prompt_template == conventions.action_prompt.template
    # disabled tasks are left out; an empty prompt template is the family's language prompt
    values = _defaults()
    values["memory.enabled"] = False
    config = EngineConfig.from_dict(engine_mapping(values, conventions, ("base_0_rgb",)))
    assert [t.name for t in config.language_tasks] == ["speech"]
    assert config.task("speech").prompt_template == conventions.language_prompt.template


def test_engine_errors_name_the_parameter():
    """The engine validates once and names the field as the node's parameter is called."""
    from oxygen_ros.engine.config import EngineConfig, TriggerConfig
    from oxygen_ros.models import get_conventions
    from oxygen_ros.node.parameters import engine_mapping

    conventions = get_conventions("openpi/pi05_libero")
    for name, bad in (("engine.kv_budget_mb", 0), ("engine.step_cost_quantile", 0.0),
                      ("speech.trigger.every_s", -1.0), ("memory.max_new_tokens", 0),
                      ("speech.admission", "later")):
        values = _defaults()
        values[name] = bad
        with pytest.raises(ValueError, match=name.replace(".", r"\.")):
            EngineConfig.from_dict(engine_mapping(values, conventions, ("base_0_rgb",)))
    # 0 is "off", as in the parameters
    assert dataclasses.astuple(TriggerConfig(every_n_frames=0, every_s=0.0)) == (None, None, False)
