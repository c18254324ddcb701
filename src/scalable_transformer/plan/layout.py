"""One candidate layout: how a job of dp x cp x tp x pp devices runs the model, and the config it makes."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from ..config.schema import Config


@dataclass(frozen=True)
class Layout:
    """The fields of `--json`'s "layout" object, in its order."""

    tp: int
    pp: int
    dp: int
    zero_stage: int
    offload_optimizer: bool
    offload_param: bool
    micro_batch_size: int
    gradient_accumulation_steps: int
    activation_checkpointing: str
    pipeline_schedule: str
    virtual_pipeline_stages: int
    sequence_parallel: bool = False
    reduce_each_micro_batch: bool = False
    distribute_saved_activations: bool = False
    cpu_checkpointing: bool = False
    dp_shard: int = -1  # ZeRO-2/3: ranks sharded over (-1: dp); < dp is hybrid sharding (HSDP)
    cp: int = 1  # context parallel: ranks each sample's sequence is split over
    ep: int = 1  # expert parallel (MoE): ranks the routed experts are split over, carved out of dp x cp

    @property
    def world_size(self) -> int:
        return self.dp * self.cp * self.tp * self.pp

    @property
    def global_batch_size(self) -> int:
        return self.micro_batch_size * self.gradient_accumulation_steps * self.dp

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        return d

    @classmethod
    def from_config(cls, cfg: Config) -> Layout:
        """The layout of a resolved config (dp and gradient_accumulation_steps filled)."""
        p, t = cfg.parallel, cfg.train
        assert t.gradient_accumulation_steps is not None
        return cls(
            tp=p.tp,
            pp=p.pp,
            dp=p.dp,
            zero_stage=p.zero_stage,
            offload_optimizer=p.offload_optimizer,
            offload_param=p.offload_param,
            micro_batch_size=t.micro_batch_size,
            gradient_accumulation_steps=t.gradient_accumulation_steps,
            activation_checkpointing=p.activation_checkpointing,
            pipeline_schedule=p.pipeline_schedule,
            virtual_pipeline_stages=p.virtual_pipeline_stages,
            sequence_parallel=p.sequence_parallel,
            reduce_each_micro_batch=p.reduce_each_micro_batch,
            distribute_saved_activations=p.distribute_saved_activations,
            cpu_checkpointing=p.cpu_checkpointing,
            dp_shard=p.dp_shard,
            cp=p.cp,
            ep=p.ep,
        )

    def apply(self, cfg: Config) -> Config:
        """A copy of cfg with this layout (parallel and batch keys replaced; nothing else changed)."""
        parallel = dataclasses.replace(
            cfg.parallel,
            tp=self.tp,
            pp=self.pp,
            dp=self.dp,
            zero_stage=self.zero_stage,
            offload_optimizer=self.offload_optimizer,
            offload_param=self.offload_param,
            activation_checkpointing=self.activation_checkpointing,
            pipeline_schedule=self.pipeline_schedule,
            virtual_pipeline_stages=self.virtual_pipeline_stages,
            sequence_parallel=self.sequence_parallel,
            reduce_each_micro_batch=self.reduce_each_micro_batch,
            distribute_saved_activations=self.distribute_saved_activations,
            cpu_checkpointing=self.cpu_checkpointing,
            dp_shard=self.dp_shard,
            cp=self.cp,
            ep=self.ep,
            pipeline_layers=cfg.parallel.pipeline_layers if self.pp == cfg.parallel.pp else None,
        )
        train = dataclasses.replace(
            cfg.train,
            micro_batch_size=self.micro_batch_size,
            gradient_accumulation_steps=self.gradient_accumulation_steps,
            global_batch_size=self.global_batch_size,
        )
        return dataclasses.replace(cfg, parallel=parallel, train=train)

    def overrides(self) -> dict[str, Any]:
        """The `key=value` overrides (dotted names) that select this layout in a config."""
        return {
            "parallel.tp": self.tp,
            "parallel.pp": self.pp,
            "parallel.zero_stage": self.zero_stage,
            "parallel.offload_optimizer": self.offload_optimizer,
            "parallel.offload_param": self.offload_param,
            "parallel.sequence_parallel": self.sequence_parallel,
            "parallel.activation_checkpointing": self.activation_checkpointing,
            "parallel.pipeline_schedule": self.pipeline_schedule,
            "parallel.virtual_pipeline_stages": self.virtual_pipeline_stages,
            "parallel.reduce_each_micro_batch": self.reduce_each_micro_batch,
            "parallel.distribute_saved_activations": self.distribute_saved_activations,
            "parallel.cpu_checkpointing": self.cpu_checkpointing,
            "parallel.dp_shard": self.dp_shard,
            "parallel.cp": self.cp,
            "parallel.ep": self.ep,
            "train.micro_batch_size": self.micro_batch_size,
            "train.gradient_accumulation_steps": self.gradient_accumulation_steps,
        }

    def label(self) -> str:
        cp = f" cp={self.cp}" if self.cp > 1 else ""
        ep = f" ep={self.ep}" if self.ep > 1 else ""
        parts = [f"dp={self.dp}{cp}{ep} tp={self.tp} pp={self.pp} zero{self.zero_stage}"]
        if self.offload_optimizer or self.offload_param:
            parts[-1] += "+offload" + ("(param)" if self.offload_param else "")
        if 0 < self.dp_shard < self.dp:
            parts.append(f"dp_shard={self.dp_shard}")
        if self.sequence_parallel:
            parts.append("sp")
        if self.pp > 1:
            parts.append(
                self.pipeline_schedule
                + (f"x{self.virtual_pipeline_stages}" if self.virtual_pipeline_stages > 1 else "")
            )
        parts.append(f"mb={self.micro_batch_size}x{self.gradient_accumulation_steps}")
        if self.reduce_each_micro_batch:
            parts.append("reduce-each-mb")
        if self.activation_checkpointing != "none":
            where = [
                w
                for w, on in (
                    ("distributed", self.distribute_saved_activations),
                    ("host", self.cpu_checkpointing),
                )
                if on
            ]
            parts.append(f"recompute={self.activation_checkpointing}" + "".join(f"+{w}" for w in where))
        return " ".join(parts)
