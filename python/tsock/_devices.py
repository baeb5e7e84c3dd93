"""Consumer(device=...): which GPU a consumer asked for, checked before it
attaches (a bad name, a framework without CUDA or without that GPU:
ValueError or CUDAUnavailable, nothing attached). Imported only when
device= is given."""

from __future__ import annotations

from . import _capi
from .errors import CUDAUnavailable

DEVICE_PATHS = ("auto", "require", "never")


def check_device(device, output: str):
    """Validates device= before anything is attached; returns the
    torch.device (with its index), or a JaxGPU for output="jax", or raises
    ValueError / CUDAUnavailable."""
    if output == "jax":
        return _check_jax_device(JaxGPU(cuda_index(device), None))
    if output == "dlpack":
        return DLPackGPU(cuda_index(device))
    if output != "torch":
        raise ValueError(
            f"device={device!r} delivers torch tensors, JAX arrays or DLPack objects: "
            f"pass output='torch', 'jax' or 'dlpack' (got output={output!r})"
        )
    import torch

    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"device must be None or a CUDA device such as 'cuda:0', got {device!r}") from None
    if dev.type != "cuda":
        raise ValueError(f"device must be None or a CUDA device such as 'cuda:0', got {device!r}")
    if torch.version.cuda is None:
        raise CUDAUnavailable(
            f"device={device!r}: this PyTorch ({torch.__version__}) is built without CUDA; "
            "install a CUDA build of PyTorch, or leave device=None for CPU tensors",
            _capi.ENOCUDA,
        )
    if not torch.cuda.is_available():
        raise CUDAUnavailable(
            f"device={device!r}: PyTorch {torch.__version__} (CUDA {torch.version.cuda}) sees no GPU "
            "(torch.cuda.is_available() is False: no NVIDIA driver, or CUDA_VISIBLE_DEVICES hides every device)",
            _capi.ENOCUDA,
        )
    count = torch.cuda.device_count()
    index = torch.cuda.current_device() if dev.index is None else dev.index
    if index >= count:
        raise ValueError(f"device={device!r}: only {count} CUDA device(s) are visible")
    return torch.device("cuda", index)


class JaxGPU:
    """A JAX GPU device= resolved: its CUDA ordinal (index) and jax device."""

    def __init__(self, index: int, jax_device):
        self.index = index
        self.jax_device = jax_device

    def __str__(self):
        return f"cuda:{self.index}"

    def __repr__(self):
        return f"JaxGPU(cuda:{self.index}, {self.jax_device})"


def cuda_index(device) -> int:
    """The ordinal of "cuda" / "cuda:N" (or a torch.device that prints so)."""
    text = str(device)
    if text == "cuda":
        return 0
    if text.startswith("cuda:") and text[5:].isdigit():
        return int(text[5:])
    raise ValueError(f"device must be None or a CUDA device such as 'cuda:0', got {device!r}")


class DLPackGPU:
    """device= with output="dlpack": DLPackTensor objects of the device copy,
    ordered on the stream the consumer's from_dlpack passes to __dlpack__.
    Without a framework nothing can copy for this consumer, so the device
    path is the only one (the Consumer opens it itself: no backend)."""

    def __init__(self, index: int):
        self.index = index

    def __str__(self):
        return f"cuda:{self.index}"


def _check_jax_device(device: JaxGPU) -> JaxGPU:
    """device with its jax device, or CUDAUnavailable / ValueError."""
    index = device.index
    import jax

    try:
        gpus = jax.devices("gpu")
    except RuntimeError as e:
        raise CUDAUnavailable(
            f"device='{device}': JAX {jax.__version__} has no GPU backend ({e}); install jax[cuda12], "
            "or leave device=None for host arrays",
            _capi.ENOCUDA,
        ) from None
    if index >= len(gpus):
        raise ValueError(f"device='{device}': JAX sees only {len(gpus)} GPU(s)")
    return JaxGPU(index, gpus[index])
