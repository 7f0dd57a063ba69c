"""Shared fixtures of the engine tests: a deterministic test ModelIO and observation factory.

The real pre/post-processing lives in ``oxygen_ros.models``; the engine only needs the small
:class:`oxygen_ros.engine.model_io.ModelIO` protocol, implemented here with a byte-level
tokenizer so the tests depend on nothing but the model.
"""

from __future__ import annotations

import numpy as np
import torch

from oxygen_ros.engine import EngineConfig, Observation


class ByteIO:
    """Byte-level prompts (BOS = 2, then ``3 + byte``), printable detokenization, raw actions."""

    def __init__(self, model_config):
        self._vocab = model_config.vocab_size
        self._variant = model_config.variant
        self._dim = model_config.action_dim

    def camera_view(self, slot, image):
        return image

    def images_to_pixels(self, images):
        stacked = torch.from_numpy(np.stack(images)).permute(0, 3, 1, 2).float()
        stacked = torch.nn.functional.interpolate(stacked, size=(224, 224), mode="bilinear")
        return stacked / 127.5 - 1.0

    def prompt_ids(self, template, instruction, state):
        state_text = "" if state is None else " ".join(str(int(v * 10)) for v in state)
        text = template.format(instruction=instruction, state=state_text)
        return [2] + [3 + (b % (self._vocab - 3)) for b in text.encode()]

    def detokenize(self, ids):
        return "".join(chr(0x21 + (i % 94)) for i in ids)

    def state_tensor(self, state):
        if self._variant != "pi0":
            return None
        padded = torch.zeros(self._dim)
        if state is not None:
            padded[:len(state)] = torch.from_numpy(state)
        return padded

    def actions_out(self, actions, state):
        return actions.float().cpu().numpy()


def tiny_model(seed: int, prompt_mask: str = "bidirectional", preset: str = "pi05_tiny"):
    """The tiny ``preset`` with random weights of ``seed``, float32, and ``prompt_mask`` (``"causal"``: images
    and prompt attend causally instead of as one block)."""
    from oxygen_ros.models import load_model

    model = load_model(preset, dtype=torch.float32, seed=seed)
    if prompt_mask != model.config.prompt_mask:
        model.config = model.config.replace(prompt_mask=prompt_mask)
    return model


SLOTS = ("base_0_rgb", "left_wrist_0_rgb")


def observation(seq, instruction="pick up the cube", masked=(), stamp=None, size=32):
    """A deterministic observation with two camera slots (images of ``size`` px, upsampled)."""
    rng = np.random.default_rng(seq)
    images = {slot: None if slot in masked else
              rng.integers(0, 256, (size, size, 3), dtype=np.uint8) for slot in SLOTS}
    return Observation(images, instruction, rng.standard_normal(4).astype(np.float32),
                       stamp=0.1 * seq if stamp is None else stamp, seq=seq)


def engine_config(mode="unified", tasks=(), **overrides):
    """An engine config over :data:`SLOTS` with the given language task dicts."""
    data = {"mode": mode, "camera_slots": list(SLOTS), "kv_budget_mb": 8,
            "block_size": 16, "scheduling": "fixed_k", "decode_steps_per_cycle": 2,
            "action": {"prompt_template": "Task: {instruction}, State: {state};\nAction: ",
                       "control_rate_hz": 0.1},
            "language_tasks": list(tasks)}
    data.update(overrides)
    return EngineConfig.from_dict(data)


SPEECH = {"name": "speech", "prompt_template": "Task: {instruction}, State: {state};\nAction: ",
          "trigger": {"every_n_frames": 1}, "max_new_tokens": 6, "stop_token_ids": []}
MEMORY = {"name": "memory", "prompt_template": "Task: {instruction}. Subtask: ",
          "trigger": {"every_n_frames": 2}, "max_new_tokens": 4, "kind": "memory",
          "stop_token_ids": []}
