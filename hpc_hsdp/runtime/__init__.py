"""On-node runtime: the only part of hpc-hsdp that imports torch.

``dist`` (process group, DeviceMesh, realized-group check), ``hsdp`` (wrappers),
``model``/``data``/``train``/``checkpoint`` (the built-in payload), ``entry`` (what each
task runs). ``verify`` is pure and imports no torch.
"""
