"""Rewinding: snapshots of the training state and the exact return to one.

Owns ``recovery`` (``Recovery``: when to snapshot, when a halt becomes a rewind, the rewind itself), ``decisions``
(``HaltReport``, ``Decision``, ``RewindRequested``), ``held_state`` (what a rewind's window holds still),
``participant`` (recovery's part in the step), ``snapshots
(what a snapshot holds and how it is put back), where snapshots live (``snapshot_memory``, ``snapshot_places``,
``snapshot_fit``, ``host_copy``: device, host, or decided from the measured peak), ``averages`` and ``schedulers``
(the state beside the model's: EMA copies, LR schedulers).

May import: actions, work, distributed.
"""
