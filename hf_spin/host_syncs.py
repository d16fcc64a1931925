"""Counting host-device synchronisations, per phase of the engine (the decoding step's sync budget).

    with count_syncs() as syncs:
        model.generate(**batch, custom_generate=hf_spin.generate, assistant_pool=pool)
    syncs.per_step()             # syncs per speculative step: the engine's "step" phase / steps taken
    syncs.sites.most_common(5)   # which lines of hf_spin caused them ("engine.py:312")

A sync is anything that makes the host wait for the device: reading a device tensor's values on the
host, an op whose output shape depends on device data, a blocking copy between host and device.
`SpinEngine.step` marks its phases (`phase`): "retire" (rows that stopped leave, at every call),
"admit" (prefill and first tokens of joining rows) and "step" (plan, draft, verify, commit of one
speculative step). `per_step` charges retirement to the steps; outside any phase counts go to
"other". With no counter active nothing is counted and `phase` costs one list check.

Two ways of counting (`mode`):

"cuda": `torch.cuda.set_sync_debug_mode("warn")` and the warnings it raises, counted. Exactly what
    the CUDA runtime calls make the host wait for (D2H reads, `nonzero`, blocking H2D copies from
    pageable memory, `torch.cuda.synchronize`, ...). Sees CUDA only: work on the CPU counts nothing.

"instrumented" (any device; the tests on CPU): a TorchFunctionMode and a TorchDispatchMode that
    give every tensor a side, host or device, as it would have on a GPU, and count what would
    synchronise there. Host: made by a factory without `device=` (`torch.tensor(list)`,
    `torch.arange(n)`, ...) or with a device that names the host ("cpu", a host tensor or its
    `.device`), made by `.cpu()`, or computed from host tensors alone. Device: everything else
    (parameters, model outputs, tensors made by C++ code, factories given `device=model.device`
    or any other device; on a CPU run those are the host too). Counted as syncs:
      - reading a device tensor on the host: `.item()`, `int()/float()/bool()`, a tensor used as an
        index (`aten._local_scalar_dense`), `.tolist()`, `.numpy()`, `.cpu()`, `.to(host)`;
      - ops whose output shape depends on device data: `nonzero`, `torch.equal`, `unique`,
        `masked_select`, boolean-mask indexing (`x[mask]`, `x[mask] = v`), `repeat_interleave`
        with tensor repeats and no `output_size`, `bincount`;
      - blocking host-to-device copies: `torch.tensor(data, device=d)` / `torch.as_tensor(data,
        device=d)` (non-empty), indexing a device tensor with a Python list (`x[[0, 2]]`,
        `x[:, list]`), `host.to(d)` / `.cuda()` without `non_blocking=True`, `copy_` between the sides;
      - an op mixing a host tensor of >= 1 dimension with device tensors (an implicit copy).
    Not counted, but reported in `async_copies`: `host.to(d, non_blocking=True)` (`to_device`).
    What it cannot see: ops inside C++ kernels (only what reaches Python's dispatch), syncs inside
    custom Triton or CUDA kernels, `torch.cuda.synchronize` and stream or event waits,
    a torch.device built by hand that names the host (`torch.device("cpu")`: read as the device),
    and work on other threads than the one that entered the counter (the modes are per thread).

`mode="auto"` picks "cuda" once CUDA is initialised in this process, else "instrumented".
"""

from __future__ import annotations

import contextlib
import os
import sys
import warnings
from collections import Counter
from dataclasses import dataclass, field

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

aten = torch.ops.aten

_THIS_FILE = os.path.abspath(__file__)
_PACKAGE_DIR = os.path.dirname(_THIS_FILE)
_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__))
_SIDE = "_hf_spin_side"  # attribute: where a tensor would live on a GPU (instrumented mode)
CUDA_SYNC_WARNING = "called a synchronizing CUDA operation"

# aten ops that read device data on the host or size their output from it: kind of sync.
_SYNC_OPS = {
    aten._local_scalar_dense: "item",
    aten.nonzero: "nonzero",
    aten.equal: "equal",
    aten._unique: "unique",
    aten._unique2: "unique",
    aten.unique_dim: "unique",
    aten.unique_consecutive: "unique",
    aten.masked_select: "masked_select",
    aten.bincount: "bincount",
}
# Python-level factories: without device= they make host tensors.
_FACTORIES = {
    torch.tensor, torch.as_tensor, torch.arange, torch.zeros, torch.ones, torch.full, torch.empty,
    torch.rand, torch.randn, torch.randint, torch.randperm, torch.linspace, torch.eye,
}  # fmt: skip
_FROM_DATA = {torch.tensor, torch.as_tensor}  # factories that copy host data


@dataclass
class SyncCounter:
    """What a `count_syncs` block saw: every sync, by phase, kind and hf_spin call site."""

    mode: str
    count: int = 0  # syncs in the block, every phase
    phases: Counter = field(default_factory=Counter)  # phase -> syncs ("step", "admit", "other")
    entries: Counter = field(default_factory=Counter)  # phase -> times entered ("step": speculative steps taken)
    kinds: Counter = field(default_factory=Counter)  # "item", "tolist", "nonzero", "h2d", ... (instrumented); "cuda"
    sites: Counter = field(
        default_factory=Counter
    )  # "file.py:line" of the innermost hf_spin frame (else the innermost caller's)
    step_sites: Counter = field(default_factory=Counter)  # the same, for the "step" and "retire" phases alone
    callers: Counter = field(
        default_factory=Counter
    )  # "file.py:line" of the innermost frame outside torch (transformers, ...)
    async_copies: int = 0  # non-blocking host-to-device copies (instrumented mode; not syncs)
    current: str = "other"  # the phase being counted

    def per_step(self, exclude: tuple[str, ...] = ()) -> float:
        """Syncs per speculative step: the "step" and "retire" phases over the steps taken, leaving out
        call sites that start with any of `exclude` (e.g. "kernels/": on the CPU the varlen kernel's
        reference runs, which reads its metadata on the host; CUDA runs the Triton kernel instead)."""
        left_out = sum(n for site, n in self.step_sites.items() if site.startswith(exclude)) if exclude else 0
        return (self.phases["step"] + self.phases["retire"] - left_out) / max(self.entries["step"], 1)

    def record(self, kind: str) -> None:
        site, caller = _call_site()
        self.callers[caller] += 1
        self.count += 1
        self.phases[self.current] += 1
        self.kinds[kind] += 1
        self.sites[site] += 1
        if self.current in ("step", "retire"):
            self.step_sites[site] += 1


_active: list[SyncCounter] = []  # the counters running, innermost last


def wait_for(device: torch.device) -> None:
    """Wait until `device` has run what was queued on it (a CUDA device; a CPU ran it already): a timing's end."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@contextlib.contextmanager
def phase(name: str):
    """Count the syncs of the enclosed code under `name` (a no-op when no counter is active)."""
    if not _active:
        yield
        return
    counter = _active[-1]
    previous, counter.current = counter.current, name
    counter.entries[name] += 1
    try:
        yield
    finally:
        counter.current = previous


@contextlib.contextmanager
def count_syncs(mode: str = "auto"):
    """Count host-device syncs in the block; yields a `SyncCounter` (module docstring: what counts)."""
    if mode == "auto":
        mode = "cuda" if torch.cuda.is_available() and torch.cuda.is_initialized() else "instrumented"
    if mode not in ("cuda", "instrumented"):
        raise ValueError(f"count_syncs(mode={mode!r}): use 'auto', 'cuda' or 'instrumented'")
    counter = SyncCounter(mode)
    _active.append(counter)
    try:
        if mode == "cuda":
            with _cuda_warnings(counter):
                yield counter
        else:
            with _HostFunctions(counter), _DeviceOps(counter):
                yield counter
    finally:
        _active.remove(counter)


def _call_site() -> tuple[str, str]:
    """('file.py:line' of the innermost hf_spin frame, else "?"; that of the innermost frame outside
    torch and this module, whichever package it is in)."""
    frame, site, caller = sys._getframe(1), None, None
    while frame is not None and site is None:
        path = frame.f_code.co_filename
        ours = path == _THIS_FILE or path.startswith(_TORCH_DIR) or path.endswith("contextlib.py")
        if caller is None and not ours:
            caller = f"{os.path.basename(path)}:{frame.f_lineno}"
        if path.startswith(_PACKAGE_DIR) and path != _THIS_FILE:
            site = f"{os.path.relpath(path, _PACKAGE_DIR)}:{frame.f_lineno}"
        frame = frame.f_back
    return site or "?", caller or "?"


# -- "cuda": the runtime's own sync warnings ----------------------------------------------------------
@contextlib.contextmanager
def _cuda_warnings(counter: SyncCounter):
    previous_mode = torch.cuda.get_sync_debug_mode()
    with warnings.catch_warnings():
        warnings.filterwarnings("always", message=CUDA_SYNC_WARNING)
        show = warnings.showwarning

        def count(message, category, filename, lineno, file=None, line=None):
            if CUDA_SYNC_WARNING in str(message):
                counter.record("cuda")  # called while the op's Python caller is still on the stack
            else:
                show(message, category, filename, lineno, file, line)

        warnings.showwarning = count
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield
        finally:
            torch.cuda.set_sync_debug_mode(previous_mode)


# -- "instrumented": host tensors vs device tensors ---------------------------------------------------
HOST, NEUTRAL, DEVICE = "host", "neutral", "device"


def _side(t: torch.Tensor) -> str:
    """Where `t` would live on a GPU: HOST, DEVICE, or NEUTRAL (a wrapped Python number: it takes the side
    of what it is combined with). Unmarked tensors (parameters, tensors made by C++ code) are DEVICE,
    but for unmarked 0-dim ones."""
    return getattr(t, _SIDE, DEVICE if t.dim() else NEUTRAL)


def _mark(t: torch.Tensor, side: str) -> torch.Tensor:
    if _side(t) != side:
        try:
            setattr(t, _SIDE, side)
        except (AttributeError, RuntimeError):  # some tensor subclasses refuse attributes
            pass
    return t


def _moved(out: torch.Tensor, self_: torch.Tensor, side: str) -> torch.Tensor:
    """A copy's result marked `side`; an alias when the op returned its input (a no-op move on the CPU),
    so that the input keeps its own side."""
    return _mark(out.view_as(out) if out is self_ else out, side)


def _combined(sides: list[str]) -> str:
    return DEVICE if DEVICE in sides else HOST if HOST in sides else NEUTRAL


def _target(args, kwargs):
    """The device a factory's `device=` or a `.to(...)` names (a torch.device, str, int or tensor), else None."""
    if kwargs.get("device") is not None:
        return kwargs["device"]
    for a in args:
        if isinstance(a, (torch.device, str, int, torch.Tensor)) and not isinstance(a, bool):
            return a
    return None


class _HostFunctions(TorchFunctionMode):
    """Python-level calls: factories (host or device), host reads, `.to` / `.cpu` / `.cuda` copies."""

    def __init__(self, counter: SyncCounter):
        super().__init__()
        self.counter = counter
        self.host_devices: dict[
            int, torch.device
        ] = {}  # id -> a torch.device read off a host tensor (kept alive: ids stay unique)

    def _is_host(self, device) -> bool:
        """Whether a device argument names the host: the literal "cpu", a host tensor, or a host tensor's `.device`."""
        if isinstance(device, torch.Tensor):
            return _side(device) == HOST
        if isinstance(device, str):
            return device.startswith("cpu")
        return id(device) in self.host_devices

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if getattr(func, "__self__", None) is torch.Tensor.device:  # `.device`: remember those of host tensors
            if args and _side(args[0]) == HOST:
                self.host_devices[id(out)] = out
            return out
        if func in _FACTORIES:
            device = kwargs.get("device")
            to_host = device is None or self._is_host(device)
            data = args[0] if args else kwargs.get("data")
            if isinstance(data, torch.Tensor):  # as_tensor / tensor of a tensor: a move at most
                if device is not None and _side(data) != (HOST if to_host else DEVICE) and _side(data) != NEUTRAL:
                    self.counter.record("h2d" if _side(data) == HOST else "d2h")
                    return _moved(out, data, HOST if to_host else DEVICE)
                return out  # the dispatch mode gave it the side of its input
            if not to_host and func in _FROM_DATA and out.numel():
                self.counter.record("h2d")  # torch.tensor(list, device=d): a blocking copy from pageable memory
            return _mark(out, HOST if to_host else DEVICE)
        name = getattr(func, "__name__", "")
        if not args or not isinstance(args[0], torch.Tensor):
            return out
        self_ = args[0]
        side = _side(self_)
        if name in ("tolist", "numpy", "__array__"):
            if side == DEVICE:
                self.counter.record(name.strip("_"))
        elif name in ("__getitem__", "__setitem__"):
            if side == DEVICE and len(args) > 1 and _list_index(args[1]):
                self.counter.record("h2d")  # the list becomes an index tensor copied from pageable memory
        elif name == "cpu":
            if side == DEVICE:
                self.counter.record("d2h")
            return _moved(out, self_, HOST)
        elif name in ("to", "cuda"):
            target = _target(args[1:], kwargs) if name == "to" else "cuda"
            if target is None:
                return out
            non_blocking = bool(kwargs.get("non_blocking", False)) or any(a is True for a in args[1:])
            if side != DEVICE and not self._is_host(target):
                if side == HOST:
                    if non_blocking:
                        self.counter.async_copies += 1
                    else:
                        self.counter.record("h2d")
                return _moved(out, self_, DEVICE)
            if side == DEVICE and self._is_host(target):
                self.counter.record("d2h")
                return _moved(out, self_, HOST)
        return out


def _list_index(index) -> bool:
    """Whether an index holds a non-empty Python list (alone or in a tuple): on CUDA, indexing a device
    tensor with one copies it to the device from pageable memory, which waits for the stream."""
    parts = index if isinstance(index, tuple) else (index,)
    return any(isinstance(part, list) and part for part in parts)


class _DeviceOps(TorchDispatchMode):
    """aten-level ops: data-dependent syncs on device tensors, mixed host/device ops, sides of outputs."""

    def __init__(self, counter: SyncCounter):
        super().__init__()
        self.counter = counter

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        inputs = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        sides = [_side(t) for t in inputs]
        device = DEVICE in sides
        kind = self._sync_kind(func, args, kwargs)
        if kind is not None and device:
            self.counter.record(kind)
        elif func is aten.copy_.default and len(args) >= 2:
            dst, src = _side(args[0]), _side(args[1])
            if dst == HOST and src == DEVICE:
                self.counter.record("d2h")
            elif dst == DEVICE and src == HOST:
                if kwargs.get("non_blocking", args[2] if len(args) > 2 else False):
                    self.counter.async_copies += 1
                else:
                    self.counter.record("h2d")
        elif device and any(side == HOST and t.dim() > 0 for t, side in zip(inputs, sides)):
            self.counter.record("implicit_copy")
        if inputs:
            side = _combined(sides)
            mutated = (
                func._schema.is_mutable or "out" in kwargs
            )  # in place: its first argument (or out=) takes the side too
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor) and not (
                    mutated and _side(t) == HOST
                ):  # a host tensor written in place stays host (the write was counted)
                    _mark(t, side)
        return out

    @staticmethod
    def _sync_kind(func, args, kwargs) -> str | None:
        packet = func.overloadpacket
        if packet in _SYNC_OPS:
            return _SYNC_OPS[packet]
        if (
            packet is aten.repeat_interleave
            and isinstance(args[0], torch.Tensor)
            and args[0].dim() > 0
            and kwargs.get("output_size") is None
        ):
            repeats = args[1] if len(args) > 1 else args[0]
            return "repeat_interleave" if isinstance(repeats, torch.Tensor) and repeats.numel() > 1 else None
        if packet in (aten.index, aten.index_put, aten.index_put_, aten._index_put_impl_) and len(args) > 1:
            if any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in args[1]):
                return "mask_index"
        return None


# -- copying to the device without a sync ---------------------------------------------------------------
def to_device(data, device, dtype: torch.dtype | None = None) -> torch.Tensor:
    """`data` (numbers or nested lists of them, or a host tensor) as a tensor on `device`, without the
    host waiting for the device: on CUDA staged in pinned memory and copied asynchronously on the
    current stream, so every kernel launched after it sees it (the pinned buffer is held until the
    copy is done). A plain `torch.tensor(data, device=cuda)` copies from pageable memory, which waits
    for the stream first."""
    host = data if isinstance(data, torch.Tensor) else torch.tensor(data, dtype=dtype)
    if dtype is not None and host.dtype != dtype:
        host = host.to(dtype)
    device = torch.device(device)
    if device.type == "cuda":
        host = host.contiguous().pin_memory()
    return host.to(device, non_blocking=True)


def read_later(values: torch.Tensor):
    """A read of `values` on the host, begun now and finished by the returned call, which gives their
    `tolist()`: on CUDA an asynchronous copy into pinned memory, queued before whatever the host launches
    next, and an event that the call waits on (one sync, counted as one); elsewhere the values, read by
    the call. So work launched between the two (the next step's forward, engine.py) does not delay the read."""
    if values.device.type != "cuda":
        return values.tolist
    host = torch.empty(values.shape, dtype=values.dtype, pin_memory=True)
    host.copy_(values, non_blocking=True)
    copied = torch.cuda.Event()
    copied.record()

    def read() -> list:
        if _active:
            _active[-1].record("event")
        copied.synchronize()
        return host.tolist()

    return read
