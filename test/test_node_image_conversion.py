"""Image and CompressedImage → uint8 [H, W, 3] RGB: every accepted encoding (64x48, pixel-exact against
OpenCV's own conversion), row padding, byte order, the colours each encoding means, and the malformed
messages the node must drop (with the drop counter's reason)."""
from __future__ import annotations

import zlib

import cv2
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


# encoding -> (values per pixel, bits, rows per image row (NV12/NV21: 3/2), OpenCV reference code).
# The reference codes are written here independently of oxygen_ros/node/image_conversion.py's table
# (OpenCV's explicit Bayer names, its YUYV alias), from REP 104 / sensor_msgs/image_encodings.
REFERENCE = {
    "rgb8": (3, 8, 1, None), "bgr8": (3, 8, 1, cv2.COLOR_BGR2RGB), "8UC3": (3, 8, 1, cv2.COLOR_BGR2RGB),
    "rgba8": (4, 8, 1, cv2.COLOR_RGBA2RGB), "bgra8": (4, 8, 1, cv2.COLOR_BGRA2RGB),
    "mono8": (1, 8, 1, cv2.COLOR_GRAY2RGB), "8UC1": (1, 8, 1, cv2.COLOR_GRAY2RGB),
    "rgb16": (3, 16, 1, None), "bgr16": (3, 16, 1, cv2.COLOR_BGR2RGB),
    "rgba16": (4, 16, 1, cv2.COLOR_RGBA2RGB), "bgra16": (4, 16, 1, cv2.COLOR_BGRA2RGB),
    "mono16": (1, 16, 1, cv2.COLOR_GRAY2RGB), "16UC1": (1, 16, 1, cv2.COLOR_GRAY2RGB),
    "uyvy": (2, 8, 1, cv2.COLOR_YUV2RGB_UYVY), "yuv422": (2, 8, 1, cv2.COLOR_YUV2RGB_UYVY),
    "yuyv": (2, 8, 1, cv2.COLOR_YUV2RGB_YUYV), "yuv422_yuy2": (2, 8, 1, cv2.COLOR_YUV2RGB_YUYV),
    "nv12": (1, 8, 1.5, cv2.COLOR_YUV2RGB_NV12), "nv21": (1, 8, 1.5, cv2.COLOR_YUV2RGB_NV21),
    **{f"bayer_{pattern}{bits}": (1, bits, 1, getattr(cv2, f"COLOR_Bayer{pattern.upper()}2RGB"))
       for pattern in ("rggb", "bggr", "gbrg", "grbg") for bits in (8, 16)},
}
WIDTH, HEIGHT = 64, 48


def _raw_message(values: np.ndarray, encoding: str, padding: int, big_endian: bool = False):
    """An Image of ``values`` ([rows, width(, channels)], uint8 or uint16) with ``padding`` bytes per row."""
    from sensor_msgs.msg import Image

    rows = values.shape[0]
    data = values.astype(">u2" if big_endian else "<u2") if values.dtype == np.uint16 else values
    data = np.frombuffer(data.tobytes(), dtype=np.uint8).reshape(rows, -1)
    step = data.shape[1] + padding
    padded = np.full((rows, step), 0xAB, dtype=np.uint8)
    padded[:, :data.shape[1]] = data
    return Image(height=HEIGHT, width=WIDTH, encoding=encoding, is_bigendian=big_endian, step=step,
                 data=padded.tobytes())


def _reference(values: np.ndarray, code) -> np.ndarray:
    rgb = values if code is None else cv2.cvtColor(values, code)
    if values.dtype == np.uint16:     # as cv_bridge: convert at 16 bits, then x * 255 / 65535, rounded
        rgb = np.round(rgb.astype(np.float64) / 257.0).astype(np.uint8)
    return rgb


@pytest.mark.parametrize("padding", [0, 5])
@pytest.mark.parametrize("encoding, byte_order", [(name, order) for name in sorted(REFERENCE)
                                                  for order in (("little", "big") if REFERENCE[name][1] == 16
                                                                else ("little",))])
def test_every_encoding_matches_opencv_pixel_exact(encoding, byte_order, padding):
    from oxygen_ros.node.image_conversion import image_to_rgb

    channels, bits, row_scale, code = REFERENCE[encoding]
    rng = np.random.default_rng(zlib.crc32(f"{encoding} {padding}".encode()))
    shape = (int(HEIGHT * row_scale), WIDTH) + ((channels,) if channels > 1 else ())
    values = rng.integers(0, 2**bits, shape, dtype=np.uint16 if bits == 16 else np.uint8)
    out = image_to_rgb(_raw_message(values, encoding, padding, byte_order == "big"),
                       allow_mono16=encoding in ("mono16", "16UC1"))
    assert out.dtype == np.uint8 and out.shape == (HEIGHT, WIDTH, 3) and out.flags.c_contiguous
    np.testing.assert_array_equal(out, _reference(values, code))


def test_the_table_accepts_exactly_the_reference_encodings():
    from oxygen_ros.node.image_conversion import ENCODINGS

    assert set(ENCODINGS) == {name.lower() for name in REFERENCE}


COLOUR = np.array([200, 30, 60], dtype=np.uint8)    # an RGB colour with three distinct channels


@pytest.mark.parametrize("bits", [8, 16])
@pytest.mark.parametrize("pattern", ["rggb", "bggr", "gbrg", "grbg"])
def test_bayer_patterns_mean_the_colour_they_name(pattern, bits):
    """A uniform colour, mosaicked as the encoding's name says (top-left 2x2 cell), comes back."""
    from oxygen_ros.node.image_conversion import image_to_rgb

    index = {"r": 0, "g": 1, "b": 2}
    mosaic = np.zeros((HEIGHT, WIDTH), dtype=np.uint16 if bits == 16 else np.uint8)
    for k, channel in enumerate(pattern):
        mosaic[k // 2::2, k % 2::2] = int(COLOUR[index[channel]]) * (257 if bits == 16 else 1)
    out = image_to_rgb(_raw_message(mosaic, f"bayer_{pattern}{bits}", 0))
    np.testing.assert_array_equal(out[2:-2, 2:-2], np.broadcast_to(COLOUR, (HEIGHT - 4, WIDTH - 4, 3)))


def _colour_blocks() -> np.ndarray:
    """An RGB image of uniform 2x2 blocks (so chroma subsampling loses nothing but rounding)."""
    blocks = np.random.default_rng(5).integers(0, 256, (HEIGHT // 2, WIDTH // 2, 3), dtype=np.uint8)
    return np.repeat(np.repeat(blocks, 2, axis=0), 2, axis=1)


@pytest.mark.parametrize("encoding, to_yuv", [
    ("uyvy", cv2.COLOR_RGB2YUV_UYVY), ("yuv422", cv2.COLOR_RGB2YUV_UYVY),
    ("yuyv", cv2.COLOR_RGB2YUV_YUY2), ("yuv422_yuy2", cv2.COLOR_RGB2YUV_YUY2),
])
def test_packed_yuv422_means_the_byte_order_it_names(encoding, to_yuv):
    from oxygen_ros.node.image_conversion import image_to_rgb

    rgb = _colour_blocks()
    out = image_to_rgb(_raw_message(cv2.cvtColor(rgb, to_yuv), encoding, 4))
    assert np.abs(out.astype(int) - rgb).max() <= 4        # YUV round trip: rounding only


@pytest.mark.parametrize("encoding", ["nv12", "nv21"])
def test_nv12_and_nv21_mean_the_chroma_order_they_name(encoding):
    from oxygen_ros.node.image_conversion import image_to_rgb

    rgb = _colour_blocks()
    i420 = cv2.cvtColor(rgb, cv2.COLOR_RGB2YUV_I420)      # Y plane, then U plane, then V plane
    y, chroma = i420[:HEIGHT], i420[HEIGHT:].reshape(2, -1)
    first, second = (chroma[0], chroma[1]) if encoding == "nv12" else (chroma[1], chroma[0])
    semi_planar = np.concatenate([y, np.stack([first, second], axis=1).reshape(HEIGHT // 2, WIDTH)])
    out = image_to_rgb(_raw_message(semi_planar, encoding, 0))
    assert np.abs(out.astype(int) - rgb).max() <= 4


def test_8uc3_is_bgr_and_8uc1_is_grey():
    from oxygen_ros.node.image_conversion import image_to_rgb

    rgb = np.broadcast_to(COLOUR, (HEIGHT, WIDTH, 3))
    np.testing.assert_array_equal(image_to_rgb(_raw_message(np.ascontiguousarray(rgb[..., ::-1]), "8UC3", 0)),
                                  rgb)
    grey = np.full((HEIGHT, WIDTH), 77, dtype=np.uint8)
    np.testing.assert_array_equal(image_to_rgb(_raw_message(grey, "8UC1", 0)), np.full((HEIGHT, WIDTH, 3), 77))


@pytest.mark.parametrize("encoding", ["mono16", "16UC1"])
def test_16bit_single_channel_only_where_allowed(encoding):
    from oxygen_ros.node.image_conversion import ImageConversionError, image_to_rgb

    depth = np.full((HEIGHT, WIDTH), 1500, dtype=np.uint16)    # 1.5 m in a depth image
    with pytest.raises(ImageConversionError) as error:
        image_to_rgb(_raw_message(depth, encoding, 0))
    assert error.value.reason == "unsupported_encoding" and "16-bit single-channel" in str(error.value)
    grey = image_to_rgb(_raw_message(np.full((HEIGHT, WIDTH), 65535, dtype=np.uint16), encoding, 0),
                        allow_mono16=True)
    assert (grey == 255).all()


@pytest.mark.parametrize("encoding, width, height", [
    ("yuv422_yuy2", 63, 48), ("uyvy", 63, 48), ("nv12", 64, 47), ("nv21", 63, 48),
])
def test_odd_sizes_of_chroma_subsampled_encodings_are_refused(encoding, width, height):
    from sensor_msgs.msg import Image

    from oxygen_ros.node.image_conversion import ImageConversionError, image_to_rgb

    bytes_per_row = width * 2 if encoding in ("yuv422_yuy2", "uyvy") else width
    rows = height * 3 // 2 if encoding.startswith("nv") else height
    msg = Image(height=height, width=width, encoding=encoding, step=bytes_per_row, data=bytes(rows * bytes_per_row))
    with pytest.raises(ImageConversionError) as error:
        image_to_rgb(msg)
    assert error.value.reason == "odd_size"


def test_planar_data_length_counts_the_chroma_rows():
    from oxygen_ros.node.image_conversion import ImageConversionError, image_to_rgb

    msg = _raw_message(np.zeros((HEIGHT * 3 // 2, WIDTH), dtype=np.uint8), "nv12", 0)
    msg.data = bytes(HEIGHT * WIDTH)     # the Y plane only
    with pytest.raises(ImageConversionError) as error:
        image_to_rgb(msg)
    assert error.value.reason == "bad_data_length"


@pytest.mark.parametrize("reason, changes", [
    ("unsupported_encoding", {"encoding": "16UC1"}),        # depth: refused unless allowed
    ("unsupported_encoding", {"encoding": "32FC1"}),
    ("unsupported_encoding", {"encoding": "yuv420"}),
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
