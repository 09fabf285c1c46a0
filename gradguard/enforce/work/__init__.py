"""What one step works with: its context, the figures it queues for its one read, its outcome, and the tensor maths.

Owns ``step_work`` (``StepContext``, ``StepWork``, ``Pending``, the one host sync, ``DeferredWrites``,
``StepOutcome``), ``tensors`` (batched norms, clip coefficients and clamps, bitwise as torch's) and ``statistics``
(the adaptive actions' statistics across steps, changed only by an applied step). Every other room of the step
builds on these types; they know nothing of who fills them.

May import: distributed.
"""
