"""Training the project's π0.5 on the demo's scripted demonstrations (never imported by the node).

:mod:`oxygen_ros.training.data` reads the episodes of :mod:`oxygen_ros.tools.demo_data` into training
samples with the same processing as the node; :mod:`oxygen_ros.training.train` is the entry point
(``python -m oxygen_ros.training.train``, ``make train-demo``). docs/demo-policy.md has the recipe.
"""
