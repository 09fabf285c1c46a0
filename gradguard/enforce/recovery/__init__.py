"""Rewinding: snapshots of the training state and the exact return to one.

Owns ``recovery`` (``Recovery``: when to snapshot, when a halt becomes a rewind, the rewind itself), ``snapshots``
(what a snapshot holds and how it is put back), where snapshots live (``snapshot_memory``, ``snapshot_places``,
``snapshot_fit``, ``host_copy``: device, host, or decided from the measured peak), ``averages`` and ``schedulers``
(the state beside the model's: EMA copies, LR schedulers). Takes part in the step as a participant.

May import: actions, work, distributed.
"""
