"""Tools around the node that the node itself never imports: the demo (``demo``) and its simulated ALOHA robot
(``sim_robot``), a rosbag2 recorder (``bag_recorder``) and player (``replay``), the demo's end-of-run report
(``report``) and the soak run (``soak``). Each is a module with a ``main(argv)``, run as
``python -m oxygen_ros.tools.<name>`` or ``oxygen_ros <name>`` (``scripts/oxygen_ros``)."""
