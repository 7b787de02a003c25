"""On-node runtime: the only part of hpc-hsdp that imports torch (with ``models/<adapter>.py``).

``dist`` (process group, DeviceMesh, realized-group check), ``hsdp`` (wrappers),
``loop`` (the one training loop, for every model), ``loader`` (prefetching batches),
``schedule`` (learning rate), ``checkpoint``, ``preemption``, ``entry`` (what each task
runs). ``verify`` and ``schedule`` are pure and import no torch.
"""
