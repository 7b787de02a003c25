"""The pure core (no torch, no scheduler, no files): which rank is which GPU on which node,
the groups of the mesh, the rendezvous address, the SLURM environment of a task, memory and
traffic estimates and how a plan looks to a person. Everything above uses it; it uses
nothing of the package but :mod:`hpc_hsdp.errors`."""
