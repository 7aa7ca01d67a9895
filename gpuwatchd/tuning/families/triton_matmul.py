"""triton.matmul: a Triton GEMM kernel over a grid of launch configs."""

from gpuwatchd.tuning.families import FamilySpec

SPECS = (
    FamilySpec(
        "triton.matmul", ("matmul",), ("configs", "tf32", "seed"), needs=("torch", "triton")
    ),
)
