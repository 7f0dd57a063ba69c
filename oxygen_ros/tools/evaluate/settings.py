"""The node's settings for the synchronous conditions, read by the node's own code without a node.

:func:`oxygen_ros.node.parameters.read_settings` reads parameters through an rclpy node
(``get_parameter(name).value``, ``get_logger()``); :class:`ParameterView` is the one stand-in for that node in
the evaluation, until the node offers a reader of a plain mapping.
"""

from __future__ import annotations

import sys


class ParameterView:
    """Just enough of an rclpy node for :func:`oxygen_ros.node.parameters.read_settings`: the declared
    defaults with ``params`` over them, and a logger."""

    class _Value:
        def __init__(self, value):
            self.value = value

    class _Logger:
        def info(self, message: str) -> None:
            pass

        def warning(self, message: str) -> None:
            print(f"warning: {message}", file=sys.stderr)

    def __init__(self, params: dict):
        from oxygen_ros.node.parameters import DECLARATIONS

        unknown = sorted(set(params) - set(DECLARATIONS) - {"use_sim_time"})
        if unknown:
            raise ValueError(f"unknown node parameters {unknown} (docs/parameters.md lists them)")
        self._values = {}
        for name, declaration in DECLARATIONS.items():
            default = declaration.default
            self._values[name] = params.get(name, default if not _is_type(default) else [])

    def get_parameter(self, name: str):
        return self._Value(self._values[name])

    def get_logger(self):
        return self._Logger()


def _is_type(value) -> bool:
    from rclpy.parameter import Parameter

    return isinstance(value, Parameter.Type)


def read_node_settings(params: dict):
    """The :class:`~oxygen_ros.node.parameters.NodeSettings` of the node parameters ``params`` (name -> value,
    over the declared defaults), as the node's configure reads them.

    Raises:
        ValueError: an unknown parameter name, or a value the node refuses.
    """
    from oxygen_ros.node.parameters import read_settings

    return read_settings(ParameterView(params))
