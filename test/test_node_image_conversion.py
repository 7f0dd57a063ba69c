"""Image and CompressedImage → uint8 [H, W, 3] RGB: every accepted encoding, row padding, and the
malformed messages the node must drop (with the drop counter's reason)."""
from __future__ import annotations

import numpy as np
import pytest

pytestmark = pytest.mark.ros

RGB = np.arange(2 * 3 * 3, dtype=np.uint8).reshape(2, 3, 3) * 7    # 2 rows, 3 columns


def _image(pixels: np.ndarray, encoding: str, padding: int = 0):
    from sensor_msgs.msg import Image

    height, width = pixels.shape[:2]
    rows = pixels.reshape(height, -1)
    step = rows.shape[1] + padding
    padded = np.full((height, step), 255, dtype=np.uint8)
    padded[:, :rows.shape[1]] = rows
    return Image(height=height, width=width, encoding=encoding, step=step, data=padded.tobytes())


@pytest.mark.parametrize("padding", [0, 5])
@pytest.mark.parametrize("encoding", ["rgb8", "bgr8", "rgba8", "bgra8"])
def test_color_encodings_with_and_without_row_padding(encoding, padding):
    from oxygen_ros.node.image_conversion import image_to_rgb

    channels = RGB[..., ::-1] if encoding.startswith("bgr") else RGB
    if encoding.endswith("a8"):
        channels = np.concatenate([channels, np.full((2, 3, 1), 9, dtype=np.uint8)], axis=2)
    out = image_to_rgb(_image(channels, encoding, padding))
    assert out.dtype == np.uint8 and out.shape == (2, 3, 3) and out.flags.c_contiguous
    np.testing.assert_array_equal(out, RGB)


def test_mono8_becomes_grey_rgb():
    from oxygen_ros.node.image_conversion import image_to_rgb

    grey = RGB[..., 0]
    out = image_to_rgb(_image(grey[..., None], "mono8", padding=3))
    np.testing.assert_array_equal(out, np.repeat(grey[..., None], 3, axis=2))


@pytest.mark.parametrize("reason, changes", [
    ("unsupported_encoding", {"encoding": "16UC1"}),
    ("unsupported_encoding", {"encoding": "bayer_rggb8"}),
    ("zero_size", {"height": 0, "data": b""}),
    ("zero_size", {"width": 0}),
    ("bad_step", {"step": 8}),
    ("bad_data_length", {"data": bytes(17)}),
    ("bad_data_length", {"step": 10}),
])
def test_malformed_raw_images_raise_with_a_reason(reason, changes):
    from oxygen_ros.node.image_conversion import ImageConversionError, image_to_rgb

    msg = _image(RGB, "rgb8")
    for field, value in changes.items():
        setattr(msg, field, value)
    with pytest.raises(ImageConversionError) as error:
        image_to_rgb(msg)
    assert error.value.reason == reason


@pytest.mark.parametrize("extension", [".jpg", ".png"])
def test_compressed_images_decode_to_rgb(extension):
    import cv2
    from sensor_msgs.msg import CompressedImage

    from oxygen_ros.node.image_conversion import compressed_to_rgb

    pixels = np.zeros((16, 24, 3), dtype=np.uint8)
    pixels[..., 0] = 200    # red in RGB
    ok, encoded = cv2.imencode(extension, pixels[..., ::-1])
    assert ok
    out = compressed_to_rgb(CompressedImage(format=extension[1:], data=encoded.tobytes()))
    assert out.shape == (16, 24, 3)
    assert abs(int(out[..., 0].mean()) - 200) < 5 and out[..., 2].mean() < 5


@pytest.mark.parametrize("reason, data", [
    ("zero_size", b""),
    ("corrupt_compressed", b"\xff\xd8\xff\xe0" + bytes(200)),
    ("corrupt_compressed", b"not an image at all"),
])
def test_corrupt_compressed_images_raise(reason, data):
    from sensor_msgs.msg import CompressedImage

    from oxygen_ros.node.image_conversion import ImageConversionError, compressed_to_rgb

    with pytest.raises(ImageConversionError) as error:
        compressed_to_rgb(CompressedImage(format="jpeg", data=data))
    assert error.value.reason == reason
