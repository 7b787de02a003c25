"""Models the training loop can train: one small interface (:class:`ModelAdapter`), one
entry per kind of model (``builtin``, ``hf:PATH``, ``MODULE:FUNCTION``).

Importing this package imports no torch; each adapter module imports it on the task.
"""
