"""Rank, local rank, world size and master address/port of a process started by a scheduler or MPI.

`srun stx train CONFIG` and `mpiexec -n N stx train CONFIG` start every rank themselves, without
torchrun: the ranks learn who they are from the launcher's own variables. `discover` reads them,
`apply_cluster_env` exports the result as RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR / MASTER_PORT, which is
what `distributed.init_distributed` (torch's env:// rendezvous) reads. Sources, first found wins:

- RANK and WORLD_SIZE already set (torchrun, `stx launch`, the user): left alone.
- Open MPI (`mpirun`): OMPI_COMM_WORLD_RANK / _SIZE / _LOCAL_RANK.
- Cray PALS (`mpiexec` on PBS Pro systems such as Polaris): PALS_RANKID / PALS_LOCAL_RANKID, PMI_SIZE.
- MPICH / Intel MPI / hydra (PMI): PMI_RANK / PMI_SIZE, MPI_LOCALRANKID (or PMI_LOCAL_RANK).
- Slurm, inside a job step (`srun`, so SLURM_STEP_ID is set; a batch script's own SLURM_PROCID=0
  is not a rank): SLURM_PROCID / SLURM_NTASKS / SLURM_LOCALID.
MPI variables come before Slurm's: `mpiexec` inside an allocation leaves the allocation's SLURM_*
on every rank.

Master address (rank 0's host), unless MASTER_ADDR is set: the first host of the node file
(PBS_NODEFILE, COBALT_NODEFILE) or of the Slurm node list; a Slurm node name that does not resolve
is asked for its NodeAddr (`scontrol show node`); a job whose ranks all sit on one node uses
127.0.0.1. Never `hostname -I`: it lists every interface and picks the wrong one (DeepSpeed #5136).
Master port, unless MASTER_PORT is set: 20000 + the job id modulo 20000 (two jobs sharing a node
do not collide), else torch's 29500.

Weighed before writing this: lightning-fabric's cluster environments (SLURMEnvironment,
MPIEnvironment, LSFEnvironment) cover part of it, but MPIEnvironment needs mpi4py and MPI_Init in
every rank, there is no PALS or PMI one, and the package brings a second training framework for a
few environment reads; submitit's helpers (`submitit.helpers.TorchDistributedEnvironment`) read
Slurm's variables only, inside submitit's own jobs. Adopted: python-hostlist for Slurm's compressed
node lists (`gpu-[01-08,12]`). The rest is the table above, by hand. Nothing here imports torch.
"""

from __future__ import annotations

import dataclasses
import os
import re
import socket
import subprocess
from collections.abc import Mapping, MutableMapping

import hostlist

from ..errors import LaunchError

DEFAULT_MASTER_PORT = 29500  # torch's
PORT_BASE, PORT_SPAN = 20000, 20000  # job-derived ports: 20000..39999
NODE_FILES = ("PBS_NODEFILE", "COBALT_NODEFILE")
JOB_IDS = ("SLURM_JOB_ID", "PBS_JOBID", "COBALT_JOBID")

# (source, rank variable, world-size variables (first set wins), local-rank variables)
_SOURCES: tuple[tuple[str, str, tuple[str, ...], tuple[str, ...]], ...] = (
    ("openmpi", "OMPI_COMM_WORLD_RANK", ("OMPI_COMM_WORLD_SIZE",), ("OMPI_COMM_WORLD_LOCAL_RANK",)),
    ("cray-pals", "PALS_RANKID", ("PALS_SIZE", "PMI_SIZE"), ("PALS_LOCAL_RANKID",)),
    ("mpich", "PMI_RANK", ("PMI_SIZE",), ("MPI_LOCALRANKID", "PMI_LOCAL_RANK")),
)


@dataclasses.dataclass(frozen=True)
class ClusterEnv:
    """Where this process sits in its job; source names the launcher the values came from."""

    source: str
    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int

    def exports(self) -> dict[str, str]:
        return {
            "RANK": str(self.rank),
            "WORLD_SIZE": str(self.world_size),
            "LOCAL_RANK": str(self.local_rank),
            "MASTER_ADDR": self.master_addr,
            "MASTER_PORT": str(self.master_port),
        }


def _int(env: Mapping[str, str], name: str) -> int:
    try:
        return int(env[name])
    except ValueError:
        raise LaunchError(f"environment variable {name}={env[name]!r} is not an integer") from None


def _first_int(env: Mapping[str, str], names: tuple[str, ...], source: str, default: int | None) -> int:
    for name in names:
        if env.get(name, "") != "":
            return _int(env, name)
    if default is not None:
        return default
    raise LaunchError(f"{source} job: none of {', '.join(names)} is set; export one (the number of ranks)")


def discover(env: Mapping[str, str] | None = None) -> ClusterEnv | None:
    """This process's place in a scheduler/MPI job, or None when it was not started by one (or RANK
    and WORLD_SIZE are set already). LaunchError when a variable the launcher should set is missing."""
    env = os.environ if env is None else env
    if "RANK" in env and "WORLD_SIZE" in env:
        return None
    found: tuple[str, int, int, int] | None = None
    for source, rank_var, size_vars, local_vars in _SOURCES:
        if env.get(rank_var, "") != "":
            rank = _int(env, rank_var)
            found = (
                source,
                rank,
                _first_int(env, size_vars, source, None),
                _first_int(env, local_vars, source, 0),
            )
            break
    if found is None and env.get("SLURM_STEP_ID", "") != "" and env.get("SLURM_PROCID", "") != "":
        found = (
            "slurm",
            _int(env, "SLURM_PROCID"),
            _first_int(env, ("SLURM_NTASKS", "SLURM_NPROCS"), "slurm", None),
            _first_int(env, ("SLURM_LOCALID",), "slurm", 0),
        )
    if found is None:
        return None
    source, rank, world, local = found
    if not 0 <= rank < world:
        raise LaunchError(f"{source} job: rank {rank} is not in 0..{world - 1} (world size {world})")
    return ClusterEnv(source, rank, world, local, master_addr(env, source), master_port(env))


def apply_cluster_env(environ: MutableMapping[str, str] | None = None) -> ClusterEnv | None:
    """`discover`, then export its RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR / MASTER_PORT."""
    environ = os.environ if environ is None else environ
    found = discover(environ)
    if found is not None:
        environ.update(found.exports())
    return found


def master_addr(env: Mapping[str, str], source: str) -> str:
    """Rank 0's host: MASTER_ADDR, else the first host of the node file or the Slurm node list."""
    if env.get("MASTER_ADDR"):
        return env["MASTER_ADDR"]
    for name in NODE_FILES:
        if env.get(name):
            hosts = read_node_file(env[name], name)
            return hosts[0]
    nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST")
    if nodelist:
        return resolvable_address(expand_nodelist(nodelist)[0])
    local_size = env.get("OMPI_COMM_WORLD_LOCAL_SIZE") or env.get("MPI_LOCALNRANKS")
    if local_size and local_size == (env.get("OMPI_COMM_WORLD_SIZE") or env.get("PMI_SIZE")):
        return "127.0.0.1"  # every rank on this node
    raise LaunchError(
        f"{source} job: cannot tell rank 0's host; export MASTER_ADDR (rank 0's address) "
        f"or PBS_NODEFILE (a file with one host per line, rank 0's first) to every rank"
    )


def master_port(env: Mapping[str, str]) -> int:
    if env.get("MASTER_PORT"):
        return _int(env, "MASTER_PORT")
    for name in JOB_IDS:
        digits = re.match(r"\d+", env.get(name, ""))
        if digits:
            return PORT_BASE + int(digits.group()) % PORT_SPAN
    return DEFAULT_MASTER_PORT


def read_node_file(path: str, name: str = "node file") -> list[str]:
    """Hosts of a PBS/Cobalt node file, in order, each once (PBS repeats a host per slot)."""
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().split()
    except OSError as e:
        raise LaunchError(f"{name}={path}: cannot read it ({e.strerror})") from None
    hosts = list(dict.fromkeys(lines))
    if not hosts:
        raise LaunchError(f"{name}={path}: the file names no host")
    return hosts


def expand_nodelist(nodelist: str) -> list[str]:
    """Slurm's compressed list ('gpu-[01-02],n7') as host names (python-hostlist)."""

    try:
        return list(hostlist.expand_hostlist(nodelist))
    except hostlist.BadHostlist as e:
        raise LaunchError(f"Slurm node list {nodelist!r} cannot be expanded: {e}") from None


def resolvable_address(node: str) -> str:
    """node when its name resolves, else its Slurm NodeAddr (clusters, and our test Slurm, whose
    node names are not in DNS); node itself when Slurm cannot say either (the error comes later,
    from the rendezvous, naming the address)."""
    try:
        socket.getaddrinfo(node, None)
        return node
    except OSError:
        pass
    try:
        out = subprocess.run(
            ["scontrol", "show", "node", node, "-o"], capture_output=True, text=True, timeout=30, check=False
        ).stdout
    except (OSError, subprocess.TimeoutExpired):
        return node
    found = re.search(r"\bNodeAddr=(\S+)", out)
    return found.group(1) if found else node


def slurm_node_layout(env: Mapping[str, str] | None = None) -> tuple[int, int, str, int] | None:
    """For `srun --ntasks-per-node=1 stx launch -n G ...` (one launcher per node, torchtitan's
    way): (nodes, this node's rank, rank 0's address, port) of a Slurm job step with one task on
    each of several nodes; None anywhere else (and when RANK is set: a rank, not a launcher)."""
    env = os.environ if env is None else env
    if "RANK" in env or env.get("SLURM_STEP_ID", "") == "" or env.get("SLURM_NODEID", "") == "":
        return None
    nodes = _first_int(env, ("SLURM_STEP_NUM_NODES", "SLURM_NNODES"), "slurm", 1)
    tasks = _first_int(env, ("SLURM_STEP_NUM_TASKS", "SLURM_NTASKS"), "slurm", 1)
    if nodes < 2 or tasks != nodes:
        return None
    return nodes, _int(env, "SLURM_NODEID"), master_addr(env, "slurm"), master_port(env)
