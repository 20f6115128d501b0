"""Precision enum, autocast/GradScaler contexts and dtype limits."""

from __future__ import annotations

import contextlib
import functools
import itertools
from collections import Counter
from dataclasses import dataclass
from enum import Enum

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map_only


class Precision(str, Enum):
    FP64 = "fp64"
    FP32 = "fp32"
    TF32 = "tf32"
    BF16 = "bf16"
    FP16 = "fp16"

    @property
    def dtype(self) -> torch.dtype:
        return {"fp64": torch.float64, "fp32": torch.float32, "tf32": torch.float32,
                "bf16": torch.bfloat16, "fp16": torch.float16}[self.value]

    @property
    def autocast(self) -> bool:
        """Whether this precision runs under autocast (the model itself stays fp32)."""
        return self in (Precision.BF16, Precision.FP16)

    low = autocast


def weights_precision(model: torch.nn.Module) -> Precision | None:
    """The low precision the model's weights are stored in (pure bf16/fp16 training: ``model.to(
    torch.bfloat16)``, no autocast, the optimizer over those weights), or None for float32/float64
    weights. The dtype holding most parameter elements decides (a few float32 norms kept aside do not)."""
    sizes: Counter[torch.dtype] = Counter()
    for p in model.parameters():
        if p.is_floating_point():
            sizes[p.dtype] += p.numel()
    return {torch.bfloat16: Precision.BF16, torch.float16: Precision.FP16}.get(max(sizes, key=sizes.get, default=None))


def parse_precision(value: str | Precision | None, default: Precision = Precision.FP32) -> Precision:
    if value is None:
        return default
    if isinstance(value, Precision):
        return value
    aliases = {"float32": "fp32", "float16": "fp16", "half": "fp16", "bfloat16": "bf16",
               "float64": "fp64", "double": "fp64", "32": "fp32", "16": "fp16"}
    return Precision(aliases.get(str(value).lower(), str(value).lower()))


@dataclass(frozen=True, slots=True)
class Limits:
    max: float
    tiny: float       # smallest normal
    subnormal: float  # smallest positive subnormal


def limits(dtype: torch.dtype) -> Limits:
    info = torch.finfo(dtype)
    return Limits(max=float(info.max), tiny=float(info.tiny), subnormal=float(info.smallest_normal) * float(info.eps))


def autocast_context(precision: Precision, device_type: str, enabled: bool = True):
    on = precision.autocast and enabled
    return torch.autocast(device_type=device_type, dtype=precision.dtype) if on else contextlib.nullcontext()


@contextlib.contextmanager
def numeric_mode(precision: Precision, device_type: str):
    """TF32 on/off for the duration; restores the previous settings on exit, errors too."""
    prev = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    try:
        if device_type == "cuda":
            torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = precision is Precision.TF32
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = prev


def device_of(model: torch.nn.Module) -> torch.device:
    return next((t.device for t in itertools.chain(model.parameters(), model.buffers())), torch.device("cpu"))


def describe_device(device: torch.device) -> str:
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        return f"cuda:{index} ({torch.cuda.get_device_name(index)})"
    return device.type


# -- CUDA autocast policy on CPU -------------------------------------------------------------------
# CUDA autocast runs these ops in float32; CPU autocast leaves them in fp16/bf16 when their inputs
# are low precision. Replaying a CUDA run on CPU registers Python kernels at the AutocastCPU key
# that upcast their low-precision inputs, as CUDA does. (aten op overload names.)
CUDA_FP32_OPS = (
    "acos", "asin", "cosh", "erfinv", "exp", "expm1", "log", "log10", "log2", "log1p", "reciprocal", "rsqrt",
    "sinh", "tan", "pow.Tensor_Scalar", "pow.Tensor_Tensor", "pow.Scalar", "softplus", "layer_norm",
    "native_layer_norm", "group_norm", "cosine_similarity", "dist", "pdist", "renorm", "logsumexp",
    "softmax.int", "log_softmax.int", "cumprod", "cumsum", "linalg_vector_norm",
    "sum", "sum.dim_IntList", "norm.Scalar", "norm.ScalarOpt_dim",
)


@contextlib.contextmanager
def policy_context(policy: str, precision: Precision, device_type: str):
    """The autocast op policy for a rerun: native, or CUDA's emulated on CPU (CPU autocast follows CUDA's
    float32 op list)."""
    if not (policy == "cuda" and precision.autocast and device_type == "cpu"):
        yield
        return
    keys = torch._C.DispatchKeySet(torch._C.DispatchKey.AutocastCPU)
    low = (torch.float16, torch.bfloat16)

    def make(op):
        def kernel(*args, **kwargs):
            with torch._C._ExcludeDispatchKeyGuard(keys):
                cast = lambda a: a.float() if isinstance(a, torch.Tensor) and a.dtype in low else a  # noqa: E731
                return op(*[cast(a) for a in args], **{k: cast(v) for k, v in kwargs.items()})
        return kernel

    lib = torch.library.Library("aten", "IMPL")  # noqa: TOR901 - scoped registration, destroyed below
    try:
        for name in CUDA_FP32_OPS:
            base, _, overload = name.partition(".")
            lib.impl(name, make(getattr(getattr(torch.ops.aten, base), overload or "default")), "AutocastCPU")
        yield
    finally:
        lib._destroy()


class _EmulateFp16(TorchDispatchMode):
    """fp16 matmul-like ops on CPU computed as float32 arithmetic on their fp16 inputs, rounded to fp16.

    CPU fp16 kernels accumulate in float32 too but run 5-10x slower than float32 ones; this differs
    from them only by the order of the float32 sums (a last-place difference in ~0.3% of outputs),
    and it is what CUDA's tensor cores compute. Entered as the outermost dispatch mode, so nanprobe's
    own modes (the origin tracker, probes) still see the op as the user called it, on fp16 tensors.
    """

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _fp16_ops() and any(isinstance(a, torch.Tensor) and a.dtype == torch.float16
                                       and a.device.type == "cpu" for a in args):
            def up(a):
                return a.float() if isinstance(a, torch.Tensor) and a.dtype == torch.float16 else a
            out = func(*[up(a) for a in args], **{k: up(v) for k, v in kwargs.items()})
            return tree_map_only(torch.Tensor, lambda o: o.to(torch.float16) if o.is_floating_point() else o, out)
        return func(*args, **kwargs)


# a context: CPU fp16 matmuls, convolutions and attention as above; enter it before any other dispatch mode
emulate_fp16_matmuls = _EmulateFp16


@functools.cache
def _fp16_ops() -> frozenset:
    names = ("mm", "bmm", "addmm", "baddbmm", "addbmm", "convolution", "convolution_backward",
             "_scaled_dot_product_flash_attention_for_cpu")
    return frozenset(getattr(torch.ops.aten, n).default for n in names if hasattr(torch.ops.aten, n))


class _RetargetCasts(TorchDispatchMode):
    """Every ``dtype=`` the user's code asks for in ``old`` (``x.to(torch.bfloat16)``, ``.half()``,
    ``torch.zeros(..., dtype=torch.bfloat16)``) becomes ``new``: a rerun of a pure low-precision run in
    another precision keeps the user's casts to the weights' dtype consistent with the cast weights.
    Entered before nanprobe's own modes, which still see the op as the user called it."""

    def __init__(self, old: torch.dtype, new: torch.dtype):
        super().__init__()
        self.old, self.new = old, new

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if kwargs.get("dtype") is self.old:
            kwargs = {**kwargs, "dtype": self.new}
        return func(*args, **kwargs)


def retarget_casts(old: torch.dtype, new: torch.dtype):
    """A context: the user's casts to ``old`` produce ``new`` (see _RetargetCasts)."""
    return _RetargetCasts(old, new) if old != new else contextlib.nullcontext()
