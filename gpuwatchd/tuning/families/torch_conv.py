"""torch.conv2d: cuDNN's convolution algorithms, by heuristic and by benchmark."""

from gpuwatchd.tuning.families import FamilySpec

SPECS = (
    FamilySpec(
        "torch.conv2d",
        ("conv2d", "conv"),
        ("picks", "memory_formats", "input_layout", "weight_layout", "tf32", "bias", "seed"),
        needs=("torch",),
    ),
)
