"""The shared core every layer may import: rollout checks, KL controllers, timers, weight versions,
the run's precision and optimisers, the agent registry, what an agent reads of its environment,
users' files, other libraries' quiet, and the table of modules that moved (:mod:`~textrl.core.moved`).

Nothing is imported here, so ``import textrl.core.timing`` loads that module alone.
"""
