# Shared by scripts/setup_env.sh and scripts/env.sh: where the environment lives and which kind it is.
# OXYGEN_ROOT: the repository; OXYGEN_MODE: "wheels" (ROS 2 Kilted from PyPI) or "system-ros-<distro>";
# OXYGEN_VENV: the virtual environment. It lives outside the repository because CMake refuses exported
# include directories inside the source tree, and it is keyed by the pinned requirements so clones with
# the same pins share it. Override with OXYGEN_VENV.
OXYGEN_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
if [ -n "${ROS_DISTRO:-}" ] && python3 -c 'import rclpy' >/dev/null 2>&1; then
  OXYGEN_MODE="system-ros-$ROS_DISTRO"
  OXYGEN_PYTHON=${OXYGEN_PYTHON:-python3}
else
  OXYGEN_MODE=wheels
  OXYGEN_PYTHON=${OXYGEN_PYTHON:-python3.11}
fi
OXYGEN_REQ_HASH=$( { echo "$OXYGEN_MODE"; cat "$OXYGEN_ROOT"/requirements/*.txt; } | sha256sum | cut -c1-16)
OXYGEN_VENV=${OXYGEN_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/oxygen_ros/venv-$OXYGEN_REQ_HASH}
# The compiler cache of the colcon builds (`make setup`'s and the packaging test's): ccache keeps the
# compiled message typesupport, so a clone or a test workspace built before compiles nothing again.
OXYGEN_CCACHE_DIR=${OXYGEN_CCACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/oxygen_ros/ccache}
export OXYGEN_ROOT OXYGEN_MODE OXYGEN_VENV OXYGEN_CCACHE_DIR
