"""torch.conv2d: cuDNN's convolution algorithms, by heuristic and by benchmark."""

from gpuwatchd.tuning.families import FamilySpec

#: cuDNN's two ways to choose: its heuristic (``cudnn.benchmark=False``) or timing (True).
PICKS = ("heuristic", "benchmark")
#: The pick a job gets without gpuwatchd (torch's default ``cudnn.benchmark=False``).
DEFAULT_PICK = "heuristic"
#: Memory formats of a conv's operands (NCHW, NHWC).
MEMORY_FORMATS = ("contiguous", "channels_last")

SPECS = (
    FamilySpec(
        "torch.conv2d",
        ("conv2d", "conv"),
        ("picks", "memory_formats", "input_layout", "weight_layout", "tf32", "bias", "seed"),
        needs=("torch",),
    ),
)
