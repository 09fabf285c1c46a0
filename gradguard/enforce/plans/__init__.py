"""What a step treats: the plan of a binding (which action acts on which tensor, in which order, when) and the
plan of each optimizer.

Owns ``plan`` (``Plan``: the policy compiled for the kernels) and ``plan_book`` (``PlanBook``: a plan per optimizer,
bound again when the model changes).

May import: actions, work, distributed.
"""
