"""`stx launch --hostfile hosts`: one `stx launch` per host, started over ssh, in one job.

The hostfile is DeepSpeed's: one `HOST slots=N` line per host (N processes there; `#` comments).
`--include` / `--exclude` take DeepSpeed's syntax too: `host1@host2:0,2` (whole hosts, or some
slots of a host; chosen slots become CUDA_VISIBLE_DEVICES there). Host i of what remains runs
`stx launch --nnodes K --node-rank i --master-addr HOST0 ...`, so the master address is the
hostfile's first host, as written, never guessed from `hostname -I` (DeepSpeed #5136).

Every host gets this process's working directory, the variables listed by `--export`, those
whose names start with one of EXPORT_PREFIXES (NCCL_*, PYTHON*, ...), and the `--env-file` lines.

Failure: the first host whose `stx launch` exits non-zero is named with its exit code (its output,
prefixed with the host, already says which rank failed and why); the other hosts' ssh sessions
are closed, and `ssh_node` on each of them stops its ranks when its stdin closes, so nothing is
left running. Output of every host is shown line by line, prefixed `HOST:`.

Weighed: pdsh starts one command on many hosts, but the same command on each (no per-host node
rank, unless a dynamic rendezvous assigns them) and it returns only when every host has returned,
so a failed host would leave the others waiting in a collective until its timeout; DeepSpeed's
runner has the pdsh path with these problems (#1603, #5136). So: one ssh per host, by hand.
"""

from __future__ import annotations

import dataclasses
import os
import re
import shlex
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Sequence
from pathlib import Path
from typing import IO

from ..errors import LaunchError

EXPORT_PREFIXES = ("NCCL_", "PYTHON", "STX_", "TORCH_", "OMP_", "UCX_", "FI_", "CUDA_", "HF_", "GLOO_")
DEFAULT_MASTER_PORT = 29500
# What a rank says when another rank (elsewhere) died under it: gloo / NCCL / the TCP store.
PEER_LOSS = ("Connection reset by peer", "Connection closed by peer", "Broken pipe", "Socket Timeout")
GRACE_SECONDS = 3.0  # after a first failure: how long to wait for the others' before naming one
TAIL_LINES = 400  # per host, for root_cause


@dataclasses.dataclass(frozen=True)
class Host:
    name: str
    slots: tuple[int, ...]  # slot (GPU) indices used on this host


def parse_hostfile(path: str | Path) -> dict[str, int]:
    """host -> slots, in file order. LaunchError naming the file and line on a bad line."""
    path = Path(path)
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError as e:
        raise LaunchError(f"--hostfile {path}: cannot read it ({e.strerror})") from None
    hosts: dict[str, int] = {}
    for number, raw in enumerate(lines, 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        m = re.fullmatch(r"(\S+)\s+slots\s*=\s*(\d+)", line)
        if not m or int(m.group(2)) < 1:
            raise LaunchError(
                f"{path}:{number}: {raw.strip()!r}: expected 'HOST slots=N' with N >= 1 (DeepSpeed's format)"
            )
        if m.group(1) in hosts:
            raise LaunchError(f"{path}:{number}: host {m.group(1)} is listed twice")
        hosts[m.group(1)] = int(m.group(2))
    if not hosts:
        raise LaunchError(f"{path}: names no host; write one 'HOST slots=N' line per host")
    return hosts


def _parse_selection(text: str, hosts: dict[str, int], option: str) -> dict[str, set[int]]:
    """DeepSpeed's 'host1@host2:0,2' -> {host1: all slots, host2: {0, 2}}."""
    chosen: dict[str, set[int]] = {}
    for part in text.split("@"):
        name, _, slots = part.partition(":")
        if name not in hosts:
            raise LaunchError(f"{option} {text!r}: host {name!r} is not in the hostfile ({', '.join(hosts)})")
        if not slots:
            chosen[name] = set(range(hosts[name]))
            continue
        try:
            wanted = {int(s) for s in slots.split(",")}
        except ValueError:
            raise LaunchError(f"{option} {text!r}: slots are integers, e.g. {name}:0,1") from None
        bad = sorted(s for s in wanted if not 0 <= s < hosts[name])
        if bad:
            raise LaunchError(f"{option} {text!r}: {name} has slots 0..{hosts[name] - 1}, not {bad}")
        chosen[name] = wanted
    return chosen


def select_hosts(hosts: dict[str, int], include: str | None = None, exclude: str | None = None) -> list[Host]:
    """The hosts (and slots) a job runs on, in hostfile order, after --include / --exclude."""
    if include and exclude:
        raise LaunchError("--include and --exclude cannot be used together")
    if include:
        inc = _parse_selection(include, hosts, "--include")
        picked = [Host(h, tuple(sorted(inc[h]))) for h in hosts if h in inc]
    else:
        exc = _parse_selection(exclude, hosts, "--exclude") if exclude else {}
        picked = []
        for h, n in hosts.items():
            slots = tuple(s for s in range(n) if s not in exc.get(h, set()))
            if slots:
                picked.append(Host(h, slots))
    if not picked:
        raise LaunchError("--include/--exclude left no host to run on")
    counts = {len(h.slots) for h in picked}
    if len(counts) > 1:
        raise LaunchError(
            "every host must run the same number of processes (torchrun's static rendezvous); got "
            + ", ".join(f"{h.name}:{len(h.slots)}" for h in picked)
        )
    return picked


def exported_environment(names: Sequence[str], env_file: str | None) -> list[tuple[str, str]]:
    """(name, value) pairs every host gets: the prefixed variables, --export NAMEs, the env file."""
    pairs = [(k, v) for k, v in sorted(os.environ.items()) if k.startswith(EXPORT_PREFIXES)]
    for name in names:
        if name not in os.environ:
            raise LaunchError(f"--export {name}: not set in this shell")
        pairs.append((name, os.environ[name]))
    if env_file:
        try:
            lines = Path(env_file).read_text(encoding="utf-8").splitlines()
        except OSError as e:
            raise LaunchError(f"--env-file {env_file}: cannot read it ({e.strerror})") from None
        for number, raw in enumerate(lines, 1):
            line = raw.strip()
            if not line or line.startswith("#"):
                continue
            key, sep, value = line.removeprefix("export ").partition("=")
            if not sep or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", key.strip()):
                raise LaunchError(f"{env_file}:{number}: {raw!r}: expected NAME=value")
            pairs.append((key.strip(), value.strip().strip("'\"")))
    return pairs


def node_command(
    host: Host,
    node_rank: int,
    nnodes: int,
    master_addr: str,
    master_port: int,
    env: Sequence[tuple[str, str]],
    launch_args: Sequence[str],
    command: Sequence[str],
) -> str:
    """The shell command ssh runs on one host: cd, environment, `ssh_node` around `stx launch`."""
    env = [*env]
    if len(host.slots) and host.slots != tuple(range(len(host.slots))):
        env.append(("CUDA_VISIBLE_DEVICES", ",".join(map(str, host.slots))))
    argv = [
        sys.executable,
        "-m",
        "scalable_transformer.launch.ssh_node",
        sys.executable,
        "-m",
        "scalable_transformer.cli",
        "launch",
        "-n",
        str(len(host.slots)),
        "--nnodes",
        str(nnodes),
        "--node-rank",
        str(node_rank),
        "--master-addr",
        master_addr,
        "--master-port",
        str(master_port),
        *launch_args,
        *command,
    ]
    exports = " ".join(f"{k}={shlex.quote(v)}" for k, v in env)
    return f"cd {shlex.quote(os.getcwd())} && exec env {exports} {shlex.join(argv)}"


def ssh_command(host: str, remote: str, ssh_config: str | None) -> list[str]:
    # -T: no terminal (output stays line-buffered text); stdin stays open: ssh_node watches it.
    return ["ssh", *(["-F", ssh_config] if ssh_config else []), "-T", host, remote]


def _pump(stream: IO[str], prefix: str, out: IO[str], lock: threading.Lock, tail: deque[str]) -> None:
    for line in stream:
        tail.append(line)
        with lock:
            out.write(f"{prefix}: {line}")
            out.flush()


def root_cause(failed: dict[int, int], tails: Sequence[Sequence[str]]) -> int:
    """The host that failed on its own: one whose ranks did not just lose a peer (when a rank dies,
    the ranks on the other hosts fail too, in a collective, often as fast); else the first seen."""
    order = list(failed)  # in the order the failures were seen
    for index in order:
        if not any(phrase in line for line in tails[index] for phrase in PEER_LOSS):
            return index
    return order[0]


def launch_hosts(
    hosts: Sequence[Host],
    command: Sequence[str],
    *,
    master_port: int | None = None,
    env: Sequence[tuple[str, str]] = (),
    launch_args: Sequence[str] = (),
    ssh_config: str | None = None,
    poll_seconds: float = 0.2,
) -> int:
    """Run `stx launch ... command` on every host; 0 when all succeed, else the first failure's
    exit code (1 when it was killed by a signal). Prints which host failed first."""
    master_addr = hosts[0].name
    port = master_port or DEFAULT_MASTER_PORT
    print(
        f"stx launch: {len(hosts)} hosts x {len(hosts[0].slots)} processes over ssh "
        f"(rank 0 at {master_addr}:{port}): {', '.join(h.name for h in hosts)}",
        file=sys.stderr,
        flush=True,
    )
    lock = threading.Lock()
    procs: list[subprocess.Popen] = []
    pumps: list[threading.Thread] = []
    tails: list[deque[str]] = [deque(maxlen=TAIL_LINES) for _ in hosts]
    try:
        for rank, host in enumerate(hosts):
            remote = node_command(host, rank, len(hosts), master_addr, port, env, launch_args, command)
            proc = subprocess.Popen(
                ssh_command(host.name, remote, ssh_config),
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                bufsize=1,
            )
            procs.append(proc)
            for stream, out in ((proc.stdout, sys.stdout), (proc.stderr, sys.stderr)):
                t = threading.Thread(
                    target=_pump, args=(stream, host.name, out, lock, tails[rank]), daemon=True
                )
                t.start()
                pumps.append(t)
        failed: dict[int, int] = {}  # host index -> exit status, in the order seen
        first_seen: float | None = None
        while any(p.poll() is None for p in procs):
            for i, p in enumerate(procs):
                if p.poll() is not None and p.returncode != 0 and i not in failed:
                    failed[i] = p.returncode
            if failed and first_seen is None:
                first_seen = time.monotonic()
            if first_seen is not None and time.monotonic() - first_seen > GRACE_SECONDS:
                break
            time.sleep(poll_seconds)
        for i, p in enumerate(procs):
            if p.poll() is not None and p.returncode != 0 and i not in failed:
                failed[i] = p.returncode
    finally:
        _close_all(procs)
        for t in pumps:
            t.join(timeout=5)
    if not failed:
        return 0
    index = root_cause(failed, tails)
    code = failed[index]
    how = f"exit code {code}" if code > 0 else f"signal {-code}"
    others = [hosts[i].name for i in failed if i != index]
    print(
        f"stx launch: host {hosts[index].name} (node {index}) failed first ({how}; its report above "
        "names the rank); the other hosts were stopped"
        + (f" (failed after it: {', '.join(others)})" if others else ""),
        file=sys.stderr,
        flush=True,
    )
    return code if code > 0 else 1


def _close_all(procs: Sequence[subprocess.Popen]) -> None:
    """Close every ssh session still open: ssh_node on the host sees its stdin close and stops its
    ranks; the local ssh gets SIGTERM, then SIGKILL 10 s later."""
    for p in procs:
        if p.poll() is None and p.stdin:
            p.stdin.close()
    deadline = time.monotonic() + 10
    for p in procs:
        if p.poll() is None:
            p.terminate()
    for p in procs:
        try:
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
