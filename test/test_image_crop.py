"""Camera crops (VLAConfig.image_crops): the box in fractions → pixel bounds, checked by hand; the processor crops
before its resize and refuses crops it cannot apply."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from oxygen_ros.models import RobotConfig, get_preset
from oxygen_ros.models.processing import Processor, crop_image, resize_with_pad
from oxygen_ros.models.tokenizer import load_tokenizer

FRAME = np.random.default_rng(5).integers(0, 256, (240, 320, 3), dtype=np.uint8)


def test_crop_bounds_are_the_rounded_fractions_of_the_frame():
    # rows round(0.35·240) = 84 .. round(0.81667·240) = 196, columns round(0.35·320) = 112 .. round(0.7·320) = 224
    region = crop_image(FRAME, (0.35, 0.35, 112 / 240, 0.35))
    np.testing.assert_array_equal(region, FRAME[84:196, 112:224])
    assert region.flags["C_CONTIGUOUS"]
    # the same fractions on the same view at twice the resolution: twice the pixels, the same region
    assert crop_image(np.zeros((480, 640, 3), np.uint8), (0.35, 0.35, 112 / 240, 0.35)).shape == (224, 224, 3)
    # batches and torch tensors alike; 0.1·240 = 24, 0.5·320 = 160
    batch = torch.from_numpy(np.stack([FRAME, FRAME[::-1]]))
    assert torch.equal(crop_image(batch, (0.1, 0.5, 0.25, 0.5)), batch[:, 24:84, 160:320])
    with pytest.raises(ValueError, match="covers no pixel"):
        crop_image(FRAME, (0.5, 0.5, 0.001, 0.5))          # 0.5·240 = 120 .. round(120.24) = 120: empty
    with pytest.raises(ValueError, match="must be"):
        crop_image(FRAME[..., 0], (0.0, 0.0, 1.0, 1.0))


def test_the_processor_crops_its_slot_before_the_resize_and_leaves_the_others_whole():
    config = get_preset("pi05_demo", image_crops=(("base_0_rgb", 0.35, 0.35, 112 / 240, 0.35),))
    robot = RobotConfig("sim", state_dim=14, action_dim=14, camera_slots=("base_0_rgb", "right_wrist_0_rgb"))
    processor = Processor(config, robot, load_tokenizer(config))
    pixels, mask = processor.images({"base_0_rgb": FRAME, "right_wrist_0_rgb": FRAME})
    assert mask.tolist() == [True, True]
    # 112 x 112 at the model's 112 px: no resize at all, only the scale to [-1, 1]
    expected = torch.from_numpy(FRAME[84:196, 112:224]).permute(2, 0, 1).float() / 255.0 * 2.0 - 1.0
    torch.testing.assert_close(pixels[0], expected)
    torch.testing.assert_close(pixels[1], resize_with_pad(FRAME, 112))
    assert processor.camera_view("right_wrist_0_rgb", FRAME) is FRAME


def test_crops_the_processor_cannot_apply_are_refused():
    config = get_preset("pi05_demo", image_crops=[["left_wrist_0_rgb", 0.0, 0.0, 0.5, 0.5]])   # as JSON gives it
    assert config.image_crops == (("left_wrist_0_rgb", 0.0, 0.0, 0.5, 0.5),)
    robot = RobotConfig("sim", state_dim=14, action_dim=14, camera_slots=("base_0_rgb",))
    with pytest.raises(ValueError, match="left_wrist_0_rgb"):
        Processor(config, robot, load_tokenizer(config))
    for bad in ((("base_0_rgb", 0.6, 0.0, 0.5, 0.5),), (("base_0_rgb", 0.0, 0.0, 0.0, 1.0),),
                (("base_0_rgb", 0.0, 0.0, 1.0),), (("base_0_rgb", 0, 0, 1, 1), ("base_0_rgb", 0, 0, 1, 1))):
        with pytest.raises(ValueError, match="crop"):
            get_preset("pi05_demo", image_crops=bad)
