"""``kvgen tune``: Optuna studies over each template's search space, written to tuned_configs.

Importing this package needs optuna; nothing on the hot path imports it.
"""
