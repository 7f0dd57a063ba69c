"""Another publisher of the node's command topics (``~/action_chunk``, ``~/joint_trajectory``): a second
``oxygen_node`` started with the same name and namespace, or anything else publishing there. ROS 2 does not
prevent duplicate node names, and a controller that receives two policies' commands interleaved executes
neither; so the node looks at the ROS graph (``get_publishers_info_by_topic``) at activate and every
:data:`GRAPH_POLL_S` while configured, and acts per the ``command_conflict_policy`` parameter:

    refuse  (default) activation fails with the reason; while active, no action output is published while
            another publisher is there (each withheld chunk counted), and publishing resumes once it has gone.
    warn    the node publishes anyway; the conflict is logged and reported on ``/diagnostics``.

Two nodes that start together may both pass their activation check before discovery has shown them each
other; each then finds the other at its next poll (discovery on loopback is well under a second) and, under
``refuse``, both stop: a duplicate never goes unnoticed, at the cost of neither commanding the robot.
"""

from __future__ import annotations

import threading

from diagnostic_msgs.msg import DiagnosticStatus, KeyValue

CONFLICT_POLICIES = ("refuse", "warn")
GRAPH_POLL_S = 1.0    # how often the graph is checked for other publishers of the command topics [s]


class CommandConflicts:
    """Other publishers of one node's command topics, as last seen on the ROS graph. Thread-safe.

    Args:
        node: the node whose publishers are watched (``get_publishers_info_by_topic``, its name, namespace and
            logger are used).
    """

    def __init__(self, node):
        self._node = node
        self._topics: tuple[str, ...] = ()
        self._conflict: str | None = None
        self._withheld = 0
        self._lock = threading.Lock()

    def watch(self, topics: list[str]) -> None:
        """Watch these fully qualified command topics from now on (configure); forgets an earlier conflict."""
        with self._lock:
            self._topics, self._conflict = tuple(topics), None

    @property
    def conflict(self) -> str | None:
        """What the last :meth:`check` found (``/ns/oxygen_node/joint_trajectory: 1 other publisher (node
        /ns/oxygen_node)``), or None."""
        with self._lock:
            return self._conflict

    @property
    def withheld(self) -> int:
        """Action chunks not published because of a conflict under ``refuse`` (since the node was made)."""
        with self._lock:
            return self._withheld

    def check(self, policy: str) -> str | None:
        """Look at the graph now; log a conflict when it appears (an error under ``refuse``, else a warning) and
        when it has gone. Returns the conflict, or None."""
        node = self._node
        own = (node.get_namespace(), node.get_name())
        found = []
        for topic in self._topics:
            # Every publisher but one (this node's own) is another. Counted, not matched by name: a duplicate has
            # the same name, and the graph may lose the name of ours when a same-named node in this process goes.
            others = [f"{info.node_namespace.rstrip('/')}/{info.node_name}"
                      for info in node.get_publishers_info_by_topic(topic)]
            mine = f"{own[0].rstrip('/')}/{own[1]}"
            if others:
                others.remove(mine if mine in others else others[0])
            if others:
                found.append(f"{topic}: {len(others)} other publisher{'s' if len(others) > 1 else ''} (node "
                             f"{', '.join(sorted(others))})")
        conflict = "; ".join(found) or None
        with self._lock:
            previous, self._conflict = self._conflict, conflict
        if conflict is not None and conflict != previous:
            if policy == "refuse":
                node.get_logger().error(
                    f"another publisher of this node's command topics: {conflict}. command_conflict_policy refuse: "
                    "no action output while it is there (a second oxygen_node with the same name and namespace? "
                    "stop it, or give each node its own namespace)")
            else:
                node.get_logger().warning(
                    f"another publisher of this node's command topics: {conflict}. command_conflict_policy warn: "
                    "publishing anyway; the controller receives both")
        elif conflict is None and previous is not None:
            node.get_logger().info("no other publisher of the command topics any more")
        return conflict

    def withholds(self, policy: str) -> bool:
        """Whether an action chunk must not be published now (a conflict under ``refuse``); counts it when so."""
        with self._lock:
            if self._conflict is None or policy != "refuse":
                return False
            self._withheld += 1
            return True

    def annotate(self, status: DiagnosticStatus, policy: str) -> None:
        """Name the conflict in the engine's ``/diagnostics`` status: ERROR under ``refuse`` (no action output),
        else at least WARN; the value ``command_conflict`` names it (empty when none)."""
        conflict = self.conflict
        status.values.append(KeyValue(key="command_conflict", value=conflict or ""))
        status.values.append(KeyValue(key="command_conflict_withheld_chunks", value=str(self.withheld)))
        if conflict is None:
            return
        level = DiagnosticStatus.ERROR if policy == "refuse" else DiagnosticStatus.WARN
        status.level = max(status.level, level)
        action = "action outputs withheld" if policy == "refuse" else "publishing anyway"
        status.message = f"other publisher of the command topics ({action}): {conflict}; {status.message}"
