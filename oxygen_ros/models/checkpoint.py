"""Building models from presets; loading and saving checkpoints from / to local directories only.

Layouts read (docs/models.md, "Checkpoint layouts"), detected per key:

* openpi PyTorch ``model.safetensors``: ``paligemma_with_expert.paligemma.model.{vision_tower.vision_model,
  multi_modal_projector.linear, language_model}.*``, ``paligemma_with_expert.paligemma.lm_head.weight``
  (the tied embedding), ``paligemma_with_expert.gemma_expert.model.{layers,norm}.*`` and the top-level
  action heads;
* LeRobot pi05 / pi0: the same under a leading ``model.``, ``language_model.embed_tokens.weight`` present,
  with or without the ``vision_model.`` segment, with or without ``model.`` after ``language_model.``
  or after ``paligemma.`` (the transformers version that wrote it decides);
* transformers ``PI0ForConditionalGeneration`` (π0): its in-memory names ``model.vlm.*`` (PaliGemmaModel),
  ``model.dit.*`` (expert Gemma) and ``embed_action_time.*``, and the LeRobot-style names it saves.

Keys that exist in those files but have no use at inference (the expert's LM head and token embedding,
a SigLIP pooling head) are skipped by name. Any other unknown key, any missing key and any shape
mismatch raises :class:`CheckpointError` listing them all.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from .config import VLAConfig, get_preset
from .vla import VLAModel

_PALIGEMMA = "paligemma_with_expert.paligemma."
_EXPERT = "paligemma_with_expert.gemma_expert."
_HEADS = ("action_in_proj.", "action_out_proj.", "time_mlp_in.", "time_mlp_out.", "state_proj.",
          "action_time_mlp_in.", "action_time_mlp_out.")
_IGNORED = object()
LAYOUTS = ("openpi", "lerobot", "lerobot_flat_vision")


class CheckpointError(ValueError):
    """A checkpoint that does not fit the model: missing, unexpected or mis-shaped keys."""


def _canonical(key: str):
    """Our parameter name for a checkpoint key, ``_IGNORED`` for known unused keys, None if unknown."""
    for old, new in (("model.vlm.", _PALIGEMMA + "model."), ("model.dit.", _EXPERT + "model."),
                     ("embed_action_time.", ""), ("model.", "")):
        if key.startswith(old):
            key = new + key[len(old):]
            break
    if key.startswith(_PALIGEMMA):
        rest = key[len(_PALIGEMMA):]
        rest = rest[len("model."):] if rest.startswith("model.") else rest
        if rest == "lm_head.weight":
            return "token_embedding.weight"
        if rest.startswith("vision_tower."):
            rest = re.sub(r"^vision_tower\.(vision_model\.)?", "", rest)
            return _IGNORED if rest.startswith("head.") else "vision_tower." + rest
        if rest.startswith("multi_modal_projector.linear."):
            return "projector." + rest[len("multi_modal_projector.linear."):]
        if rest.startswith("language_model."):
            rest = re.sub(r"^language_model\.(model\.)?", "", rest)
            return "token_embedding.weight" if rest == "embed_tokens.weight" else "vlm." + rest
        return None
    if key.startswith(_EXPERT):
        rest = key[len(_EXPERT):]
        if rest == "lm_head.weight" or rest == "model.embed_tokens.weight":
            return _IGNORED
        return "expert." + rest[len("model."):] if rest.startswith("model.") else None
    return key if key.startswith(_HEADS) else None


def _external_name(name: str, layout: str) -> list[str]:
    """Checkpoint key(s) of our parameter ``name`` in ``layout`` (the embedding is written tied)."""
    lead = "model." if layout != "openpi" else ""
    vision = "vision_model." if layout != "lerobot_flat_vision" else ""
    base = lead + _PALIGEMMA + "model."
    if name == "token_embedding.weight":
        names = [lead + _PALIGEMMA + "lm_head.weight"]
        return names + ([base + "language_model.embed_tokens.weight"] if layout != "openpi" else [])
    if name.startswith("vision_tower."):
        return [base + "vision_tower." + vision + name[len("vision_tower."):]]
    if name.startswith("projector."):
        return [base + "multi_modal_projector.linear." + name[len("projector."):]]
    if name.startswith("vlm."):
        return [base + "language_model." + name[len("vlm."):]]
    if name.startswith("expert."):
        return [lead + _EXPERT + "model." + name[len("expert."):]]
    return [lead + name]


def _processor_state_files(directory: Path) -> set[str]:
    """Names of the safetensors files a LeRobot processor pipeline (``policy_preprocessor.json``, ...)
    keeps its state in (normalisation statistics, not weights)."""
    names = set()
    for path in directory.glob("*.json"):
        try:
            steps = json.loads(path.read_text()).get("steps", [])
        except (OSError, ValueError, AttributeError):
            continue
        if isinstance(steps, list):
            names |= {step["state_file"] for step in steps if isinstance(step, dict) and step.get("state_file")}
    return names


def read_state_dict(checkpoint_dir: str | Path) -> dict[str, torch.Tensor]:
    """All tensors of the ``*.safetensors`` files in ``checkpoint_dir`` (local only), except the state
    files of LeRobot processor pipelines (their statistics are read by ``conventions.py``).

    Raises:
        FileNotFoundError: no such directory or no safetensors file in it.
        CheckpointError: a key present in two files; a file the safetensors library cannot read (truncated,
            corrupt header), naming the file and what is wrong with it.
    """
    directory = Path(checkpoint_dir)
    if not directory.is_dir():
        raise FileNotFoundError(f"checkpoint directory not found: {directory}")
    skipped = _processor_state_files(directory)
    files = sorted(p for p in directory.glob("*.safetensors") if p.name not in skipped)
    if not files:
        raise FileNotFoundError(f"no *.safetensors file in {directory}")
    tensors: dict[str, torch.Tensor] = {}
    for path in files:
        try:
            with safe_open(str(path), framework="pt") as f:
                for key in f.keys():
                    if key in tensors:
                        raise CheckpointError(f"key {key} appears in more than one file of {directory}")
                    tensors[key] = f.get_tensor(key)
        except CheckpointError:
            raise
        except Exception as error:   # safetensors raises its own error type, naming no file
            raise CheckpointError(f"{path}: {_safetensors_problem(path)} (safetensors: {error})") from None
    return tensors


def _safetensors_problem(path: Path) -> str:
    """What is wrong with a ``*.safetensors`` file the library refused, read from its layout: an 8-byte
    little-endian header length N, N bytes of JSON header (per tensor ``data_offsets`` [begin, end) into the
    data that follows), then the data (the safetensors format's own definition)."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            return f"truncated: {size} bytes on disk, fewer than the format's 8-byte header length"
        header_len = int.from_bytes(head, "little")
        if 8 + header_len > size:
            return (f"truncated or not a safetensors file: {size} bytes on disk, its first 8 bytes declare a "
                    f"{header_len}-byte header")
        try:
            header = json.loads(f.read(header_len))
            end = max((entry["data_offsets"][1] for name, entry in header.items() if name != "__metadata__"),
                      default=0)
        except (ValueError, TypeError, KeyError, IndexError, AttributeError):
            return f"corrupt: its {header_len}-byte header is not the format's JSON"
    if 8 + header_len + end != size:
        return (f"truncated: {size} bytes on disk, its header declares {8 + header_len + end} "
                f"({8 + header_len + end - size:+d} bytes)")
    return f"unreadable ({size} bytes on disk)"


def load_state_dict_into(model: VLAModel, tensors: dict[str, torch.Tensor]) -> None:
    """Copy checkpoint ``tensors`` (any supported layout) into ``model`` by explicit key mapping.

    Every parameter must be provided exactly once (the tied embedding may come as ``lm_head`` and as
    ``embed_tokens``, which must then be equal); values are cast to each parameter's dtype.

    Raises:
        CheckpointError: with the sorted lists of missing keys (our names), unexpected keys (checkpoint
            names), shape mismatches and inconsistent tied embeddings.
    """
    params = dict(model.named_parameters())
    mapped: dict[str, torch.Tensor] = {}
    unexpected, mismatched, conflicting = [], [], []
    for key, value in tensors.items():
        name = _canonical(key)
        if name is _IGNORED:
            continue
        if name is None or name not in params:
            unexpected.append(key)
        elif tuple(value.shape) != tuple(params[name].shape):
            mismatched.append(f"{key}: checkpoint {tuple(value.shape)} vs model {tuple(params[name].shape)}")
        elif name in mapped and not torch.equal(mapped[name], value):
            conflicting.append(f"{key} differs from another key mapped to {name}")
        else:
            mapped[name] = value
    missing = sorted(set(params) - set(mapped) - {m.split(":")[0] for m in mismatched})
    if missing or unexpected or mismatched or conflicting:
        raise CheckpointError(
            f"checkpoint does not fit {model.config.name}: missing keys {missing}; unexpected keys "
            f"{sorted(unexpected)}; shape mismatches {sorted(mismatched)}; tied embedding {conflicting}")
    with torch.no_grad():
        for name, value in mapped.items():
            params[name].copy_(value.to(params[name].dtype))


def save_checkpoint(model: VLAModel, checkpoint_dir: str | Path, layout: str = "openpi") -> Path:
    """Write ``model.safetensors`` (and ``oxygen_config.json``, the model config) in ``layout``.

    Args:
        layout: ``'openpi'`` (no prefix, ``vision_model.`` segment, tied ``lm_head`` only), ``'lerobot'``
            (leading ``model.``, ``embed_tokens`` and ``lm_head``) or ``'lerobot_flat_vision'`` (LeRobot
            without the ``vision_model.`` segment).

    Returns:
        path of the safetensors file.

    Raises:
        ValueError: unknown layout.
    """
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    directory = Path(checkpoint_dir)
    directory.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for name, param in model.named_parameters():
        for key in _external_name(name, layout):
            tensors[key] = param.detach().to("cpu").contiguous().clone()
    path = directory / "model.safetensors"
    save_file(tensors, str(path), metadata={"format": "pt"})
    config = {k: getattr(model.config, k) for k in model.config.__dataclass_fields__}
    (directory / "oxygen_config.json").write_text(json.dumps(config, indent=2))
    return path


# Fields of ``oxygen_config.json`` that never override the preset: the name (checked instead), the dtype and the
# seed (the caller's choice), the horizon and the prompt budget (set by the checkpoint family's conventions).
_NOT_FROM_CHECKPOINT = ("name", "dtype", "seed", "action_horizon", "max_token_len")


def checkpoint_overrides(checkpoint_dir: str | Path, preset: str) -> dict:
    """The model settings a checkpoint written by :func:`save_checkpoint` records differently from ``preset``.

    ``oxygen_config.json`` holds the whole :class:`VLAConfig` a model was saved with; a model trained from a
    preset with changed shapes (e.g. the demo policy at another ``image_size``) loads only with them. The
    result is ``{field: value}`` for every field that differs from the preset's, except ``name``, ``dtype``,
    ``seed``, ``action_horizon`` and ``max_token_len``; ``{}`` when the directory has no ``oxygen_config.json``
    (openpi and LeRobot checkpoints: their shapes are the preset's).

    Raises:
        ValueError: ``oxygen_config.json`` is not a JSON object, was written for another preset (its ``name``),
            or holds a field :class:`VLAConfig` does not have.
    """
    path = Path(checkpoint_dir) / "oxygen_config.json"
    if not path.is_file():
        return {}
    try:
        recorded = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise ValueError(f"{path}: not readable JSON ({err})") from None
    base = get_preset(preset)
    if not isinstance(recorded, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(recorded).__name__}")
    if recorded.get("name", base.name) != base.name:
        raise ValueError(f"checkpoint {checkpoint_dir} was written for preset {recorded['name']!r}, not {preset!r} "
                         f"(its {path.name})")
    unknown = sorted(set(recorded) - set(base.__dataclass_fields__))
    if unknown:
        raise ValueError(f"{path}: fields {unknown} are not model settings")
    values = {k: _from_json(v) for k, v in recorded.items() if k not in _NOT_FROM_CHECKPOINT}
    return {k: v for k, v in values.items() if getattr(base, k) != v}


def _from_json(value):
    """A recorded value as the config holds it: JSON's lists back to tuples (e.g. ``image_crops``)."""
    return tuple(_from_json(v) for v in value) if isinstance(value, list) else value


def load_model(preset: str | VLAConfig, checkpoint_dir: str | Path | None = None,
               dtype: torch.dtype | str | None = None, device: torch.device | str = "cpu",
               seed: int | None = None, trainable: bool = False) -> VLAModel:
    """Build the model of ``preset`` in eval mode, from a local checkpoint or with seeded random weights.

    Parameters are allocated once, on ``device`` and in ``dtype`` (norms in fp32), then filled: no
    throw-away initialisation of full-size weights.

    Args:
        preset: preset name (``pi05``, ``pi0``, ``pi05_tiny``, ``pi0_tiny``) or a :class:`VLAConfig`.
        checkpoint_dir: local directory with ``*.safetensors`` (openpi / LeRobot / transformers π0
            layouts); None = random weights from ``seed``.
        dtype: torch.float32 / torch.bfloat16 or ``'float32'``/``'bfloat16'``; default the preset's.
        device: target device.
        seed: random-init seed (default ``config.seed``); same seed and device ⇒ same weights.
        trainable: the parameters' ``requires_grad`` (default False: an inference model, whose compiled
            graphs need no weight gradient; real-time chunking differentiates with respect to the noisy
            actions only). Training passes True.

    Raises:
        ValueError: unknown preset or dtype.
        FileNotFoundError: missing directory or safetensors file.
        CheckpointError: keys or shapes that do not fit.
    """
    config = preset if isinstance(preset, VLAConfig) else get_preset(preset)
    torch_dtype = _resolve_dtype(dtype, config)
    with torch.device("meta"):
        model = VLAModel(config)
    model.to_dtype(torch_dtype)
    model.to_empty(device=device)
    model.reset_buffers()
    if checkpoint_dir is None:
        model.init_random(config.seed if seed is None else seed)
    else:
        load_state_dict_into(model, read_state_dict(checkpoint_dir))
    return model.requires_grad_(trainable).eval()


def _resolve_dtype(dtype, config: VLAConfig) -> torch.dtype:
    if dtype is None:
        return config.torch_dtype
    names = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}
    if isinstance(dtype, str):
        if dtype not in names:
            raise ValueError(f"dtype must be one of {sorted(names)}, got {dtype!r}")
        return names[dtype]
    if dtype not in names.values():
        raise ValueError(f"dtype must be torch.float32 or torch.bfloat16, got {dtype}")
    return dtype
