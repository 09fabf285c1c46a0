"""What decides about a step besides its gradients' figures: the loss, a second computation, the monitors.

Owns ``loss`` (``LossWatch``: the loss section's spike and non-finite verdicts), ``rerun`` (the rerun section: a
suspect step computed again through the loop's closure, accumulated gradients kept) and ``health`` (the monitors'
warnings and metrics across steps). Each takes part in the step as a participant (``enforce.step.participants``).

May import: actions, work, distributed.
"""
