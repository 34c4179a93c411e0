"""Random test arrays shared by the kernel tests."""

import numpy as np


def randn(rng, *shape, scale=1.0):
    """float32 normal samples of `shape`, times `scale`."""
    return (rng.standard_normal(shape) * scale).astype(np.float32)
