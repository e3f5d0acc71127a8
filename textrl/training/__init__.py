"""``textrl train``: the command (:mod:`~textrl.training.trainer`: ``train``, and ``check_run`` from
:mod:`~textrl.training.run_checks`, what it checks before any model loads), its set-up
(:mod:`~textrl.training.set_up`), the run it drives and its PPO iteration
(:mod:`~textrl.training.ppo_run`), what a run records (:mod:`~textrl.training.records`), where rollouts come from
(:mod:`~textrl.training.rollout_sources`) and the asynchronous actor of ``--max-staleness``
(:mod:`~textrl.training.async_training`).

Nothing is imported here: ``from textrl import train`` or ``from textrl.training.trainer import
train`` loads the trainer (torch and transformers) when it is asked for.
"""
