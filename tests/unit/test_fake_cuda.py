"""dryrun/fake_cuda.py: the CUDA device type for fake tensors on this CPU-only build, undone on exit.
Each case runs in a child process: fake CUDA patches libtorch (ctypes) and torch.cuda."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA build needs no fake CUDA")

CHILD = textwrap.dedent(
    """
    import ctypes
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode
    from scalable_transformer.dryrun import fake_cuda as fc

    names = ["current_device", "Stream", "Event", "current_stream", "synchronize", "get_rng_state"]
    before = {n: getattr(torch.cuda, n) for n in names}
    sdpa = torch.nn.functional.scaled_dot_product_attention
    syncs = []
    with fc.fake_cuda(3, on_sync=lambda: syncs.append(1)):
        assert torch.cuda.current_device() == 3
        with FakeTensorMode(allow_non_fake_inputs=True):
            w = torch.nn.Parameter(torch.empty(8, 8, device="cuda"))
            x = torch.empty(4, 2, 16, 4, device="cuda", dtype=torch.bfloat16)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                z = torch.empty(2, 8, device="cuda") @ w
                y = z.float().sum()
                out = torch.nn.functional.scaled_dot_product_attention(x, x, x, is_causal=True)
            y.backward()  # without the native stubs this ends the process in C++
            assert w.grad.device.type == "cuda" and w.grad.shape == (8, 8)
            assert z.dtype == torch.bfloat16  # autocast was not silently turned off
            assert out.shape == x.shape and out.device.type == "cuda"
        torch.cuda.synchronize()
    assert syncs == [1]
    assert all(getattr(torch.cuda, n) is before[n] for n in names)
    assert torch.nn.functional.scaled_dot_product_attention is sdpa
    registry = (ctypes.c_void_p * 2).in_dll(fc._native.c10, "_ZN3c104impl26device_guard_impl_registryE")
    assert registry[1] is None  # the CUDA guard slot is empty again
    try:
        torch.cuda.current_device()
    except (AssertionError, RuntimeError):
        print("restored", flush=True)
    # Every check above has passed. Skip the interpreter's teardown: the autograd engine's thread for
    # the (fake) CUDA device outlives the restored guard registry, and destroying it at exit aborts in
    # C++ ("terminate called without an active exception") on some runs, under load most often.
    import os
    os._exit(0)
    """
)


def test_fake_cuda_runs_a_cuda_backward_and_restores_everything():
    proc = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().endswith("restored")


RMS_NORM_CHILD = textwrap.dedent(
    """
    import os
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode
    from scalable_transformer.dryrun import fake_cuda as fc

    saved = []
    def pack(t):
        saved.append((tuple(t.shape), t.dtype))
        return t
    with fc.fake_cuda(), FakeTensorMode():
        norm = torch.nn.RMSNorm(16, device="cuda")
        x = torch.empty(4, 16, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            with torch.autocast("cuda", dtype=torch.bfloat16):
                y = norm(x)
        y.sum().backward()
        assert y.dtype == torch.float32  # CUDA autocast runs rms_norm in fp32
        assert x.grad.shape == x.shape and x.grad.dtype == torch.bfloat16
        assert norm.weight.grad.shape == (16,)
    print(sorted(saved, key=str), flush=True)
    os._exit(0)
    """
)


def test_fake_cuda_rms_norm_keeps_what_the_fused_cuda_kernel_keeps():
    # CUDA's _fused_rms_norm saves its (autocast fp32) input, the per-row rstd and the weight; the
    # composite path a CPU build would take also keeps its fp32 normalised output (4 bytes/element more)
    proc = subprocess.run([sys.executable, "-c", RMS_NORM_CHILD], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    saved = proc.stdout.strip().splitlines()[-1]
    assert saved == str(
        sorted([((4, 16), torch.float32), ((4, 1), torch.float32), ((16,), torch.float32)], key=str)
    )
