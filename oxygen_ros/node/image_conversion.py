"""sensor_msgs/Image and sensor_msgs/CompressedImage → uint8 ``[H, W, 3]`` RGB numpy arrays.

One table, :data:`ENCODINGS`, decides which raw encodings are accepted and how each is laid out and
converted (REP 104 / ``sensor_msgs/image_encodings`` names, compared case-insensitively):

==========================================  ==========================================================
encoding                                    conversion (OpenCV ``cvtColor`` code)
==========================================  ==========================================================
``rgb8``, ``rgb16``                         none
``bgr8``, ``8UC3``, ``bgr16``               ``COLOR_BGR2RGB`` (``8UC3`` is OpenCV's BGR order, as
                                            cv_bridge's passthrough hands it to OpenCV code)
``rgba8``, ``rgba16`` / ``bgra8``,          ``COLOR_RGBA2RGB`` / ``COLOR_BGRA2RGB`` (alpha dropped)
``bgra16``
``mono8``, ``8UC1``                         ``COLOR_GRAY2RGB``
``mono16``, ``16UC1``                       ``COLOR_GRAY2RGB``, only with ``allow_mono16`` (else
                                            refused: ``16UC1`` is what depth cameras publish)
``uyvy``, ``yuv422``                        ``COLOR_YUV2RGB_UYVY`` (packed 4:2:2, U Y0 V Y1)
``yuyv``, ``yuv422_yuy2``                   ``COLOR_YUV2RGB_YUY2`` (packed 4:2:2, Y0 U Y1 V)
``nv12`` / ``nv21``                         ``COLOR_YUV2RGB_NV12`` / ``_NV21`` (4:2:0: a Y plane of
                                            ``height`` rows, then ``height / 2`` rows of interleaved
                                            UV / VU, all ``step`` bytes long)
``bayer_rggb8|16``, ``bayer_bggr8|16``,     ``COLOR_BayerBG2RGB``, ``BayerRG2RGB``, ``BayerGR2RGB``,
``bayer_gbrg8|16``, ``bayer_grbg8|16``      ``BayerGB2RGB`` (OpenCV names a Bayer pattern by its second
                                            row; bilinear demosaicing, as cv_bridge)
==========================================  ==========================================================

16-bit encodings (``is_bigendian`` honoured) are converted at 16 bits, then scaled to 8 bits by
255/65535 with rounding to nearest, as cv_bridge's ``toCvCopy(msg, "rgb8")`` does
(``vision_opencv`` cv_bridge: colour conversion first, then ``convertTo`` with that factor). The
pixel conversion is OpenCV's on every machine; cv_bridge is not needed (it calls the same OpenCV
conversions, and its Python ``imgmsg_to_cv2`` assumes ``step`` is a whole number of pixels, so row
padding of any other size would be misread), so a robot with it and a build machine without it
accept the same encodings and produce the same pixels.

Before any conversion the message is checked against its encoding's layout — ``width``/``height``
non-zero (and even where the chroma is subsampled), ``step >= width * bytes per pixel`` (row padding
is allowed and removed), ``len(data) == rows * step`` — so a malformed message raises
:class:`ImageConversionError` instead of being misread. Compressed images: whatever OpenCV's
``imdecode`` reads (JPEG, PNG).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import cv2
import numpy as np


@dataclass(frozen=True)
class Encoding:
    """How one raw encoding is laid out and converted to RGB.

    Attributes:
        channels: values per pixel in a row (2 for packed 4:2:2, 1 for the planes of NV12/NV21 and
            for Bayer mosaics).
        bits: 8 or 16 bits per value.
        code: OpenCV ``cvtColor`` code to RGB, or None when the values already are RGB.
        planar_420: NV12/NV21: ``height * 3 / 2`` rows of ``width`` values (Y plane, then the
            interleaved chroma plane).
        even_width, even_height: the chroma subsampling needs them even.
        mono16: a 16-bit single-channel image, refused unless explicitly allowed.
    """

    channels: int
    bits: int = 8
    code: int | None = None
    planar_420: bool = False
    even_width: bool = False
    even_height: bool = False
    mono16: bool = False

    @property
    def bytes_per_pixel(self) -> int:
        return self.channels * self.bits // 8


def _bayer(code: int, bits: int) -> Encoding:
    return Encoding(1, bits, code)


# Keys are lower case; messages are matched case-insensitively ("8UC3" -> "8uc3").
ENCODINGS: dict[str, Encoding] = {
    "rgb8": Encoding(3),
    "bgr8": Encoding(3, code=cv2.COLOR_BGR2RGB),
    "8uc3": Encoding(3, code=cv2.COLOR_BGR2RGB),
    "rgba8": Encoding(4, code=cv2.COLOR_RGBA2RGB),
    "bgra8": Encoding(4, code=cv2.COLOR_BGRA2RGB),
    "mono8": Encoding(1, code=cv2.COLOR_GRAY2RGB),
    "8uc1": Encoding(1, code=cv2.COLOR_GRAY2RGB),
    "rgb16": Encoding(3, 16),
    "bgr16": Encoding(3, 16, cv2.COLOR_BGR2RGB),
    "rgba16": Encoding(4, 16, cv2.COLOR_RGBA2RGB),
    "bgra16": Encoding(4, 16, cv2.COLOR_BGRA2RGB),
    "mono16": Encoding(1, 16, cv2.COLOR_GRAY2RGB, mono16=True),
    "16uc1": Encoding(1, 16, cv2.COLOR_GRAY2RGB, mono16=True),
    "uyvy": Encoding(2, code=cv2.COLOR_YUV2RGB_UYVY, even_width=True),
    "yuv422": Encoding(2, code=cv2.COLOR_YUV2RGB_UYVY, even_width=True),
    "yuyv": Encoding(2, code=cv2.COLOR_YUV2RGB_YUY2, even_width=True),
    "yuv422_yuy2": Encoding(2, code=cv2.COLOR_YUV2RGB_YUY2, even_width=True),
    "nv12": Encoding(1, code=cv2.COLOR_YUV2RGB_NV12, planar_420=True, even_width=True, even_height=True),
    "nv21": Encoding(1, code=cv2.COLOR_YUV2RGB_NV21, planar_420=True, even_width=True, even_height=True),
    # sensor_msgs names the pattern from the top-left pixel, OpenCV from the second row's.
    "bayer_rggb8": _bayer(cv2.COLOR_BayerBG2RGB, 8),
    "bayer_bggr8": _bayer(cv2.COLOR_BayerRG2RGB, 8),
    "bayer_gbrg8": _bayer(cv2.COLOR_BayerGR2RGB, 8),
    "bayer_grbg8": _bayer(cv2.COLOR_BayerGB2RGB, 8),
    "bayer_rggb16": _bayer(cv2.COLOR_BayerBG2RGB, 16),
    "bayer_bggr16": _bayer(cv2.COLOR_BayerRG2RGB, 16),
    "bayer_gbrg16": _bayer(cv2.COLOR_BayerGR2RGB, 16),
    "bayer_grbg16": _bayer(cv2.COLOR_BayerGB2RGB, 16),
}

# 16 -> 8 bits: x * 255 / 65535 = x / 257, rounded to nearest (never a tie for integer x).
_SCALE_16_TO_8 = 255.0 / 65535.0


class ImageConversionError(ValueError):
    """A camera message that cannot be converted.

    Attributes:
        reason: short machine-readable cause, used as the drop counter's key: ``unsupported_encoding``
            (also a 16-bit single-channel image where it is not allowed), ``zero_size``, ``odd_size``
            (a chroma-subsampled encoding with an odd width or height), ``bad_step``,
            ``bad_data_length``, ``corrupt_compressed``.
    """

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason


def _bytes(data) -> np.ndarray:
    """``msg.data`` (bytes, array.array('B'), list of int) as a flat uint8 array (no copy when possible)."""
    if isinstance(data, (bytes, bytearray, memoryview)) or hasattr(data, "typecode"):
        return np.frombuffer(data, dtype=np.uint8)
    return np.asarray(data, dtype=np.uint8)


def image_to_rgb(msg, allow_mono16: bool = False) -> np.ndarray:
    """Convert a ``sensor_msgs/Image`` with one of the :data:`ENCODINGS`.

    Args:
        msg: the message (``height``, ``width``, ``encoding``, ``is_bigendian``, ``step`` [bytes per
            row], ``data``).
        allow_mono16: accept ``mono16`` / ``16UC1`` (a 16-bit grayscale camera). Off by default: a
            depth image (``16UC1``, millimetres) is not a camera picture for an RGB slot.

    Returns:
        uint8 ``[height, width, 3]`` RGB, C-contiguous, a copy independent of ``msg``.

    Raises:
        ImageConversionError: unsupported (or not allowed) encoding, zero size, odd size for a
            chroma-subsampled encoding, ``step < width * bytes per pixel``, or
            ``len(data) != rows * step``.
    """
    name = msg.encoding.lower()
    encoding = ENCODINGS.get(name)
    if encoding is None or (encoding.mono16 and not allow_mono16):
        accepted = sorted(key for key, value in ENCODINGS.items() if allow_mono16 or not value.mono16)
        detail = " (a 16-bit single-channel image: depth is not accepted on a camera slot unless the camera " \
                 "is marked as 16-bit grayscale)" if encoding is not None else ""
        raise ImageConversionError("unsupported_encoding", f"unsupported encoding {msg.encoding!r}{detail}; "
                                   f"accepted: {accepted}")
    height, width, step = int(msg.height), int(msg.width), int(msg.step)
    if height == 0 or width == 0:
        raise ImageConversionError("zero_size", f"zero-size image {width}x{height}")
    if (encoding.even_width and width % 2) or (encoding.even_height and height % 2):
        need = "width and height" if encoding.even_height else "width"
        raise ImageConversionError("odd_size", f"{msg.encoding} needs an even {need}, got {width}x{height}")
    row_bytes = width * encoding.bytes_per_pixel
    if step < row_bytes:
        raise ImageConversionError("bad_step", f"step {step} < width {width} x {encoding.bytes_per_pixel} "
                                   "bytes per pixel")
    rows = height * 3 // 2 if encoding.planar_420 else height
    data = _bytes(msg.data)
    if data.size != rows * step:
        raise ImageConversionError("bad_data_length", f"data has {data.size} bytes, {rows} rows x step {step} = "
                                   f"{rows * step}")
    # Drop the row padding: rows are `step` bytes, of which the first row_bytes are pixels.
    pixels = np.ascontiguousarray(data.reshape(rows, step)[:, :row_bytes])
    if encoding.bits == 16:
        big = bool(getattr(msg, "is_bigendian", False))
        pixels = pixels.view(">u2" if big else "<u2")
        if (sys.byteorder == "big") != big:
            pixels = pixels.astype(np.uint16)       # native byte order for OpenCV
    pixels = pixels.reshape(rows, width, encoding.channels) if encoding.channels > 1 else pixels
    rgb = pixels.copy() if encoding.code is None else cv2.cvtColor(pixels, encoding.code)
    if encoding.bits == 16:
        rgb = cv2.convertScaleAbs(rgb, alpha=_SCALE_16_TO_8)
    return np.ascontiguousarray(rgb)


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
    bgr = cv2.imdecode(data, cv2.IMREAD_COLOR)
    if bgr is None or bgr.size == 0:
        raise ImageConversionError("corrupt_compressed", f"{data.size} bytes of format {msg.format!r} do not "
                                   "decode as JPEG or PNG")
    return cv2.cvtColor(bgr, cv2.COLOR_BGR2RGB)
