"""Token data: the on-disk format (``tokens``), ``prepare-data``, the sampler and the
synthetic source. numpy only, never torch.
"""
