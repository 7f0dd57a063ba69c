# Source this to use the built package in the current shell:  source scripts/env.sh
# (what `make` targets do after scripts/setup_env.sh). Activates the virtual environment and the
# colcon install space, so `python -c "from oxygen_ros.msg import ActionChunk"` works.
# shellcheck disable=SC1091
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
if [ ! -f "$OXYGEN_VENV/bin/activate" ]; then
  echo "scripts/env.sh: no environment at $OXYGEN_VENV yet: run 'make setup' first" >&2
  return 1 2>/dev/null || exit 1
fi
source "$OXYGEN_VENV/bin/activate"
if [ "$OXYGEN_MODE" = wheels ]; then
  case ":${AMENT_PREFIX_PATH:-}:" in *":$OXYGEN_VENV:"*) ;; *)
    export AMENT_PREFIX_PATH="$OXYGEN_VENV${AMENT_PREFIX_PATH:+:$AMENT_PREFIX_PATH}"
    export CMAKE_PREFIX_PATH="$OXYGEN_VENV${CMAKE_PREFIX_PATH:+:$CMAKE_PREFIX_PATH}" ;;
  esac
fi
# The repository's own install space, when it has been built (`make setup`); in a colcon workspace
# source the workspace's install/setup.bash instead.
if [ -f "$OXYGEN_ROOT/install/setup.bash" ]; then source "$OXYGEN_ROOT/install/setup.bash"
else echo "scripts/env.sh: no install/ in this clone ('make setup' builds it; in a colcon workspace, source the workspace's install/setup.bash)" >&2; fi
export PATH="$OXYGEN_ROOT/install/oxygen_ros/lib/oxygen_ros${PATH:+:$PATH}"
