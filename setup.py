"""`pip install .`: the ROS-free oxygen_ros library (models, engine, memory store, benchmarks) and its command-line
tools.

The ROS 2 node, launch files and messages are built by colcon through CMakeLists.txt / package.xml;
see README.md. This file does not install `oxygen_ros.node` (it needs rclpy and the generated messages).
"""
from setuptools import find_packages, setup


def _requirements(path: str) -> list[str]:
    with open(path, encoding="utf-8") as f:
        return [line.split("#")[0].strip() for line in f if line.split("#")[0].strip()]


# transformers is not among them: the tests hold the models to it (requirements/python.txt), the library never
# imports it.
_RUNTIME = {"torch", "numpy", "pyyaml", "safetensors", "sentencepiece", "tokenizers"}

setup(
    name="oxygen_ros",
    version="0.1.0",
    description="Unified KV-cache inference engine for Mixture-of-Transformers VLAs (pi0.5, pi0)",
    license="Apache-2.0",
    python_requires=">=3.10",
    packages=find_packages(include=["oxygen_ros", "oxygen_ros.models*", "oxygen_ros.engine*", "oxygen_ros.memory*",
                                            "oxygen_ros.bench*"]),
    package_data={"oxygen_ros.models": ["*.yaml", "*.json", "csrc/*.cpp"]},
    # torch without the pin's local label (+cpu): a CUDA build of the same release serves as well.
    install_requires=[r.split("+")[0]
                      for r in _requirements("requirements/torch.txt") + _requirements("requirements/python.txt")
                      if r.split("==")[0].lower() in _RUNTIME],
    entry_points={
        "console_scripts": [
            "oxygen-bench-model = oxygen_ros.bench.model_bench:main",
            "oxygen-bench-engine = oxygen_ros.bench.engine_bench:main",
            "oxygen-bench-fleet = oxygen_ros.bench.fleet_bench:main",
        ],
    },
)
