"""Integrations with training frameworks, each an optional extra.

``gradguard.integrations.lightning`` (``pip install gradguard[lightning]``) and
``gradguard.integrations.transformers`` (``pip install gradguard[transformers]``, which also covers
plain ``accelerate`` loops). Importing ``gradguard`` never imports a framework; each module here
imports its own, and says how to install it when it is missing.
"""
