"""A second device on a machine that has only a CPU: tensors "on cuda:0" that really live in host
memory, and a torch function mode that fails on anything a real GPU would refuse.

`VirtualCuda` tags a tensor as on the GPU when a factory is asked for that device, when `.to`
moves it there, or when an op reads a tagged tensor; `.device` then says cuda:0 and code takes
its GPU branches. It raises `DeviceMixed` on an op whose tensors sit on different devices (a
CPU scalar excepted, as CUDA allows), on a generator of the other device, and on host code
reading a GPU tensor's memory (`data_ptr`, `numpy`). Copies between devices (`copy_`, item
assignment, `.to`, `.cpu()`) and indexing a GPU tensor with CPU indices are allowed, as on a GPU.

Torch function modes are per thread: `VirtualCuda.enter_in(call)` pushes it on another thread
(the engine's compute thread) too.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

GPU = torch.device("cuda", 0)
HOST = torch.device("cpu")
_TAG = "_virtual_device"
_HOST_READS = {"data_ptr", "numpy", "__array__", "untyped_storage", "__dlpack__"}
_COPIES = {"copy_", "__setitem__"}  # may read a tensor of the other device
_MOVES = {"to", "cuda", "cpu"}
_UNCHECKED = {"_has_compatible_shallow_copy_type"}  # asks about two tensors, computes nothing
_PROPERTIES = {"device", "is_cuda", "is_cpu", "data"}


class DeviceMixed(AssertionError):
    """An op a real GPU would refuse: tensors of two devices, or host code reading GPU memory."""


def on(t: Tensor) -> torch.device:
    """Where `t` lives in the virtual world (call it with the mode off, or through `.device`)."""
    return getattr(t, _TAG, None) or HOST


def _tag(value, device: torch.device) -> None:
    for t in tree_flatten(value)[0]:
        if isinstance(t, Tensor):
            setattr(t, _TAG, device if device.type == "cuda" else None)


def place(module: nn.Module) -> nn.Module:
    """Put every parameter and buffer of `module` on the virtual GPU (tags only; nothing moves)."""
    for t in [*module.parameters(), *module.buffers()]:
        setattr(t, _TAG, GPU)
    return module


def _virtual(device) -> bool:
    return isinstance(device, (str, torch.device)) and torch.device(device).type == "cuda"


class VirtualGenerator(torch.Generator):
    """A torch.Generator that says it is on cuda:0 when asked for that device (and draws on the CPU)."""

    def __new__(cls, device="cpu"):
        g = super().__new__(cls, "cpu")
        g._device = torch.device(device)
        return g

    def __init__(self, device="cpu") -> None:
        pass

    @property
    def device(self) -> torch.device:
        return self._device


class VirtualCuda(TorchFunctionMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops = 0  # ops seen, to show the mode really ran

    def enter_in(self, call) -> None:
        """Push this mode on the thread that `call` runs functions on as well."""
        call(self.__enter__)

    def leave_in(self, call) -> None:
        call(lambda: self.__exit__(None, None, None))

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        self.ops += 1
        name = getattr(func, "__name__", "")
        owner = getattr(func, "__self__", None)
        prop = next((p for p in _PROPERTIES if owner is getattr(Tensor, p)), None)
        if prop is not None:
            return self._property(prop, func, args)
        if name in _HOST_READS and isinstance(args[0], Tensor) and on(args[0]).type == "cuda":
            raise DeviceMixed(f"host code reads the memory of a tensor on {GPU} (Tensor.{name})")
        if name in _MOVES and args and isinstance(args[0], Tensor):
            return self._move(name, func, args, kwargs)
        if name == "_parse_to":  # Module.to reading its arguments: the device must stay as asked
            return func(*args, **kwargs)
        if _virtual(kwargs.get("device")):  # a factory asked for the GPU
            out = func(*args, **{**kwargs, "device": HOST})
            _tag(out, GPU)
            return out
        return self._op(name, func, args, kwargs)

    def _property(self, prop: str, func, args):
        t = args[0]
        gpu = on(t).type == "cuda"
        if prop == "device":
            return GPU if gpu else func(*args)
        if prop == "is_cuda":
            return gpu
        if prop == "is_cpu":
            return not gpu
        out = func(*args)  # data: get (a view) or set (`param.data = moved`, as Module.to does)
        if len(args) == 2:
            _tag(t, on(args[1]))
        else:
            _tag(out, on(t))
        return out

    def _move(self, name: str, func, args, kwargs):
        src = args[0]
        target = _target(name, args, kwargs)
        rest = [HOST if _virtual(a) else a for a in args[1:]]
        options = {k: (HOST if k == "device" and _virtual(v) else v) for k, v in kwargs.items()}
        out = func(src, *rest, **options) if name != "cuda" else src
        if out is src:  # a move to another device makes a new tensor, never the same object
            out = src.view_as(src)
        _tag(out, target or on(src))
        return out

    def _op(self, name: str, func, args, kwargs):
        tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, Tensor)]
        self._check(name, tensors, kwargs.get("generator"), args)
        out = func(*args, **kwargs)
        if name == "tensor" or not tensors or kwargs.get("device") is not None:  # made on the host
            if tensors:
                out = out.view_as(out) if any(out is t for t in tensors) else out
                _tag(out, HOST)
            return out
        first = args[0] if args and isinstance(args[0], Tensor) else None
        if out is first:  # in place: the tensor stays where it is
            return out
        _tag(out, on(first) if name in ("__getitem__",) and first is not None else _common(tensors))
        return out

    def _check(self, name: str, tensors: list[Tensor], generator, args) -> None:
        if name in _UNCHECKED:
            return
        if name in _COPIES or name == "__getitem__":
            self._check_indexing(name, args)
            return
        devices = {on(t) for t in tensors if not (on(t) == HOST and t.dim() == 0)}
        if generator is not None and tensors:
            devices.add(torch.device(generator.device))
        if len(devices) > 1:
            shapes = ", ".join(f"{tuple(t.shape)} on {on(t)}" for t in tensors)
            raise DeviceMixed(f"{name} mixes devices: {shapes}" + (" and a generator" if generator else ""))

    @staticmethod
    def _check_indexing(name: str, args) -> None:
        """Indices on the host or the tensor's own device; a copied value from anywhere."""
        target = on(args[0]) if isinstance(args[0], Tensor) else HOST
        index = args[1] if name != "copy_" and len(args) > 1 else ()
        wrong = [on(t) for t in tree_flatten(index)[0] if isinstance(t, Tensor) and on(t) not in (HOST, target)]
        if wrong:
            raise DeviceMixed(f"{name} indexes a tensor on {target} with one on {wrong[0]}")


def _common(tensors: list[Tensor]) -> torch.device:
    return GPU if any(on(t).type == "cuda" for t in tensors) else HOST


def _target(name: str, args, kwargs) -> torch.device | None:
    """Where a move goes (None: it stays, as `.to(dtype)`)."""
    if name == "cuda":
        return GPU
    if name == "cpu":
        return HOST
    for a in (*args[1:], kwargs.get("device"), kwargs.get("other")):
        if isinstance(a, Tensor):
            return on(a)
        if isinstance(a, (str, torch.device)):
            return torch.device(a) if torch.device(a).type != "cuda" else GPU
    return None
