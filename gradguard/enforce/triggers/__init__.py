"""What decides about a step besides its gradients' figures: the loss, a second computation, the monitors.

Owns ``loss`` (``LossWatch``: the loss section's spike and non-finite verdicts, judged as ``loss_reference`` judges
plain floats, without torch), ``rerun`` (the rerun section: a suspect step computed again through the loop's closure,
accumulated gradients kept) and ``health`` (the monitors' warnings and metrics across steps); ``participants`` adapts
each to the step's stages (a halt's report is recovery's ``HaltReport``).

May import: recovery, actions, work, distributed.
"""
