"""Code the tests share that is not a fixture: imported as ``support.<module>`` (pytest's default
``prepend`` import mode puts ``tests/`` on ``sys.path``, since ``tests/`` is not a package)."""
