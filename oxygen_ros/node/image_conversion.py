"""sensor_msgs/Image and sensor_msgs/CompressedImage → uint8 ``[H, W, 3]`` RGB numpy arrays.

Accepted raw encodings: rgb8, bgr8, rgba8, bgra8, mono8 (REP 104 / sensor_msgs/image_encodings names);
compressed: whatever OpenCV's ``imdecode`` reads (JPEG, PNG). Before any conversion the message is
checked here — ``width``/``height`` non-zero, ``step >= width * channels`` (row padding is allowed and
removed), ``len(data) == height * step`` — so a malformed message raises :class:`ImageConversionError`
instead of being misread. The pixel conversion itself uses cv_bridge where it is importable (every
robot with ROS 2), otherwise OpenCV's ``cvtColor`` / ``imdecode``.
"""

from __future__ import annotations

import numpy as np

try:  # cv_bridge ships with ROS 2 on robots; these build machines have none (environment.md).
    from cv_bridge import CvBridge, CvBridgeError
except ImportError:
    CvBridge = None
    CvBridgeError = None

import cv2

# encoding -> channels
RAW_ENCODINGS = {"rgb8": 3, "bgr8": 3, "rgba8": 4, "bgra8": 4, "mono8": 1}
_TO_RGB = {"bgr8": cv2.COLOR_BGR2RGB, "rgba8": cv2.COLOR_RGBA2RGB, "bgra8": cv2.COLOR_BGRA2RGB,
           "mono8": cv2.COLOR_GRAY2RGB}
_BRIDGE = CvBridge() if CvBridge is not None else None


class ImageConversionError(ValueError):
    """A camera message that cannot be converted.

    Attributes:
        reason: short machine-readable cause, used as the drop counter's key: ``unsupported_encoding``,
            ``zero_size``, ``bad_step``, ``bad_data_length``, ``corrupt_compressed``.
    """

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason


def _bytes(data) -> np.ndarray:
    """``msg.data`` (bytes, array.array('B'), list of int) as a flat uint8 array (no copy when possible)."""
    if isinstance(data, (bytes, bytearray, memoryview)) or hasattr(data, "typecode"):
        return np.frombuffer(data, dtype=np.uint8)
    return np.asarray(data, dtype=np.uint8)


def image_to_rgb(msg) -> np.ndarray:
    """Convert a ``sensor_msgs/Image``.

    Args:
        msg: the message (``height``, ``width``, ``encoding``, ``step`` [bytes per row], ``data``).

    Returns:
        uint8 ``[height, width, 3]`` RGB, C-contiguous, a copy independent of ``msg``.

    Raises:
        ImageConversionError: unsupported encoding, zero size, ``step < width * channels``, or
            ``len(data) != height * step``.
    """
    encoding = msg.encoding.lower()
    if encoding not in RAW_ENCODINGS:
        raise ImageConversionError("unsupported_encoding", f"unsupported encoding {msg.encoding!r}; accepted: "
                                   f"{sorted(RAW_ENCODINGS)}")
    channels = RAW_ENCODINGS[encoding]
    height, width, step = int(msg.height), int(msg.width), int(msg.step)
    if height == 0 or width == 0:
        raise ImageConversionError("zero_size", f"zero-size image {width}x{height}")
    if step < width * channels:
        raise ImageConversionError("bad_step", f"step {step} < width {width} x {channels} bytes per pixel")
    data = _bytes(msg.data)
    if data.size != height * step:
        raise ImageConversionError("bad_data_length", f"data has {data.size} bytes, height {height} x step "
                                   f"{step} = {height * step}")
    if _BRIDGE is not None:
        try:
            return np.ascontiguousarray(_BRIDGE.imgmsg_to_cv2(msg, desired_encoding="rgb8"))
        except CvBridgeError as error:
            raise ImageConversionError("unsupported_encoding", str(error)) from error
    # Drop the row padding: rows are `step` bytes, of which the first width * channels are pixels.
    pixels = data.reshape(height, step)[:, :width * channels].reshape(height, width, channels)
    if encoding == "rgb8":
        return pixels.copy()
    return cv2.cvtColor(np.ascontiguousarray(pixels), _TO_RGB[encoding])


def compressed_to_rgb(msg) -> np.ndarray:
    """Convert a ``sensor_msgs/CompressedImage`` (JPEG or PNG; ``format`` is informative only).

    Returns:
        uint8 ``[H, W, 3]`` RGB.

    Raises:
        ImageConversionError: empty data (``zero_size``) or data that does not decode
            (``corrupt_compressed``).
    """
    data = _bytes(msg.data)
    if data.size == 0:
        raise ImageConversionError("zero_size", "empty compressed image")
    # OpenCV decodes the whole JPEG/PNG itself (cv_bridge would call the same imdecode).
    bgr = cv2.imdecode(data, cv2.IMREAD_COLOR)
    if bgr is None or bgr.size == 0:
        raise ImageConversionError("corrupt_compressed", f"{data.size} bytes of format {msg.format!r} do not "
                                   "decode as JPEG or PNG")
    return cv2.cvtColor(bgr, cv2.COLOR_BGR2RGB)
