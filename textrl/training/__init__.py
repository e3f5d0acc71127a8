"""``textrl train``: its set-up and PPO iteration (:mod:`~textrl.training.trainer`: ``train``,
``check_run``), what a run records (:mod:`~textrl.training.records`), where rollouts come from
(:mod:`~textrl.training.rollout_sources`) and the asynchronous actor of ``--max-staleness``
(:mod:`~textrl.training.async_training`).

Nothing is imported here: ``from textrl import train`` or ``from textrl.training.trainer import
train`` loads the trainer (torch and transformers) when it is asked for.
"""
