"""Where a NaN started: the trace of the forward and backward that names the first module and input.

Owns ``provenance`` (``Provenance``: the hooks, and the figures that ride the step's one read), ``light_trace`` and
``figures`` (the default light trace: outputs held weakly and reduced once), ``replay`` and ``first_fault`` (the
default: each forward held, none traced, a faulting step's forwards replayed with the light trace), ``origins`` (naming
what was found). Takes part in the step as a participant, last among the device work, so its reader sees the step's
verdict; the default's replay runs after the read, before the verdict.

May import: work, distributed.
"""
