"""The loss's forward + backward: models.spec.cross_entropy_sum against torch's F.cross_entropy.

Both compute the summed fp32 cross-entropy of [rows, vocab] logits and its gradient. torch's composite
saves the log-softmax, and its backward makes two more [rows, vocab] fp32 buffers (the NLL's
zero-filled gradient, then log-softmax's); ours writes the gradient into the saved log-softmax in
place. Each allocator setting runs in fresh one-thread processes, the two losses alternating inside
each, for `--repeats` processes per setting:

  heap   glibc's default dynamic mmap threshold (a ZeRO-0/1, tensor- or pipeline-parallel step on a
         CPU: parallel.init.step_allocation(fsdp=False) sets glibc's ceiling)
  fsdp   the 1 MiB threshold of an FSDP2 step (parallel.init.step_allocation(fsdp=True)): every
         buffer of the loss's size is a fresh mapping, zero-filled page by page

Reported: the median milliseconds per forward + backward of each, and ours / torch's (< 1: ours
faster), per setting. The default shape is tiny-gpt's in benchmarks/zero_vs_deepspeed.py (micro-batch
4 x seq 128 rows, 10,112-entry padded vocabulary).

    python benchmarks/cross_entropy.py
    python benchmarks/cross_entropy.py --rows 2048 --vocab 50304 --dtype bf16 --repeats 3
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import shlex
import statistics
import subprocess
import sys
import time

from scalable_transformer.metrics.device_table import cpu_model

SETTINGS = ("heap", "fsdp")
DTYPES = ("fp32", "bf16")


def worker(args: argparse.Namespace) -> None:
    """One process: both losses timed alternately under one allocator setting; prints JSON."""
    import torch
    import torch.nn.functional as F

    from scalable_transformer.models.spec import IGNORE_INDEX, cross_entropy_sum
    from scalable_transformer.parallel.init import step_allocation

    torch.set_num_threads(1)
    step_allocation(fsdp=args.worker == "fsdp")
    gen = torch.Generator().manual_seed(0)
    dtype = torch.float32 if args.dtype == "fp32" else torch.bfloat16
    logits = torch.randn(args.rows, args.vocab, generator=gen).to(dtype).requires_grad_()
    labels = torch.randint(0, args.vocab, (args.rows,), generator=gen)

    def ours() -> None:
        cross_entropy_sum(logits, labels, IGNORE_INDEX).backward()

    def torchs() -> None:
        F.cross_entropy(logits.float(), labels, reduction="sum").backward()

    times: dict[str, list[float]] = {"ours": [], "torch": []}
    for i in range(args.warmup + args.iters):
        for name, fn in (("ours", ours), ("torch", torchs)) if i % 2 else (("torch", torchs), ("ours", ours)):
            logits.grad = None
            start = time.perf_counter()
            fn()
            if i >= args.warmup:
                times[name].append(time.perf_counter() - start)
    print(json.dumps({k: statistics.median(v) for k, v in times.items()}))


def torch_version() -> str:
    return importlib.metadata.version("torch")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--rows", type=int, default=512)
    ap.add_argument("--vocab", type=int, default=10112)
    ap.add_argument("--dtype", choices=DTYPES, default="fp32")
    ap.add_argument("--repeats", type=int, default=3, help="fresh processes per allocator setting")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--worker", choices=SETTINGS, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args)
        return
    runs: dict[str, list[dict[str, float]]] = {s: [] for s in SETTINGS}
    for r in range(args.repeats):
        for setting in SETTINGS if r % 2 == 0 else SETTINGS[::-1]:
            cmd = [sys.executable, __file__, "--worker", setting, *sys.argv[1:]]
            out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
            runs[setting].append(json.loads(out.strip().splitlines()[-1]))
    shape = f"[{args.rows} x {args.vocab}] {args.dtype} logits"
    print(f"# cross_entropy: {shape}, forward + backward, 1 thread\n")
    print(f"Command: `{shlex.join(['python', 'benchmarks/cross_entropy.py', *sys.argv[1:]])}`\n")
    print(f"Processor: {cpu_model()}, torch {torch_version()}. Median over {args.repeats} process(es)")
    print(f"per setting of each process's median of {args.iters} calls.\n")
    print("| allocator | ours (ms) | torch F.cross_entropy (ms) | ours / torch |")
    print("|---|---:|---:|---:|")
    for setting in SETTINGS:
        ours = statistics.median(r["ours"] for r in runs[setting]) * 1e3
        torchs = statistics.median(r["torch"] for r in runs[setting]) * 1e3
        ratio = statistics.median(r["ours"] / r["torch"] for r in runs[setting])
        print(f"| {setting} | {ours:.2f} | {torchs:.2f} | {ratio:.3f} |")


if __name__ == "__main__":
    main()
