"""torch.matmul: cuBLAS and cuBLASLt GEMMs through torch's BLAS back ends."""

from gpuwatchd.tuning.families import FamilySpec

SPECS = (FamilySpec("torch.matmul", ("matmul",), ("blas", "tf32", "seed"), needs=("torch",)),)
