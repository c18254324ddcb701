"""What a dry run observes while the real engine runs on fake tensors: live tensor bytes and their
peak, the collectives issued, and every host read of a tensor value.

`DryRunTrace` is a `TorchDispatchMode` pushed inside the dry run's `FakeTensorMode`, so it sees every
aten op the engine dispatches (C++-originated ones too: DDP's bucket allocation, autograd's gradient
buffers) before the fake mode computes its output's metadata. It does three things:

memory      Every storage an op's output lives in is counted once, from the op that made it until
            Python frees it (a weakref callback), and re-counted when its size changes: FSDP2 frees and
            re-allocates unsharded parameters with `UntypedStorage.resize_`, which is no dispatched op,
            so `resize_` is wrapped for the duration of the trace. Each size is one "block" with the
            sequence number of its allocation and free; the peak is the largest running total, and
            the blocks alive at the peak are classified afterwards (parameters, gradients, optimizer
            state, gathered parameters, communication buffers, activations, other temporaries).
            These are live tensor bytes, what `logging.track_tensor_bytes` measures on a CPU run and
            `torch.cuda.max_memory_allocated` on a GPU: no allocator rounding or caching, no
            kernel-internal workspaces (which no dispatched op allocates).
collectives every op of the `c10d` and `_c10d_functional` namespaces, with the process group it ran
            on (named by the mesh dimension), its kind and its bytes (the collective's whole buffer,
            as nccl-tests count size: all-gather's output, reduce-scatter's input).
host reads  `aten._local_scalar_dense` (`.item()`, `float()`, `int()`, `.tolist()` of a tensor) raises on
            a fake tensor; here it is answered with a neutral value (0 / False / 1.0) and recorded
            with the first frame of this package on the Python stack. Consecutive reads from one
            place with no op between them are one synchronization (a `.tolist()`). On a GPU rank a
            read of a host tensor (a CPU generator's draw) waits for no device and is not recorded,
            a blocking copy of a device tensor to the host is;
            `torch.cuda.synchronize()` and an event's or stream's `synchronize()` are recorded by the
            dry run through dryrun/fake_cuda.py.

Considered: `torch.distributed._tools.MemTracker` / `FSDPMemTracker` (same dispatch-mode technique,
per-module peaks). They do not see DDP's buckets or pipeline buffers as such, report one category
scheme per tracker, and a first try gave an optimizer-state total far above the sharded state
(shared/TORCH-ON-CPU.md); the dry run needs the peak's phase and our planner's categories, so the
bookkeeping is ours. Two of MemTracker's findings are followed: DTensor ops are left to DTensor
(returning NotImplemented) so that only the local shard ops are counted, and the fake mode's
`wait_tensor` returns a new tensor where eager returns its input, so it is not counted.
"""

from __future__ import annotations

import traceback
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from .torch_internals import (
    FakeTensor,
    ShardingPropagator,
    TorchDispatchMode,
    _create_work_from_future,
    detect_fake_mode,
    tree_leaves,
    unset_fake_temporarily,
)

_PACKAGE = str(Path(__file__).resolve().parent.parent)  # .../scalable_transformer
_DRYRUN = str(Path(__file__).resolve().parent)  # the dry run's own frames are not where a sync is
_TORCH = str(Path(torch.__file__).resolve().parent)
_aten = torch.ops.aten
COLLECTIVE_NAMESPACES = ("c10d", "_c10d_functional")

# op name -> kind as users know it (nccl-tests / the engine's comm recorder)
_KINDS = {
    "allreduce_": "all_reduce",
    "all_reduce": "all_reduce",
    "all_reduce_": "all_reduce",
    "all_reduce_coalesced": "all_reduce",
    "allreduce_coalesced_": "all_reduce",
    "_allgather_base_": "all_gather",
    "allgather_": "all_gather",
    "allgather_into_tensor_coalesced_": "all_gather",
    "all_gather_into_tensor": "all_gather",
    "all_gather_into_tensor_out": "all_gather",
    "all_gather_into_tensor_coalesced": "all_gather",
    "_reduce_scatter_base_": "reduce_scatter",
    "reduce_scatter_": "reduce_scatter",
    "reduce_scatter_tensor_coalesced_": "reduce_scatter",
    "reduce_scatter_tensor": "reduce_scatter",
    "reduce_scatter_tensor_coalesced": "reduce_scatter",
    "broadcast_": "broadcast",
    "broadcast": "broadcast",
    "alltoall_": "all_to_all",
    "alltoall_base_": "all_to_all",
    "all_to_all_single": "all_to_all",
    "send": "send",
    "recv_": "recv",
    "recv_any_source_": "recv",
    "barrier": "barrier",
    "reduce_": "reduce",
    "gather_": "gather",
    "scatter_": "scatter",
}
# Gloo (the CPU backend) stages these through a temporary of the collective's whole buffer, allocated
# with torch's CPU allocator (measured with the profiler on 2 processes, torch 2.13: reduce_scatter_tensor
# and all_gather_into_tensor each peaked one full-size buffer above their input and output; all_reduce
# and broadcast none). NCCL works in the output buffer. The buffer lives while the collective runs
# (a synchronous op on the issuing thread here): counted as a spike. (A real gloo run's worker thread
# often frees it, out of the profiler's sight: metrics/live_tensor_bytes.replay_allocations dates those.)
_GLOO_STAGED = {
    "_allgather_base_",
    "_reduce_scatter_base_",
    "all_gather_into_tensor",
    "reduce_scatter_tensor",
}
# ops whose output shape depends on tensor values (the fake mode cannot run them)
_DATA_DEPENDENT = {_aten.nonzero.default, _aten.masked_select.default}

# breakdown keys, in the planner's vocabulary (plan/memory_model.py), in the order they are assigned
CATEGORIES = (
    "parameters",
    "optimizer_state",
    "gradients",
    "gathered_parameters",
    "communication_buffers",
    "activations",
    "compute_dtype_weights",
    "batch",
    "other_temporaries",
)


@dataclass
class Block:
    """One size of one storage: `bytes` from op number `born` until op number `died` (None: alive)."""

    serial: int  # the storage's serial number (stable across its resizes)
    bytes: int
    born: int
    phase: str
    backward: bool  # allocated while autograd ran a backward node
    op: str = ""
    died: int | None = None


@dataclass
class HostRead:
    where: str  # path:line of the first frame in this package (else the first outside torch)
    step: int  # the training step it happened in (0: before the first)


@dataclass
class CollectiveCall:
    step: int
    group: str
    kind: str
    bytes: int


@dataclass
class Peak:
    bytes: int = 0
    seq: int = -1
    phase: str = ""
    module: str = ""
    op: str = ""
    step: int = 0


class DryRunTrace(TorchDispatchMode):
    """Push inside the dry run's FakeTensorMode (see the module docstring). `group_names` maps a process
    group's name to the label reported for it ("dp", "tp", "pp", ...)."""

    def __init__(
        self, group_names: dict[str, str] | None = None, backend: str = "nccl", device_type: str = "cpu"
    ) -> None:
        super().__init__()
        # only tensors on the simulated device count (a GPU rank's offloaded host states do not)
        self.device_type = device_type
        self.group_names = dict(group_names or {})
        self.backend = backend  # the backend the real run would use: its own buffers are modelled
        self.blocks: list[Block] = []
        self._open: dict[int, Block] = {}  # serial -> its current block
        self._serial_of: dict[int, int] = {}  # id(storage) -> serial, while the storage lives
        self._refs: dict[int, weakref.ref] = {}  # serial -> weakref to its storage
        self._next_serial = 0
        self.seq = 0
        self.live = 0
        self.peak = Peak()
        self.step = 0
        self.phase = "build"
        self.module_tracker: Any = None  # torch's ModTracker: the module running now
        self.host_reads: list[HostRead] = []
        self._last_read_key: tuple[str, int, int] | None = None
        self.collectives: list[CollectiveCall] = []
        self.tags: dict[int, str] = {}  # serial -> category, for tags known when the storage is alive
        self.cast_from: dict[int, int] = {}  # serial of a dtype cast's output -> serial of its input
        self._fake_mode: Any = None
        self._orig_resize: Any = None
        self.op = ""  # the op running now (the peak's `op`)
        self.paused = 0  # > 0 while DTensor propagates metadata on global-shape fake tensors
        self.read_value: Any = None  # the answer to host reads, when a caller knows it (else zero)
        self._orig_propagate: Any = None

    # ------------------------------------------------------------ context

    def __enter__(self) -> DryRunTrace:

        self._fake_mode = detect_fake_mode()
        self._orig_resize = torch.UntypedStorage.resize_
        trace = self

        def resize_(storage: torch.UntypedStorage, size: int) -> Any:
            result = trace._orig_resize(storage, size)
            trace.op = "UntypedStorage.resize_"
            trace._resized(storage)
            return result

        torch.UntypedStorage.resize_ = resize_  # type: ignore[method-assign,assignment]
        # DTensor learns an op's output metadata by running it on global-shape fake tensors, on the
        # fake mode already active (ours): those ops are not this rank's memory, so the trace pauses

        self._orig_propagate = propagate = ShardingPropagator._propagate_tensor_meta_non_cached

        def paused(propagator: Any, op_schema: Any) -> Any:
            trace.paused += 1
            try:
                return propagate(propagator, op_schema)
            finally:
                trace.paused -= 1

        ShardingPropagator._propagate_tensor_meta_non_cached = paused  # type: ignore[method-assign,assignment]
        super().__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:

        super().__exit__(*exc)
        torch.UntypedStorage.resize_ = self._orig_resize  # type: ignore[method-assign]
        ShardingPropagator._propagate_tensor_meta_non_cached = self._orig_propagate  # type: ignore[method-assign]

    # ------------------------------------------------------------ where we are

    def where_module(self) -> str:
        tracker = self.module_tracker
        if tracker is None:
            return ""
        parents = [p for p in tracker.parents if p != "Global"]
        return max(parents, key=lambda p: p.count("."), default="")

    def current_phase(self, in_backward: bool | None = None) -> str:
        if in_backward is None:
            in_backward = torch._C._current_autograd_node() is not None
        if in_backward:  # autograd's engine runs a backward node
            if self.phase in ("train", "forward-compute"):
                return "backward-compute"
            return f"{self.phase}:backward"
        return self.phase

    # ------------------------------------------------------------ memory

    def _track(self, storage: torch.UntypedStorage) -> None:
        key = id(storage)
        serial = self._serial_of.get(key)
        if serial is not None:
            block = self._open.get(serial)
            if block is not None and block.bytes != storage.nbytes():
                self._resized(storage)
            return
        serial = self._next_serial
        self._next_serial += 1
        self._serial_of[key] = serial

        def freed(_ref: Any, serial: int = serial, key: int = key) -> None:
            self._close(serial)
            if self._serial_of.get(key) == serial:
                del self._serial_of[key]
            self._refs.pop(serial, None)

        self._refs[serial] = weakref.ref(storage, freed)
        self._open_block(serial, storage.nbytes())

    def _transient(self, nbytes: int) -> None:
        """A buffer that exists only during the op (a backend's staging copy)."""
        serial = self._next_serial
        self._next_serial += 1
        self.tags[serial] = "communication_buffers"
        self._open_block(serial, nbytes)
        self._close(serial)

    def _open_block(self, serial: int, nbytes: int) -> None:
        self.seq += 1
        backward = torch._C._current_autograd_node() is not None
        block = Block(serial, nbytes, self.seq, self.current_phase(backward), backward, self.op)
        self.blocks.append(block)
        self._open[serial] = block
        self.live += nbytes
        if self.live > self.peak.bytes:
            self.peak = Peak(self.live, self.seq, block.phase, self.where_module(), self.op, self.step)

    def _close(self, serial: int) -> None:
        block = self._open.pop(serial, None)
        if block is None:
            return
        self.seq += 1
        block.died = self.seq
        self.live -= block.bytes

    def _resized(self, storage: torch.UntypedStorage) -> None:
        serial = self._serial_of.get(id(storage))
        if serial is None:  # not a storage of the device's tensors (host memory, or never seen)
            return None
        block = self._open.get(serial)
        if block is not None and block.bytes == storage.nbytes():
            return None
        self._close(serial)
        if storage.nbytes():
            self._open_block(serial, storage.nbytes())
            if block is None or block.bytes == 0:  # FSDP2 re-allocating an unsharded parameter
                self.tags.setdefault(serial, "gathered_parameters")
        return None

    def serial(self, tensor: torch.Tensor) -> int | None:
        """The serial number of a (plain) tensor's storage, if traced."""
        try:
            return self._serial_of.get(id(tensor.untyped_storage()))
        except (RuntimeError, NotImplementedError):
            return None

    def adopt(self, tensors: Any, category: str) -> None:
        """Track tensors made before the trace began (a real run's parameters, observed from its
        first step) as blocks of `category`, so that views of them (a weight's `.t()`) are not taken
        for new storage."""
        for t in tree_leaves(tensors):
            if isinstance(t, torch.Tensor):
                local = getattr(t, "_local_tensor", t)
                if local.device.type == self.device_type:
                    self._track(local.untyped_storage())
        self.tag(tensors, category)

    def tag(self, tensors: Any, category: str, overwrite: bool = False) -> None:
        """Mark the storages of `tensors` (DTensors: their local shards) as `category`."""
        for t in tree_leaves(tensors):
            if not isinstance(t, torch.Tensor):
                continue
            local = getattr(t, "_local_tensor", t)
            serial = self.serial(local)
            if serial is None:
                continue
            if overwrite:
                self.tags[serial] = category
            else:
                self.tags.setdefault(serial, category)

    # ------------------------------------------------------------ dispatch

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:

        kwargs = kwargs or {}
        if any(t is DTensor for t in types):
            return NotImplemented  # let DTensor run its local ops, which come back here
        if self.paused:
            return func(*args, **kwargs)
        if func.namespace in COLLECTIVE_NAMESPACES:  # also on host tensors made from Python floats
            self._last_read_key = None
            self.op = str(func)
            return self._collective(func, args, kwargs)
        if self._fake_mode is not None and _only_real_tensors((args, kwargs)):
            # a DeviceMesh's rank table (sub-mesh coordinates): real data, run for real and not counted

            with unset_fake_temporarily():
                return func(*args, **kwargs)
        dependent = _data_dependent(func, args)
        if self._fake_mode is None and (dependent or func is _aten._local_scalar_dense.default):
            # on real tensors (a real run observed with this trace): record the read, run the op
            self._host_read(None)
            out = func(*args, **kwargs)
            self._record_outputs(out)
            return out
        if func is _aten._local_scalar_dense.default:
            if self.device_type != "cpu" and args[0].device.type == "cpu":
                # a host tensor's value on a GPU rank (a CPU generator's draw): no device to wait for
                return _neutral(args[0]) if self.read_value is None else self.read_value
            return self._host_read(args[0])
        if func is _aten._pin_memory.default:
            # a page-locked host copy (offload to the CPU of a GPU rank): host memory, which the fake
            # mode has no kernel for; an ordinary host copy has the same shape and is not counted
            with self._fake_mode:
                return args[0].clone()
        if dependent:
            return self._data_dependent(func, args, kwargs)
        if self.device_type != "cpu" and _device_to_host(func, args, kwargs):
            self._host_read(None)  # a blocking copy to host memory waits for the device's queue
        self._last_read_key = None
        self.op = str(func)
        out = func(*args, **kwargs)
        self._record_outputs(out)
        if func is _aten._to_copy.default and isinstance(out, torch.Tensor):
            source, cast = self.serial(args[0]), self.serial(out)
            if source is not None and cast is not None:
                self.cast_from[cast] = source  # a parameter's autocast copy, once the tags say so
        return out

    def _record_outputs(self, out: Any) -> None:
        node = torch._C._current_autograd_node()
        if node is not None and node.name().endswith("AccumulateGrad"):
            self.tag(out, "gradients")  # autograd accumulating a parameter's gradient
        if isinstance(out, torch.Tensor):  # most ops: one tensor, no pytree walk
            leaves: Any = (out,)
        elif isinstance(out, tuple | list) and all(isinstance(t, torch.Tensor | None) for t in out):
            leaves = out
        else:
            leaves = tree_leaves(out)
        for t in leaves:
            if isinstance(t, torch.Tensor) and t.device.type == self.device_type:
                try:
                    storage = t.untyped_storage()
                except (RuntimeError, NotImplementedError):
                    continue
                self._track(storage)

    def _collective(self, func: Any, args: Any, kwargs: Any) -> Any:
        name = func._opname
        if name == "wait_tensor":
            if self._fake_mode is None:  # a real run observed: the wait releases the collective's work
                func(*args, **kwargs)
            return args[0]  # eager returns its input; the fake kernel would count a new tensor
        out = func(*args, **kwargs)
        if self._fake_mode is not None:  # a real backend's Work completes by itself
            out = _completed(out)
        self._record_outputs(out)
        kind = _KINDS.get(name)  # None: not a collective (a wait, autograd wrapping)
        if kind is not None:
            nbytes = _message_bytes(name, args)
            self.collectives.append(CollectiveCall(self.step, self._group_of(args, kwargs), kind, nbytes))
            if self.backend == "gloo" and name in _GLOO_STAGED:
                self._transient(nbytes)
            in_backward = torch._C._current_autograd_node() is not None
            for t in tree_leaves((args, kwargs)):  # buffers that only exist for the collective
                if isinstance(t, torch.Tensor) and not (in_backward and self._saved_in_forward(t)):
                    self.tag(t, "communication_buffers")
        return out

    def _saved_in_forward(self, t: torch.Tensor) -> bool:
        """Whether t's storage was made in a forward and is still alive: an activation kept for
        backward (a distributed checkpoint input, a saved 1/t slice) that a backward gathers."""
        try:
            serial = self._serial_of.get(id(t.untyped_storage()))
        except (RuntimeError, NotImplementedError):
            return False
        block = None if serial is None else self._open.get(serial)
        return (
            block is not None
            and not block.backward
            and block.phase in ("forward-compute", "forward-backward")
        )

    def _group_of(self, args: Any, kwargs: Any) -> str:
        """The label of the process group a collective runs on: c10d ops take the group as a boxed
        ScriptObject, functional ones by name (a string argument)."""

        values = (*args, *kwargs.values())
        for a in values:
            if isinstance(a, torch.ScriptObject) and "ProcessGroup" in a._type().qualified_name():
                name = dist.ProcessGroup.unbox(a).group_name
                return self.group_names.get(name, name)
        for a in values:
            if isinstance(a, str) and a in self.group_names:
                return self.group_names[a]
        return "?"

    def _data_dependent(self, func: Any, args: Any, kwargs: Any) -> Any:
        """An op whose output shape depends on tensor values (`x[bool_mask]`, `nonzero`,
        `masked_select`): on a GPU the host waits for the count, so it is a host read here too. The
        fake mode cannot know the count; every element is taken as selected (an upper bound on the
        output's bytes)."""
        self._host_read(None)
        self.op = str(func)
        # the fake mode is not active inside this handler: the index tensors made here must be fake
        with self._fake_mode:
            out = self._select_all(func, args, kwargs)
        self._record_outputs(out)
        return out

    def _select_all(self, func: Any, args: Any, kwargs: Any) -> Any:
        if func is _aten.index.Tensor:
            source, indices = args[0], list(args[1])
            expanded: list[Any] = []
            for index in indices:
                if index is not None and index.dtype == torch.bool:
                    every = torch.arange(index.numel(), device=index.device)
                    expanded.extend(_unravel(every, index.shape))
                else:
                    expanded.append(index)
            out = func(source, expanded, **kwargs)
        elif func is _aten.masked_select.default:
            source, _ = torch.broadcast_tensors(*args[:2])
            out = source.reshape(-1).clone()
        else:  # nonzero
            source = args[0]
            every = torch.arange(source.numel(), device=source.device)
            out = torch.stack(_unravel(every, source.shape), dim=1)
        return out

    def _host_read(self, tensor: torch.Tensor | None) -> Any:
        where = _caller()
        key = (where, self.step, self.seq)
        if key != self._last_read_key:  # one .tolist() reads every element: one synchronization
            self.host_reads.append(HostRead(where, self.step))
        self._last_read_key = key
        if tensor is None:
            return None
        if self.read_value is not None:
            return self.read_value
        return _neutral(tensor)

    # ------------------------------------------------------------ results

    def live_at(self, seq: int) -> list[Block]:
        return [b for b in self.blocks if b.born <= seq and (b.died is None or b.died > seq)]

    def breakdown_at_peak(self) -> dict[str, int]:
        """Bytes by category of the blocks alive at the peak (CATEGORIES)."""
        out = dict.fromkeys(CATEGORIES, 0)
        for block in self.live_at(self.peak.seq):
            out[self.category(block)] += block.bytes
        return {k: v for k, v in out.items() if v}

    def saved_for_backward(self) -> int:
        """Bytes made in a forward and alive when autograd first allocates in a backward: what the
        first micro-batch keeps for its backward (its outputs, logits and loss, included)."""
        first = next((b.born for b in self.blocks if b.backward), None)
        if first is None:
            return 0
        return sum(b.bytes for b in self.live_at(first) if self.category(b) == "activations")

    def category(self, block: Block) -> str:
        tag = self.tags.get(block.serial)
        if tag is not None:
            return tag
        if self.tags.get(self.cast_from.get(block.serial, -1)) == "parameters":
            return "compute_dtype_weights"  # autocast's cached low-precision copy of a weight
        if block.phase == "batch-generator":
            return "batch"
        if not block.backward and block.phase in ("forward-compute", "forward-backward"):
            return "activations"  # made in a forward and still alive at the peak: saved for backward
        return "other_temporaries"


def _completed(out: Any) -> Any:
    """A c10d op's (outputs, Work) with the fake backend's Work replaced by a completed one whose
    future holds the outputs, as a real backend's does when it finishes: DDP's comm hooks chain on
    `future.value()`, which the fake Work leaves empty."""
    if not (isinstance(out, tuple) and out and isinstance(out[-1], torch.ScriptObject)):
        return out

    result = out[0] if isinstance(out[0], list) else [out[0]]
    future: torch.futures.Future = torch.futures.Future()
    future.set_result(result)
    return (*out[:-1], _create_work_from_future(future).boxed())


def _unravel(flat: torch.Tensor, shape: Any) -> list[torch.Tensor]:
    """torch.unravel_index without its host tensor of the shape (which a fake CUDA mode cannot make)."""
    coords = []
    rest = flat
    for size in reversed(list(shape)):
        coords.append(rest % size)
        rest = rest // size
    return coords[::-1]


def _device_to_host(func: Any, args: Any, kwargs: dict[str, Any]) -> bool:
    """A blocking copy of a device tensor into host memory (`.cpu()`, `.to("cpu")`, `cpu_t.copy_(t)`)."""
    if func is _aten._to_copy.default:
        src, target = args[0], kwargs.get("device")
        blocking = not kwargs.get("non_blocking", False)
        return blocking and target is not None and target.type == "cpu" and src.device.type != "cpu"
    if func is _aten.copy_.default:
        dst, src = args[0], args[1]
        blocking = not (args[2] if len(args) > 2 else kwargs.get("non_blocking", False))
        return (
            blocking
            and dst.device.type == "cpu"
            and isinstance(src, torch.Tensor)
            and src.device.type != "cpu"
        )
    return False


def _neutral(tensor: torch.Tensor) -> Any:
    """The answer to a host read of a fake value: zero (no overflow found, so the fp16 step is taken
    as in a healthy run, and nothing divides by it)."""
    if tensor.dtype == torch.bool:
        return False
    return 0.0 if tensor.is_floating_point() else 0


def _only_real_tensors(tree: Any) -> bool:
    """Tensor arguments, none of them fake (nor a subclass holding fakes, such as a DTensor), and no
    device argument other than the host. Called for every op: flat loops, no pytree."""

    args, kwargs = tree
    seen = False
    for value in (*args, *kwargs.values()):
        items = value if isinstance(value, list | tuple) else (value,)
        for a in items:
            if isinstance(a, torch.Tensor):
                if type(a) is not torch.Tensor or isinstance(a, FakeTensor):
                    return False
                seen = True
            elif isinstance(a, torch.device) and a.type != "cpu":
                return False  # a host tensor going to the device: the copy is device memory, fake it
    return seen


def _data_dependent(func: Any, args: Any) -> bool:
    """An op whose output shape depends on tensor values: nonzero, masked_select, x[bool_mask]."""
    if func in _DATA_DEPENDENT:
        return True
    return func is _aten.index.Tensor and any(
        isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in args[1]
    )


def _message_bytes(name: str, args: Any) -> int:
    """Bytes of the collective's whole buffer: the largest tensor argument (all-gather: the output;
    reduce-scatter: the input; all-reduce, broadcast, send/recv: the tensor), summed over a list of
    tensors where the op takes several (coalesced ops, DDP's bucket list)."""
    tensors = [t for t in tree_leaves(args) if isinstance(t, torch.Tensor)]
    if not tensors:
        return 0
    sizes = [t.numel() * t.element_size() for t in tensors]
    if name in ("allreduce_", "all_reduce_coalesced", "allreduce_coalesced_", "broadcast_"):
        return sum(sizes)
    if name in ("all_gather_into_tensor", "all_gather_into_tensor_coalesced"):
        group_size = next((a for a in args if isinstance(a, int) and not isinstance(a, bool)), 1)
        return sum(sizes) * group_size
    return max(sizes)


def _caller() -> str:
    """path:line of the innermost frame in this package (not this module), else outside torch."""
    frames = traceback.extract_stack()[:-3]
    for frame in reversed(frames):
        if frame.filename.startswith(_PACKAGE) and not frame.filename.startswith(_DRYRUN):
            return f"{Path(frame.filename).relative_to(Path(_PACKAGE).parent)}:{frame.lineno}"
    for frame in reversed(frames):
        if not frame.filename.startswith((_TORCH, _DRYRUN)):
            return f"{frame.filename}:{frame.lineno}"
    return "?"
