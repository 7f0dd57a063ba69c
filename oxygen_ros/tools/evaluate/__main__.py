"""``python -m oxygen_ros.tools.evaluate``: the evaluation's command line
(:func:`oxygen_ros.tools.evaluate.cli.main`)."""

from oxygen_ros.tools.evaluate.cli import main

raise SystemExit(main())
