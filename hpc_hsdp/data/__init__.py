"""Token data: the on-disk format (``tokens``), ``prepare-data`` and its tokenizers, the
sampler and the synthetic source.

numpy only, never torch: ``hpc-hsdp prepare-data`` and ``plan`` stay light, and the
training loop reads the same files through memory maps.
"""

from hpc_hsdp.data.tokens import DataError, TokenDataset, check_for_training, open_dataset

__all__ = ["DataError", "TokenDataset", "check_for_training", "open_dataset"]
