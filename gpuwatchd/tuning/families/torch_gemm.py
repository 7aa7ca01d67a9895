"""torch.gemm: strided GEMMs and batched GEMMs as a captured model calls them."""

from gpuwatchd.tuning.families import FamilySpec

SPECS = (FamilySpec("torch.gemm", ("matmul", "bmm"), ("layout", "seed"), needs=("torch",)),)
