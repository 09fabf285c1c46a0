"""What one step works with: its context, the figures it queues for its one read, its outcome, and the tensor maths.

Owns ``context`` (``StepContext``: the update a step precedes; ``StepPlan``), ``step_work`` (``StepWork``, ``Pending``:
the one host sync, ``StepOutcome``), ``writes``
(``DeferredWrites``: the changes the read showed are needed), ``places`` (``Place``: where a rank's piece of a
DeepSpeed gradient lies in its parameter, and the weights there), ``skips`` (the skip rules' histories and limits, on
plain numbers: ``gradguard replay`` keeps them too, without torch), ``tensors`` (batched norms, clip coefficients and
clamps, bitwise as torch's), ``statistics`` (the adaptive actions' statistics across steps, changed only by an
applied step) and ``participant`` (``Participant``: the one protocol through which a feature takes part in the
step's stages). Every other room of the step builds on these types; they know nothing of who fills them.

May import: distributed.
"""
