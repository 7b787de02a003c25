"""On-node runtime: the only part of hpc-hsdp that imports torch (with ``models/<adapter>.py``).

``dist`` (process group, DeviceMesh, realized-group check), ``hsdp`` (wrappers),
``loop`` (the one training loop, for every model), ``loader`` (prefetching batches),
``schedule`` (learning rate), ``checkpoint``, ``preemption``, ``entry`` (what each task
runs), ``submitit_job`` (the command of a submitted job's tasks). ``verify`` and ``schedule`` are pure and import no torch.
"""
