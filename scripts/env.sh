# Source this to use the built package in the current shell:  source scripts/env.sh
# (what `make` targets do after scripts/setup_env.sh). Activates the virtual environment and the
# colcon install space, so `python -c "from oxygen_ros.msg import ActionChunk"` works.
# shellcheck disable=SC1091
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
source "$OXYGEN_VENV/bin/activate"
if [ "$OXYGEN_MODE" = wheels ]; then
  case ":${AMENT_PREFIX_PATH:-}:" in *":$OXYGEN_VENV:"*) ;; *)
    export AMENT_PREFIX_PATH="$OXYGEN_VENV${AMENT_PREFIX_PATH:+:$AMENT_PREFIX_PATH}"
    export CMAKE_PREFIX_PATH="$OXYGEN_VENV${CMAKE_PREFIX_PATH:+:$CMAKE_PREFIX_PATH}" ;;
  esac
fi
# The repository's own install space, when it has been built (`make setup`); in a colcon workspace
# source the workspace's install/setup.bash instead.
if [ -f "$OXYGEN_ROOT/install/setup.bash" ]; then source "$OXYGEN_ROOT/install/setup.bash"; fi
export PATH="$OXYGEN_ROOT/install/oxygen_ros/lib/oxygen_ros${PATH:+:$PATH}"
