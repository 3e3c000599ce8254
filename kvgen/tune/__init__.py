"""``kvgen tune``: Optuna studies over each template's search space, written to tuned_configs.

Importing this package needs optuna; nothing on the hot path imports it.
"""

# The default search: best-first local search (tuner.NeighbourhoodSampler). On grids timed on
# the H200 it finds the grid's best in 20 trials from the template's default where TPE, in 40,
# ends 4-13 % behind in some seeds (benchmarks/compare_samplers.py).
SAMPLER = "local"
SAMPLERS = ("local", "tpe", "grid", "random")
# The stop rule (tuner.StopRule): a study ends once PATIENCE trials in a row each gained less
# than MIN_GAIN on its best (and, with the local search, every neighbour of its best config was
# tried). With the local search from the default, patience 10 kept every seed on the grids'
# best with 16-26 trials of the 40 (6 did not: a local optimum holds the search for 8-10
# trials before a stand-in step leaves it).
# Kept here, not in the modules that import optuna, so that the CLI can show them.
PATIENCE = 10
MIN_GAIN = 0.01
