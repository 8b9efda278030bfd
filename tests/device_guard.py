"""A CPU stand-in for an accelerator that fails on device mixing (issue 17's device-discipline tests).

No GPU is lent to most sessions, yet the decode hooks must never mix a CPU tensor into GPU work nor
copy to the host on every step. :class:`DeviceGuard` (a ``TorchFunctionMode``) runs the real code on
CPU tensors while some of them *pose* as tensors on a CUDA device:

- ``guard.put(t)`` (or ``guard.tensor(...)``) marks a tensor as living on the device; its ``.device``
  then reads ``cuda:0`` inside the guard, so code that follows the logits' device asks for ``cuda``;
- a factory call (``torch.tensor``, ``zeros``, ``arange``, ``rand`` ...) or ``.to(...)`` asking for a
  CUDA device makes a device tensor; every other factory call makes a host tensor;
- any op that combines a device tensor with a host tensor of one or more dimensions (what CUDA
  refuses: "Expected all tensors to be on the same device") is recorded in ``violations``; so is a
  random op that draws device values from a host ``torch.Generator`` or the other way round
  (``guard.generator(seed)`` makes a device generator);
- every device-to-host read (``.cpu()``, ``.tolist()``, ``.item()``, ``int()``, ``float()``,
  ``bool()``, ``.numpy()``, ``.to("cpu")``) of a device tensor is recorded in ``host_reads``: the
  tests bound them (none per decode step, a few per verification).

Results of an op with a device input are device tensors (but for the reads above). Copies between
devices that PyTorch does allow (``copy_``, indexing with host indices, assigning into a slice) are
not violations. The values are the CPU's, so the code under test computes its real answers.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten, tree_map

DEVICE = torch.device("cuda", 0)
_HOST_READS = {"cpu", "tolist", "item", "__int__", "__float__", "__bool__", "__index__", "numpy"}
_MIXING_ALLOWED = {"copy_", "__setitem__", "__getitem__", "to", "__get__"}
_FACTORIES_WITH_DEVICE = {"tensor", "as_tensor", "zeros", "ones", "empty", "full", "arange", "rand", "randn",
                          "randint", "linspace", "eye", "zeros_like", "ones_like", "empty_like", "full_like",
                          "rand_like", "randn_like", "scalar_tensor", "randperm"}


def _is_device_spec(value: Any) -> torch.device | None:
    if isinstance(value, torch.device):
        return value
    if isinstance(value, str):
        try:
            return torch.device(value)
        except RuntimeError:
            return None
    return None


class DeviceGenerator(torch.Generator):
    """A CPU generator posing as one on :data:`DEVICE` (what ``torch.Generator(device="cuda")`` gives)."""

    @property
    def device(self) -> torch.device:  # type: ignore[override]
        return DEVICE


class DeviceGuard(TorchFunctionMode):
    """See the module docstring. Use as a context manager; inspect ``violations`` and ``host_reads``."""

    def __init__(self) -> None:
        super().__init__()
        self._on_device: dict[int, weakref.ref] = {}
        self.violations: list[str] = []
        self.host_reads: list[str] = []

    # ----- marking -----
    def put(self, t: torch.Tensor) -> torch.Tensor:
        self._on_device[id(t)] = weakref.ref(t)
        return t

    def tensor(self, data: Any, **kwargs: Any) -> torch.Tensor:
        with torch._C.DisableTorchFunction():
            return self.put(torch.tensor(data, **kwargs))

    @staticmethod
    def generator(seed: int) -> torch.Generator:
        """A device generator: a host generator whose ``.device`` reads ``cuda:0``."""
        g = DeviceGenerator()
        g.manual_seed(seed)
        return g

    def on_device(self, t: Any) -> bool:
        if not isinstance(t, torch.Tensor):
            return False
        ref = self._on_device.get(id(t))
        return ref is not None and ref() is t

    def reset_counts(self) -> None:
        self.violations.clear()
        self.host_reads.clear()

    # ----- the mode -----
    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = dict(kwargs or {})
        name = getattr(func, "__name__", str(func))
        if name == "__get__":
            return self._attribute(func, args)
        leaves, _ = tree_flatten((args, kwargs))
        tensors = [x for x in leaves if isinstance(x, torch.Tensor)]
        dev_in = any(self.on_device(t) for t in tensors)
        wants_device, kwargs, args = self._strip_device(name, args, kwargs)
        if name in _HOST_READS or (name == "to" and wants_device is False):
            if dev_in and self.on_device(args[0]):
                self.host_reads.append(name)
            return self._fresh(func(*args, **kwargs), args[0])
        if dev_in and name not in _MIXING_ALLOWED:
            host = [t for t in tensors if not self.on_device(t) and t.dim() > 0]
            if host:
                self.violations.append(f"{name}: a device tensor with host tensor(s) of shape "
                                       f"{[tuple(t.shape) for t in host]}")
        out_on_device = dev_in or bool(wants_device)
        if name == "to" and wants_device is None:
            out_on_device = self.on_device(args[0])
        generator = kwargs.get("generator")
        if isinstance(generator, torch.Generator):
            on_dev_gen = isinstance(generator, DeviceGenerator)
            if on_dev_gen != out_on_device:
                self.violations.append(f"{name}: a {'device' if on_dev_gen else 'host'} generator drew "
                                       f"{'device' if out_on_device else 'host'} values")
        result = func(*args, **kwargs)
        if name in ("to", "cuda") and out_on_device != self.on_device(args[0]):
            result = self._fresh(result, args[0])  # a copy on the other device, not the same tensor
        if out_on_device:
            tree_map(lambda x: self.put(x) if isinstance(x, torch.Tensor) else x, result)
        return result

    @staticmethod
    def _fresh(result: Any, source: Any) -> Any:
        if result is source and isinstance(result, torch.Tensor):
            with torch._C.DisableTorchFunction():
                return result.clone()
        return result

    def _attribute(self, func: Any, args: Any) -> Any:
        descriptor = getattr(func, "__self__", None)
        obj = args[0] if args else None
        if self.on_device(obj):
            if descriptor is torch.Tensor.device:
                return DEVICE
            if descriptor is torch.Tensor.is_cuda:
                return True
            if descriptor is torch.Tensor.is_cpu:
                return False
        return func(*args)

    def _strip_device(self, name: str, args: Any, kwargs: dict) -> tuple[bool | None, dict, Any]:
        """Remove a CUDA device request (the tensor is made on the CPU and marked); returns whether a
        device was asked for (True: CUDA, False: CPU, None: no device named)."""
        wants: bool | None = None
        if "device" in kwargs and kwargs["device"] is not None:
            dev = _is_device_spec(kwargs["device"])
            if dev is not None:
                wants = dev.type != "cpu"
                if wants:
                    kwargs = {**kwargs, "device": "cpu"}
        if name == "to":
            new_args = [args[0]]
            for a in args[1:]:
                dev = _is_device_spec(a)
                if dev is not None:
                    wants = dev.type != "cpu"
                    new_args.append(torch.device("cpu"))
                elif isinstance(a, torch.Tensor):
                    wants = self.on_device(a)
                    new_args.append(a)
                else:
                    new_args.append(a)
            args = tuple(new_args)
        elif name == "cuda":
            wants = True
        return wants, kwargs, args
