"""Network cost of one camera frame from a robot to a fleet server: raw ``sensor_msgs/Image`` (rgb8) against
``sensor_msgs/CompressedImage`` (JPEG), in bytes on the wire and milliseconds to encode (robot side,
OpenCV ``imencode``) and decode (server side: the node's own ``compressed_to_rgb`` path, ``imdecode`` then
BGR to RGB). docs/fleet.md ("Across machines") has the table.

Frames: the demo's rendered ALOHA camera images when ``--hdf5`` names a demo episode
(``runs/demo-data/episode_<i>.hdf5``, ``observations/images/<camera>``), else a synthetic scene (smooth
gradients and boxes, no noise); each resized to every ``--sizes`` entry (an upscaled frame compresses better
than a camera's native one of that size: say so with the figures). Timings: the median of ``--repeats``
calls and their minimum (on a loaded machine the
minimum is the work, the median adds waits for a core), per frame.

Usage: ``python -m oxygen_ros.bench.frame_cost --hdf5 runs/demo-data/episode_0.hdf5``.
"""

from __future__ import annotations

import argparse
import json
import time

import cv2
import numpy as np


def synthetic_frame(height: int = 240, width: int = 320) -> np.ndarray:
    """A smooth stand-in for a camera frame: gradients and a few flat boxes, uint8 ``[H, W, 3]`` RGB."""
    y, x = np.mgrid[0:height, 0:width].astype(np.float32)
    image = np.stack([x / width * 200 + 30, y / height * 180 + 40, (x + y) / (width + height) * 120 + 60], -1)
    for i, (top, left, color) in enumerate(((0.2, 0.1, (200, 40, 40)), (0.5, 0.6, (40, 160, 60)),
                                            (0.65, 0.25, (230, 220, 210)))):
        t, l = int(top * height), int(left * width)
        image[t:t + height // 5, l:l + width // 4] = color
    return image.astype(np.uint8)


def demo_frames(path: str, camera: str = "top", count: int = 8) -> list[np.ndarray]:
    """Up to ``count`` frames of ``camera`` spread over a demo episode (uint8 RGB)."""
    import h5py

    with h5py.File(path, "r") as episode:
        images = episode[f"observations/images/{camera}"]
        index = np.linspace(0, len(images) - 1, min(count, len(images))).astype(int)
        return [np.asarray(images[i], dtype=np.uint8) for i in index]


def _ms(call, repeats: int) -> tuple[float, float]:
    """(median, minimum) ms of ``repeats`` calls: on a loaded machine the minimum is the cost of the work,
    the median adds the waits for a core."""
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        call()
        times.append(time.perf_counter() - t)
    return 1e3 * float(np.median(times)), 1e3 * float(np.min(times))


def measure(frames: list[np.ndarray], size: tuple[int, int], quality: int, repeats: int) -> dict:
    """Bytes and encode / decode ms of ``frames`` resized to ``size`` (width, height) at JPEG ``quality``."""
    resized = [cv2.resize(f, size, interpolation=cv2.INTER_AREA if f.shape[1] > size[0] else cv2.INTER_LINEAR)
               for f in frames]
    bgr = [cv2.cvtColor(f, cv2.COLOR_RGB2BGR) for f in resized]
    params = [cv2.IMWRITE_JPEG_QUALITY, quality]
    encoded = [cv2.imencode(".jpg", f, params)[1] for f in bgr]
    jpeg_bytes = float(np.mean([e.size for e in encoded]))
    encode = _ms(lambda: [cv2.imencode(".jpg", f, params) for f in bgr], repeats)
    decode = _ms(lambda: [cv2.cvtColor(cv2.imdecode(e, cv2.IMREAD_COLOR), cv2.COLOR_BGR2RGB)
                          for e in encoded], repeats)
    raw = size[0] * size[1] * 3
    n = len(frames)
    return {"width": size[0], "height": size[1], "quality": quality, "raw_bytes": raw,
            "jpeg_bytes": jpeg_bytes, "ratio": raw / jpeg_bytes,
            "encode_ms": encode[0] / n, "encode_min_ms": encode[1] / n,
            "decode_ms": decode[0] / n, "decode_min_ms": decode[1] / n}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="oxygen-bench-frame-cost", description=__doc__.split("\n")[0])
    parser.add_argument("--hdf5", default=None, help="a demo episode (runs/demo-data/episode_<i>.hdf5)")
    parser.add_argument("--camera", default="top")
    parser.add_argument("--sizes", nargs="+", default=["320x240", "224x224", "640x480"])
    parser.add_argument("--quality", type=int, nargs="+", default=[80, 95])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--out", default=None, help="JSON output path")
    args = parser.parse_args(argv)
    frames = demo_frames(args.hdf5, args.camera) if args.hdf5 else [synthetic_frame()]
    sizes = [tuple(int(v) for v in s.lower().split("x")) for s in args.sizes]
    rows = [measure(frames, size, q, args.repeats) for size in sizes for q in args.quality]
    source = f"{args.hdf5} ({args.camera}, {frames[0].shape[1]}x{frames[0].shape[0]})" if args.hdf5 else "synthetic"
    print(f"frames: {source}; OpenCV {cv2.__version__}; per frame, median / minimum of {args.repeats} calls")
    print(f"{'size':>9}{'q':>4}{'raw B':>9}{'JPEG B':>9}{'ratio':>7}{'enc ms':>14}{'dec ms':>14}")
    for r in rows:
        print(f"{r['width']:>4}x{r['height']:<4}{r['quality']:>4}{r['raw_bytes']:>9}{r['jpeg_bytes']:>9.0f}"
              f"{r['ratio']:>7.1f}{r['encode_ms']:>8.2f}/{r['encode_min_ms']:<5.2f}"
              f"{r['decode_ms']:>8.2f}/{r['decode_min_ms']:<5.2f}")
    if args.out:
        with open(args.out, "w", encoding="utf-8") as handle:
            json.dump({"source": source, "rows": rows}, handle, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
