"""Fake CUDA for dry runs of GPU layouts on a CPU-only torch build (`stx plan --dry-run` with a GPU
device): the engine runs on `device="cuda"` fake tensors, so the CUDA code paths of FSDP2, DDP,
DTensor, pipelining and autocast are the ones exercised. Used only inside a dry run's worker process
(dryrun/dry_run.py), and undone on exit.

Every stub answers "which device / stream am I on" or turns stream and event synchronization into a
no-op; none allocates, resizes or changes the dtype or shape of a device tensor. Measured on torch
2.13.0+cpu (docs/PLANNER.md#dry-runs lists what this exercises and what it cannot):

native      (ctypes into libc10 / libtorch_cpu; without them the first backward through a CUDA
            tensor ends the process in C++)
            1. c10's CUDA device guard: FakeTensorMode.__enter__ calls _ensureCUDADeviceGuardSet()
               to install torch's own FakeGuardImpl<CUDA>, but on a CPU-only build it returns early
               because the slot is empty; a placeholder in the slot lets it install the fake guard.
            2. CUDAHooks.isBuilt() -> True: autograd's InputBuffer::add asks the accelerator for the
               current stream, which raises when no accelerator is built.
            3. CUDAHooks.hasPrimaryContext() -> False: the autograd engine's stash_current_streams.
torch.cuda  current_device (FSDP2's device from the mesh), Stream / Event / current_stream (FSDP2's
            all-gather, reduce-scatter and copy streams: no-ops), get_rng_state (pipelining's
            fork_rng: a host tensor of CUDA's state size), is_bf16_supported (autocast), and
            amp.common.amp_definitely_not_available -> False: without it autocast and GradScaler
            silently disable themselves on "cuda" and activations would be fp32.
memory      the allocator's statistics (the trainer's logging reads them): 0; the dry run's trace
            counts live tensor bytes itself.
rms norm    on CUDA `rms_norm` runs the fused kernel (`_fused_rms_norm`), which keeps only its input
            and the per-row rstd for backward; a CPU build has no CUDA kernel for it, so it would
            take the composite path and keep a second fp32 copy of every norm's output. Routed to
            an autograd function that keeps what the fused kernel keeps.
attention   SDPA's kernel choice has no CUDA entry in a CPU build, so it would take the math path
            (an s x s fp32 score matrix per head). `scaled_dot_product_attention` is routed to the
            fused kernel a GPU picks: flash attention for fp16/bf16 without a mask, memory-efficient
            attention otherwise; both save only O(s) statistics, as on the GPU.
"""

from __future__ import annotations

import contextlib
import ctypes
import itertools
from collections.abc import Iterator
from typing import Any

import torch
from torch.nn.attention.bias import CausalBias

from .engine_stubs import patched
from .torch_internals import torch_library

_CUDA = 1  # c10::DeviceType::CUDA
_state: dict[str, Any] = {"device": 0, "on_sync": None}


class _NativeShim:
    _SLOT_ISBUILT, _SLOT_HASPRIMARYCTX = 2, 4

    def __init__(self):
        self.c10 = torch_library("libc10.so")
        self.tc = torch_library("libtorch_cpu.so")
        self._keep = []

    def install(self):
        self.restore_ops = []
        # (N1) device guard
        reg = (ctypes.c_void_p * (_CUDA + 1)).in_dll(self.c10, "_ZN3c104impl26device_guard_impl_registryE")
        if not reg[_CUDA]:
            ret0 = ctypes.CFUNCTYPE(ctypes.c_int8)(lambda: 0)
            vt = (ctypes.c_void_p * 64)(*([ctypes.cast(ret0, ctypes.c_void_p).value] * 64))
            dummy = (ctypes.c_void_p * 4)(ctypes.addressof(vt))
            self._keep += [ret0, vt, dummy]
            reg[_CUDA] = ctypes.addressof(dummy)
            torch._C._ensureCUDADeviceGuardSet()  # swaps in c10::impl::FakeGuardImpl<CUDA>
            if reg[_CUDA] == ctypes.addressof(dummy):
                reg[_CUDA] = None
                raise RuntimeError("ensureCUDADeviceGuardSet did not install FakeGuardImpl<CUDA>")

            def _undo_guard(reg=reg):
                reg[_CUDA] = None

            self.restore_ops.append(_undo_guard)
        # (N2) CUDA hooks
        get = self.tc._ZN2at6detail12getCUDAHooksEv
        get.restype = ctypes.c_void_p
        hooks = get()
        vptr = ctypes.c_void_p.from_address(hooks)
        base_vt = ctypes.addressof(ctypes.c_void_p.in_dll(self.tc, "_ZTVN2at18CUDAHooksInterfaceE")) + 16
        if vptr.value != base_vt:
            raise RuntimeError("CUDA hooks are not the default CUDAHooksInterface (a CUDA build?)")
        BOOL = ctypes.CFUNCTYPE(ctypes.c_bool, ctypes.c_void_p)
        if BOOL(ctypes.c_void_p.from_address(base_vt + 8 * self._SLOT_ISBUILT).value)(hooks):
            raise RuntimeError("unexpected vtable layout: slot 2 (isBuilt) returned True")
        n = 128
        new_vt = (ctypes.c_void_p * n)(*(ctypes.c_void_p * n).from_address(base_vt))

        def is_built(_self):
            return True

        def has_primary_context(_self, idx):
            return False

        cb1 = BOOL(is_built)
        cb2 = ctypes.CFUNCTYPE(ctypes.c_bool, ctypes.c_void_p, ctypes.c_int8)(has_primary_context)
        new_vt[self._SLOT_ISBUILT] = ctypes.cast(cb1, ctypes.c_void_p).value
        new_vt[self._SLOT_HASPRIMARYCTX] = ctypes.cast(cb2, ctypes.c_void_p).value
        self._keep += [new_vt, cb1, cb2]
        vptr.value = ctypes.addressof(new_vt)

        def _undo_hooks(vptr=vptr, base_vt=base_vt):
            vptr.value = base_vt

        self.restore_ops.append(_undo_hooks)

    def uninstall(self):
        for op in reversed(self.restore_ops):
            op()
        self.restore_ops = []
        # self._keep is deliberately NOT cleared: a C++ thread that read the old vptr could still
        # be about to call a callback; keeping them alive for the process lifetime is harmless.


_stream_ids = itertools.count(1)


class FakeCudaStream(torch.Stream):
    """Subclass of torch.Stream (so Tensor.record_stream / isinstance(torch.Stream) accept it),
    built from (stream_id, device_index, device_type) which needs no backend.  All
    synchronisation methods are no-ops: there is no concurrency to model."""

    def __new__(cls, device=None, priority=0, **kwargs):
        if device is None:
            idx = _state["device"]
        elif isinstance(device, int):
            idx = device
        else:
            idx = torch.device(device).index or 0
        sid = kwargs.get("stream_id", next(_stream_ids))
        return super().__new__(cls, stream_id=sid, device_index=idx, device_type=_CUDA)

    def wait_event(self, event):
        pass  # no concurrency to model

    def wait_stream(self, stream):
        pass  # no concurrency to model

    def record_event(self, event=None):
        event = FakeCudaEvent() if event is None else event
        event.record(self)
        return event

    def query(self):
        return True

    def synchronize(self):
        _synchronize()  # the host waits for the stream: reported as a host synchronization

    def __eq__(self, o):
        same = (o.stream_id, o.device_index) == (self.stream_id, self.device_index)
        return isinstance(o, torch.Stream) and same

    def __hash__(self):
        return hash((self.stream_id, self.device_index))

    def __repr__(self):
        return f"<FakeCudaStream id={self.stream_id} cuda:{self.device_index}>"


class FakeCudaEvent:
    def __init__(self, enable_timing=False, blocking=False, interprocess=False, external=False):
        pass  # no concurrency to model

    def record(self, stream=None):
        pass  # no concurrency to model

    def wait(self, stream=None):
        pass  # no concurrency to model

    def query(self):
        return True

    def synchronize(self):
        _synchronize()  # the host waits for the event: reported as a host synchronization

    def elapsed_time(self, end_event):
        return 0.0


_default_streams: dict[int, FakeCudaStream] = {}


def _current_stream(device=None):
    idx = _state["device"]
    if idx not in _default_streams:
        _default_streams[idx] = FakeCudaStream(device=idx, stream_id=0)
    return _default_streams[idx]


def _current_device():
    return _state["device"]


def _amp_definitely_not_available():
    return False


def _is_bf16_supported(including_emulation=True):
    return True


def _get_rng_state(device="cuda"):
    # Same size/dtype as CUDA's Philox state (seed + offset, 16 bytes) -- a host tensor.
    return torch.zeros(16, dtype=torch.uint8)


def _sdpa(original: Any) -> Any:
    def scaled_dot_product_attention(
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attn_mask: torch.Tensor | None = None,
        dropout_p: float = 0.0,
        is_causal: bool = False,
        scale: float | None = None,
        enable_gqa: bool = False,
    ) -> torch.Tensor:
        if query.device.type != "cuda":
            return original(
                query, key, value, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa
            )
        if isinstance(attn_mask, CausalBias):
            # context parallelism's causal blocks (models/layers.py, `causal_lower_right`): a tensor
            # subclass with no data, which a GPU runs as the causal flash or memory-efficient kernel
            # aligned to the lower right (torch's CausalBias._dispatch), with no mask in memory
            attn_mask, is_causal = None, True
        aten = torch.ops.aten
        if attn_mask is None and query.dtype in (torch.float16, torch.bfloat16):
            # CUDA's flash kernel reads grouped-query keys and values as they are: no expanded copies
            return aten._scaled_dot_product_flash_attention(
                query, key, value, dropout_p, is_causal, False, scale=scale
            )[0]
        if enable_gqa and key.shape[-3] != query.shape[-3]:
            # grouped-query attention: the memory-efficient kernel takes as many k/v heads as q heads
            repeats = query.shape[-3] // key.shape[-3]
            key, value = key.repeat_interleave(repeats, -3), value.repeat_interleave(repeats, -3)
        bias = attn_mask
        if bias is not None and bias.dtype == torch.bool:  # True = attend, as SDPA takes it
            bias = torch.zeros_like(bias, dtype=query.dtype).masked_fill(~bias, float("-inf"))
        return aten._scaled_dot_product_efficient_attention(
            query, key, value, bias, True, dropout_p, is_causal, scale=scale
        )[0]

    return scaled_dot_product_attention


class _FusedRmsNorm(torch.autograd.Function):
    """CUDA's fused RMSNorm as autograd sees it: forward `_fused_rms_norm`, backward
    `_fused_rms_norm_backward`, saving (input, rstd, weight) and nothing else."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, x: torch.Tensor, shape: list[int], weight: torch.Tensor | None, eps: float | None
    ) -> torch.Tensor:
        with torch.no_grad():  # the composite's temporaries die here, as inside the CUDA kernel
            y, rstd = torch.ops.aten._fused_rms_norm(x, shape, weight, eps)
        ctx.shape = shape
        ctx.save_for_backward(x, rstd, weight)
        return y

    @staticmethod
    def backward(ctx: Any, grad_y: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        x, rstd, weight = ctx.saved_tensors
        mask = [ctx.needs_input_grad[0], weight is not None and ctx.needs_input_grad[2]]
        grad_x, grad_w = torch.ops.aten._fused_rms_norm_backward(grad_y, x, ctx.shape, rstd, weight, mask)
        return grad_x, None, grad_w, None


def _rms_norm(original: Any) -> Any:
    def rms_norm(
        input: torch.Tensor,
        normalized_shape: list[int],
        weight: torch.Tensor | None = None,
        eps: float | None = None,
    ) -> torch.Tensor:
        if input.device.type != "cuda":
            return original(input, normalized_shape, weight, eps)
        if torch.is_autocast_enabled("cuda"):  # CUDA autocast runs rms_norm in fp32
            input = input.float()
            weight = None if weight is None else weight.float()
        if weight is not None and weight.dtype != input.dtype:  # CUDA falls back to the composite too
            return original(input, normalized_shape, weight, eps)
        return _FusedRmsNorm.apply(input, list(normalized_shape), weight, eps)

    return rms_norm


def _python_stubs() -> list[tuple[Any, str, Any]]:
    c = torch.cuda
    F = torch.nn.functional
    return [
        (c, "current_device", _current_device),
        (c, "Stream", FakeCudaStream),
        (c, "Event", FakeCudaEvent),
        (c, "current_stream", _current_stream),
        (c.amp.common, "amp_definitely_not_available", _amp_definitely_not_available),
        (c, "is_bf16_supported", _is_bf16_supported),
        (c, "get_rng_state", _get_rng_state),
        (c, "synchronize", _synchronize),
        # distributed_c10d.broadcast asks the compute capability of a CUDA tensor's device (ZeRO-1's
        # parameter broadcast after each step): an A100's, 8.0 (the answer selects no allocation)
        (c, "get_device_capability", lambda device=None: (8, 0)),
        # the trainer's MemoryTracker (metrics/peak_memory.py): the dry run measures memory itself
        (c, "reset_peak_memory_stats", lambda device=None: None),
        (c, "max_memory_allocated", lambda device=None: 0),
        (c, "max_memory_reserved", lambda device=None: 0),
        (c, "memory_allocated", lambda device=None: 0),
        (c, "memory_reserved", lambda device=None: 0),
        (F, "scaled_dot_product_attention", _sdpa(F.scaled_dot_product_attention)),
        (F, "rms_norm", _rms_norm(F.rms_norm)),
    ]


def _synchronize(device: Any = None) -> None:
    """A device synchronization: the host waits for the GPU. Recorded as a host synchronization."""
    if _state.get("on_sync") is not None:
        _state["on_sync"]()


_native: _NativeShim | None = None


@contextlib.contextmanager
def fake_cuda(device_index: int = 0, on_sync: Any = None) -> Iterator[None]:
    """CUDA device type on this CPU-only build for fake tensors (see the module docstring);
    `on_sync` is called at every torch.cuda.synchronize()."""
    global _native
    if torch.cuda.is_available():  # pragma: no cover - a CUDA build needs none of this
        yield
        return

    _native = _native or _NativeShim()
    _native.install()
    try:
        with patched(_python_stubs()):
            _state["device"], _state["on_sync"] = device_index, on_sync
            yield
    finally:
        _default_streams.clear()
        _state["on_sync"] = None
        _native.uninstall()
