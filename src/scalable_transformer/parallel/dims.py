"""ParallelDims: THE topology object of a run.

Sizes (data x tensor x pipeline, virtual stages, schedule), this process's rank and coordinates, its
pipeline stage ids and whether it holds the first/last stage, and, once a process group exists, the
DeviceMesh and the per-dimension process groups. Built once per run (`ParallelDims.build`) and handed
to parallelize, the pipeline runner, the trainer and the checkpoint manager: nothing else reads the
rank from the environment or builds groups.

Rank order follows Megatron: tensor-parallel ranks are adjacent (fastest-varying), then context
parallel, then data parallel, then pipeline. The mesh is ("pp", "dp", "cp", "tp"), with size-1
dimensions kept, so `mesh["dp"]` and `mesh["cp"]` exist in every layout. Hybrid sharding
(parallel.dp_shard < dp) splits dp into ("dp_replicate", "dp_shard"), shard ranks adjacent, and names
their flattening "dp": the same data-parallel ranks and group, and `fsdp_mesh` the 2-D replicate x
shard mesh FSDP2 shards over.

Context parallelism splits each sample's sequence over the cp ranks of one data-parallel rank: they
load the same samples (the data splits over dp only) but hold the same parameters, so gradients are
reduced, and parameters sharded, over the flattened dp x cp ranks ("dp_cp"): `grad_mesh` /
`grad_group`, which are the dp ones when cp = 1. With hybrid sharding, FSDP2 shards over dp_shard x cp
and replicates over dp_replicate (torchtitan's ("dp_replicate", "dp_shard_cp") mesh).

Expert parallelism (parallel.ep, MoE models) carves its ranks out of the dp x cp ranks of one (pp, tp)
coordinate: the flattened dp x cp order (dp outer, cp inner) is split into ("edp", "ep") with ep
fastest, so an expert-parallel group is ep consecutive dp x cp ranks (the cp ranks of one sample
first, then neighbouring data-parallel ranks: on a node when tp x ep fits one, which the all-to-all
wants) and the global rank order stays Megatron's: tp, cp, dp, pp, with ep inside dp x cp
(Megatron's expert order tp-ep-dp-pp, torchtitan's ep inside dp_shard x cp). "ep" holds different
experts and exchanges tokens by all-to-all; "edp" (expert data parallel: dp x cp / ep ranks) holds
the same experts and reduces their gradients (torchtitan's efsdp / dp_shard_mod_ep). `expert_mesh`
is the 2-D (edp, ep) mesh they come from (under tensor parallelism the 3-D (edp, ep, tp), whose (ep,
tp) the experts' weights are sharded over and whose ep groups join ranks of one tp index); everything
that is not an expert still uses `grad_mesh`.

The validity rules of a layout (divisibility, world size, schedule needs) are torch-free and live in
`config.rules`, where `resolve` applies them before any process group exists.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from ..config.rules import check_layout, dp_shard_size, stage_ids, stage_layer_counts, stage_rank
from ..config.schema import Config
from ..errors import ConfigError

MESH_DIMS = ("pp", "dp", "cp", "tp")
HSDP_MESH_DIMS = ("pp", "dp_replicate", "dp_shard", "cp", "tp")

__all__ = ["MESH_DIMS", "ParallelDims", "check_layout", "stage_ids", "stage_layer_counts", "stage_rank"]


@dataclass(frozen=True)
class ParallelDims:
    dp: int
    tp: int
    pp: int
    virtual_stages: int = 1
    schedule: str = "1f1b"
    rank: int = 0  # this process's global rank
    dp_shard: int = -1  # ranks a ZeRO-2/3 parameter is sharded over (-1: dp); < dp is hybrid sharding
    cp: int = 1  # context parallel: ranks one sample's sequence is split over
    # the ("pp", "dp", "tp") DeviceMesh (HSDP: ("pp", "dp_replicate", "dp_shard", "tp")); None for a
    # plain single-process run without a process group
    mesh: Any = field(default=None, compare=False, repr=False)
    # HSDP: the flattened ("dp_replicate", "dp_shard") mesh, kept here as torch asks (slicing a
    # flattened dimension from the root mesh is deprecated)
    flat_dp_mesh: Any = field(default=None, compare=False, repr=False)
    # cp > 1: the flattened ("dp", "cp") mesh that gradients are reduced (and parameters sharded) over
    dp_cp_mesh: Any = field(default=None, compare=False, repr=False)
    # HSDP with cp > 1: the 2-D (dp_replicate, dp_shard x cp flattened) mesh FSDP2 shards over
    hsdp_cp_mesh: Any = field(default=None, compare=False, repr=False)
    ep: int = 1  # expert parallel: ranks of dp x cp the routed experts are split over
    # ep > 1: the 2-D ("edp", "ep") mesh over the dp x cp ranks (module doc)
    expert_mesh: Any = field(default=None, compare=False, repr=False)

    # ------------------------------------------------------------ sizes

    @property
    def world_size(self) -> int:
        return self.dp * self.cp * self.tp * self.pp

    @property
    def shard_size(self) -> int:
        """The data-parallel ranks FSDP2 shards over: dp, or dp_shard under hybrid sharding."""
        return self.dp if self.dp_shard == -1 else self.dp_shard

    @property
    def hybrid(self) -> bool:
        """Hybrid sharding (HSDP): replicas of dp_shard-way shards."""
        return self.shard_size < self.dp

    @property
    def num_stages(self) -> int:
        return self.pp * self.virtual_stages

    @classmethod
    def from_config(cls, cfg: Config, rank: int = 0) -> ParallelDims:
        """For a resolved config (dp already inferred); no mesh."""
        p = cfg.parallel
        if p.dp < 1:
            raise ConfigError(f"parallel.dp = {p.dp}: resolve the config for a world size first")
        return cls(
            dp=p.dp,
            tp=p.tp,
            pp=p.pp,
            virtual_stages=p.virtual_pipeline_stages,
            schedule=p.pipeline_schedule,
            rank=rank,
            dp_shard=dp_shard_size(p),
            cp=p.cp,
            ep=p.ep,
        )

    @classmethod
    def build(cls, cfg: Config, device_type: str) -> ParallelDims:
        """The run's topology: rank from the default process group (0 without one) and, when a process
        group exists, the mesh over it."""
        # torch only here: plan/ and the layout rules use ParallelDims's arithmetic without torch
        import torch.distributed as dist

        from .torch_compat import flatten_mesh, unflatten_mesh

        if not dist.is_initialized():
            return cls.from_config(cfg)
        dims = cls.from_config(cfg, dist.get_rank())
        if dims.world_size != dist.get_world_size():
            raise ConfigError(
                f"the layout has {dims.world_size} ranks (dp x cp x tp x pp) but the process group has "
                f"{dist.get_world_size()}"
            )
        dims = dims._with_meshes(dims.build_mesh(device_type))
        if dims.ep == 1:
            return dims
        edp = dims.grad_ranks // dims.ep
        if dims.tp == 1:
            expert = unflatten_mesh(dims.grad_mesh, (edp, dims.ep), ("edp", "ep"))
        else:  # (edp, ep, tp) over dp x cp x tp, tp fastest: the experts' weights live on (ep, tp)
            names = tuple(n for n in dims.mesh.mesh_dim_names if n != "pp")
            flat = flatten_mesh(dims.mesh[names], "expert_dp_cp_tp")
            expert = unflatten_mesh(flat, (edp, dims.ep, dims.tp), ("edp", "ep", "tp"))
        return dataclasses.replace(dims, expert_mesh=expert)

    def _with_meshes(self, mesh: Any) -> ParallelDims:
        """This topology with `mesh` and the flattened meshes derived from it."""
        from .torch_compat import flatten_mesh, unflatten_mesh

        flat = flatten_mesh(mesh["dp_replicate", "dp_shard"], "dp") if self.hybrid else None
        if self.cp == 1:
            return dataclasses.replace(self, mesh=mesh, flat_dp_mesh=flat)
        if not self.hybrid:
            dp_cp = flatten_mesh(mesh["dp", "cp"], "dp_cp")
            return dataclasses.replace(self, mesh=mesh, dp_cp_mesh=dp_cp)
        # torchtitan's meshes: gradients over all three, shards over dp_shard x cp ("dp_shard_cp")
        dp_cp = flatten_mesh(mesh["dp_replicate", "dp_shard", "cp"], "dp_cp")
        replicas = self.dp // self.shard_size
        hsdp = unflatten_mesh(dp_cp, (replicas, self.shard_size * self.cp), ("dp_replicate", "dp_shard_cp"))
        return dataclasses.replace(self, mesh=mesh, flat_dp_mesh=flat, dp_cp_mesh=dp_cp, hsdp_cp_mesh=hsdp)

    # ------------------------------------------------------------ this rank

    def coordinates(self, rank: int | None = None) -> dict[str, int]:
        """(pp, dp, cp, tp) coordinates of a global rank (this one by default), without a mesh."""
        rank = self.rank if rank is None else rank
        tp_rank = rank % self.tp
        cp_rank = (rank // self.tp) % self.cp
        dp_rank = (rank // (self.tp * self.cp)) % self.dp
        pp_rank = rank // (self.tp * self.cp * self.dp)
        return {"pp": pp_rank, "dp": dp_rank, "cp": cp_rank, "tp": tp_rank}

    @property
    def ep_rank(self) -> int:
        """This rank's place in its expert-parallel group: it holds experts [ep_rank * E / ep, ...)."""
        return (self.dp_rank * self.cp + self.cp_rank) % self.ep

    @property
    def edp_rank(self) -> int:
        """This rank's place among the dp x cp / ep ranks holding the same experts."""
        return (self.dp_rank * self.cp + self.cp_rank) // self.ep

    @property
    def pp_rank(self) -> int:
        return self.coordinates()["pp"]

    @property
    def dp_rank(self) -> int:
        return self.coordinates()["dp"]

    @property
    def cp_rank(self) -> int:
        return self.coordinates()["cp"]

    @property
    def tp_rank(self) -> int:
        return self.coordinates()["tp"]

    @property
    def is_main(self) -> bool:
        """Rank 0 writes the run directory, logs and summary."""
        return self.rank == 0

    @property
    def stage_ids(self) -> list[int]:
        """Global pipeline stage indices this rank holds, in model order ([0] without pipelining)."""
        return stage_ids(self.pp, self.pp_rank, self.virtual_stages, self.schedule)

    @property
    def has_first_stage(self) -> bool:
        return 0 in self.stage_ids

    @property
    def has_last_stage(self) -> bool:
        return self.num_stages - 1 in self.stage_ids

    # ------------------------------------------------------------ mesh and groups

    def build_mesh(self, device_type: str):
        """The DeviceMesh over the default process group (which must already be initialized)."""
        # torch only here: plan/ and the layout rules use ParallelDims's arithmetic without torch
        from torch.distributed.device_mesh import init_device_mesh

        if not self.hybrid:
            shape: tuple[int, ...] = (self.pp, self.dp, self.cp, self.tp)
            return init_device_mesh(device_type, shape, mesh_dim_names=MESH_DIMS)
        shape = (self.pp, self.dp // self.shard_size, self.shard_size, self.cp, self.tp)
        return init_device_mesh(device_type, shape, mesh_dim_names=HSDP_MESH_DIMS)

    @property
    def fsdp_mesh(self) -> Any:
        """The mesh FSDP2 shards over: the data-parallel one (dp x cp flattened under context
        parallelism), or (dp_replicate, dp_shard) under HSDP ((dp_replicate, dp_shard x cp) with cp)."""
        assert self.mesh is not None
        if not self.hybrid:
            return self.grad_mesh
        return self.hsdp_cp_mesh if self.hsdp_cp_mesh is not None else self.mesh["dp_replicate", "dp_shard"]

    @property
    def grad_mesh(self) -> Any:
        """The 1-D mesh whose ranks hold the same parameters and average their gradients (DDP,
        replicate, FSDP2 without HSDP, ZeRO-1): dp, or dp x cp flattened under context parallelism."""
        assert self.mesh is not None
        return self.dp_cp_mesh if self.dp_cp_mesh is not None else self.sub_mesh("dp")

    @property
    def grad_ranks(self) -> int:
        """How many ranks average each gradient (and share each step's loss): dp x cp."""
        return self.dp * self.cp

    @property
    def grad_group(self) -> Any:
        """The group of `grad_mesh`: token counts and metric sums span it; None when it is one rank."""
        return self.grad_mesh.get_group() if self.mesh is not None and self.grad_ranks > 1 else None

    def sub_mesh(self, dim: str) -> Any:
        """The 1-D mesh of "pp", "dp", "cp" or "tp" (HSDP's "dp": its replicate x shard ranks flattened)."""
        assert self.mesh is not None
        return self.flat_dp_mesh if dim == "dp" and self.flat_dp_mesh is not None else self.mesh[dim]

    def _group(self, dim: str, size: int) -> Any:
        return self.sub_mesh(dim).get_group() if self.mesh is not None and size > 1 else None

    @property
    def dp_group(self) -> Any:
        """The data-parallel process group; None without data parallelism (or without a mesh)."""
        return self._group("dp", self.dp)

    @property
    def cp_group(self) -> Any:
        """The context-parallel process group; None without context parallelism (or a mesh)."""
        return self._group("cp", self.cp)

    @property
    def ep_mesh(self) -> Any:
        """The 1-D mesh of the ranks that split the experts between them (ep > 1 only)."""
        assert self.expert_mesh is not None, "parallel.ep = 1: no expert-parallel mesh"
        return self.expert_mesh["ep"]

    @property
    def expert_weight_mesh(self) -> Any:
        """The mesh the routed experts' weights are sharded over (parallel/expert.py): ("ep", "tp"),
        ("ep",) or ("tp",); None when neither splits them."""
        if self.ep > 1 and self.tp > 1:
            assert self.expert_mesh is not None
            return self.expert_mesh["ep", "tp"]
        if self.ep > 1:
            return self.ep_mesh
        return self.sub_mesh("tp") if self.mesh is not None and self.tp > 1 else None

    @property
    def edp_mesh(self) -> Any:
        """The 1-D mesh of the ranks that hold the same experts and reduce their gradients (ep > 1)."""
        assert self.expert_mesh is not None, "parallel.ep = 1: no expert-parallel mesh"
        return self.expert_mesh["edp"]

    @property
    def pp_group(self) -> Any:
        return self._group("pp", self.pp)
