"""The data types that cross spanrl's components, one definition each.

``rollouts``: what the receiver assembles and stores (``Reward``, ``Transition``,
``AssembledRollout`` and their JSON form); ``tasks``: task datasets (``Task``, ``load_tasks``);
``scored``: a rollout as the training loop scored it (``ScoredRollout``). The runner <-> bridge
payloads and the rollout-id format are ``spanrl.bridge_protocol``. Stdlib only.
"""
