"""Every torch internal parallel/torch_compat.py names still exists with the signature the package uses.

A failure reads "torch <version> changed <name>: <what to update>"; the module's docstring says what
each internal is for and what breaks without it.
"""

from __future__ import annotations

import importlib
import inspect

import pytest
import torch
from torch import nn
from torchao.float8 import Float8LinearConfig
from torchao.float8.float8_linear import Float8Linear

from scalable_transformer.parallel import torch_compat


def need(ok: bool, name: str, update: str) -> None:
    if not ok:
        pytest.fail(f"torch {torch.__version__} changed {name}: {update}", pytrace=False)


def params(fn: object) -> list[str]:
    return [p for p in inspect.signature(fn).parameters if p != "self"]  # type: ignore[arg-type]


def attribute(path: str) -> object:
    """`module.path:attr.attr` resolved, or the test fails naming it."""
    module_name, _, attrs = path.partition(":")
    try:
        obj: object = importlib.import_module(module_name)
        for attr in attrs.split(".") if attrs else []:
            obj = getattr(obj, attr)
    except (ImportError, AttributeError) as e:
        need(False, path, f"it is gone ({e}); see parallel/torch_compat.py for who uses it")
    return obj


def source_mentions(path: str, text: str) -> bool:
    return text in inspect.getsource(attribute(path))  # type: ignore[arg-type]


# ---------------------------------------------------------------- routed through torch_compat


def test_pipeline_p2p_wait_is_a_module_global_the_schedules_call():
    name = "torch.distributed.pipelining.schedules:_wait_batch_p2p"
    need(params(attribute(name)) == ["work"], name, "update torch_compat.pipeline_p2p_wait_wrapped")
    from torch.distributed.pipelining import schedules

    callers = [
        f"{cls.__name__}.{fn.__name__}"
        for cls in vars(schedules).values()
        if inspect.isclass(cls) and cls.__module__ == schedules.__name__
        for fn in vars(cls).values()
        if inspect.isfunction(fn) and "_wait_batch_p2p" in fn.__code__.co_names
    ]
    need(
        bool(callers),
        name,
        "no schedule calls it as a module global any more, so wrapping it times "
        "nothing: find the schedules' new P2P wait for parallel/comm.py's pipeline-p2p-wait",
    )


def test_wrapping_the_p2p_wait_puts_the_original_back():
    from torch.distributed.pipelining import schedules

    original = schedules._wait_batch_p2p
    seen: list[object] = []
    with torch_compat.pipeline_p2p_wait_wrapped(lambda wait: lambda work: seen.append(work) or wait(work)):
        schedules._wait_batch_p2p([])
    assert seen == [[]] and schedules._wait_batch_p2p is original


def test_pipeline_actions_and_custom_functions():
    for action in ("FULL_BACKWARD", "BACKWARD_INPUT", "BACKWARD_WEIGHT", "REDUCE_GRAD"):
        try:
            torch_compat.pipeline_action(action)
        except (ImportError, KeyError) as e:
            need(False, f"_ComputationType.{action}", f"{e}: update torch_compat.pipeline_action")
    from torch.distributed.pipelining import ScheduleLoopedBFS, ScheduleZBVZeroBubble

    for cls in (ScheduleLoopedBFS, ScheduleZBVZeroBubble):
        name = f"{cls.__name__}.register_custom_function"
        need(hasattr(cls, "register_custom_function"), name, "parallel/pipeline.py's evaluation schedules")
        need(
            params(cls.register_custom_function) == ["computation_type", "custom_function"],
            name,
            "parallel/pipeline.py's evaluation schedules",
        )
    attribute("torch.distributed.pipelining.schedules:_PipelineSchedule")  # torch_compat.PipelineSchedule


def test_checkpoint_wrapper():
    name = "torch.distributed.algorithms._checkpoint.checkpoint_wrapper:checkpoint_wrapper"
    need(
        params(attribute(name))[:3] == ["module", "checkpoint_impl", "checkpoint_fn"],
        name,
        "update torch_compat.checkpoint_wrapped",
    )
    attribute("torch.distributed.algorithms._checkpoint.checkpoint_wrapper:CheckpointImpl.NO_REENTRANT")
    model = nn.Sequential(torch_compat.checkpoint_wrapped(nn.Linear(2, 2)))
    # parallel/init.py's _WRAPPER_PARTS and checkpoint/manager.py strip this part of parameter names
    need(
        any("._checkpoint_wrapped_module." in n for n, _ in model.named_parameters()),
        "checkpoint_wrapper's parameter names",
        "update _WRAPPER_PARTS (parallel/init.py) and checkpoint/manager.py's _clean_fqn",
    )


def test_flatten_mesh():
    name = "torch.distributed.device_mesh:DeviceMesh._flatten"
    got = params(attribute(name))
    need(got[:1] == ["mesh_dim_name"], name, "update torch_compat.flatten_mesh")


def test_replicate():
    name = "torch.distributed._composable.replicate_with_fsdp:replicate"
    got = params(attribute(name))
    need(got[0] == "module" and {"mesh", "mp_policy"} <= set(got), name, "update torch_compat.replicate")


def test_all_to_all_autograd():
    name = "torch.distributed._functional_collectives:all_to_all_single_autograd"
    got = params(attribute(name))
    need(
        got[:3] == ["output_split_sizes", "input_split_sizes", "group"],
        name,
        "update torch_compat.all_to_all_autograd",
    )


def test_fsdp_mixed_precision_policy_attribute():
    attribute("torch.distributed.fsdp:FSDPModule._get_fsdp_state")
    need(
        source_mentions("torch.distributed.fsdp._fully_shard._fsdp_state:FSDPState", "self._mp_policy ="),
        "FSDPState._mp_policy",
        "update torch_compat.fsdp_mixed_precision",
    )
    assert torch_compat.fsdp_mixed_precision(nn.Linear(2, 2)) is None


def test_init_optimizer_state_creates_state_and_keeps_parameters():
    name = "torch.distributed.checkpoint.state_dict:_init_optim_state"
    need(params(attribute(name)) == ["optim"], name, "update torch_compat.init_optimizer_state")
    layer = nn.Linear(3, 2)
    before = [p.detach().clone() for p in layer.parameters()]
    optimizer = torch.optim.AdamW(layer.parameters(), lr=0.1)
    torch_compat.init_optimizer_state(optimizer)
    assert all("exp_avg" in optimizer.state[p] for p in layer.parameters())
    assert all(torch.equal(a, b) for a, b in zip(before, layer.parameters(), strict=True))


def test_fake_tensor_pause_and_buffer_persistence():
    attribute("torch._subclasses.fake_tensor:unset_fake_temporarily")
    with torch_compat.unset_fake_temporarily():
        pass
    module = nn.Module()
    module.register_buffer("kept", torch.zeros(1))
    module.register_buffer("derived", torch.zeros(1), persistent=False)
    need(
        hasattr(module, "_non_persistent_buffers_set"),
        "nn.Module._non_persistent_buffers_set",
        "update torch_compat.is_persistent_buffer",
    )
    assert torch_compat.is_persistent_buffer(module, "kept")
    assert not torch_compat.is_persistent_buffer(module, "derived")


def test_profiler_and_cuda_memory_internals():
    attribute("torch._C._profiler:_EventType.Allocation")
    attribute("torch.autograd.profiler:profile")  # .kineto_results.experimental_event_tree() at runtime
    record, update = "torch.cuda.memory:_record_memory_history", "update torch_compat's CUDA memory functions"
    need("enabled" in params(attribute(record)), record, update)
    need("max_entries" in params(attribute(record + "_impl")), record + "(max_entries=)", update)
    dump = "torch.cuda.memory:_dump_snapshot"
    need(params(attribute(dump))[:1] == ["filename"], dump, update)


# ---------------------------------------------------------------- FSDP2's Comm interface (duck-typed)


def test_sdpa_dispatch_names_the_kernel_scaled_dot_product_attention_takes():
    """torch._fused_sdp_choice answers for these inputs as SDPA dispatches them: on this CPU its
    fused (flash) kernel without dropout, the math path with it (what plan/memory_model.py assumes)."""
    attribute("torch:_fused_sdp_choice")
    from torch.nn.attention import SDPBackend

    q = torch.randn(2, 4, 64, 32, requires_grad=True)
    name = "torch._fused_sdp_choice"
    need(torch_compat.sdpa_dispatch(q, q, q, 0.0, True) == SDPBackend.FLASH_ATTENTION, name,
         "a CPU causal call without dropout should choose FLASH_ATTENTION; update sdpa_dispatch")  # fmt: skip
    need(torch_compat.sdpa_dispatch(q, q, q, 0.1, True) == SDPBackend.MATH, name,
         "a CPU call with dropout should choose MATH; update sdpa_dispatch")  # fmt: skip


def test_fsdp_comm_interface_matches_parallel_comm():
    api = "torch.distributed.fsdp._fully_shard._fsdp_api"
    update = "parallel/comm.py's TimedAllGather / TimedReduceScatter implement this interface"
    for cls, call in (
        ("AllGather", ["output_tensor", "input_tensor", "group", "async_op"]),
        ("ReduceScatter", ["output_tensor", "input_tensor", "group", "op", "async_op"]),
    ):
        abstract = attribute(f"{api}:{cls}")
        need(set(abstract.__abstractmethods__) == {"allocate", "__call__"}, f"{cls}'s methods", update)  # type: ignore[attr-defined]
        need(params(abstract.__call__) == call, f"{cls}.__call__", update)  # type: ignore[attr-defined]
        allocate = inspect.signature(abstract.allocate)  # type: ignore[attr-defined]
        need(list(allocate.parameters)[1:] == ["size", "dtype", "device"], f"{cls}.allocate", update)
    collectives = "torch.distributed.fsdp._fully_shard._fsdp_collectives"
    # ours call what the defaults call: a change there is a change ours must follow
    need(
        source_mentions(f"{collectives}:DefaultAllGather", "dist.all_gather_single("),
        "DefaultAllGather",
        update,
    )
    need(
        source_mentions(f"{collectives}:DefaultReduceScatter", "dist.reduce_scatter_single("),
        "DefaultReduceScatter",
        update,
    )
    need(
        source_mentions(f"{collectives}:DefaultAllocMixin", "torch.empty(*size"), "DefaultAllocMixin", update
    )
    for method in ("set_custom_all_gather", "set_custom_reduce_scatter"):
        attribute(f"torch.distributed.fsdp:FSDPModule.{method}")
    gather = params(torch.distributed.all_gather_single)
    need(
        gather[:4] == ["output_tensor", "input_tensor", "group", "async_op"], "dist.all_gather_single", update
    )
    scatter = set(params(torch.distributed.reduce_scatter_single))
    need({"output", "input", "op", "group", "async_op"} <= scatter, "dist.reduce_scatter_single", update)


# ---------------------------------------------------------------- used in place, listed in torch_compat


@pytest.mark.parametrize(
    "path",
    [
        # parallel/grads.py, train/loss_scale.py
        "torch:_foreach_mul_",
        "torch:_amp_foreach_non_finite_check_and_unscale_",
        # parallel/tensor.py: a ParallelStyle implements _apply
        "torch.distributed.tensor.parallel:ParallelStyle._apply",
        # launch/local.py
        "torch.distributed.elastic.agent.server.local_elastic_agent:LocalElasticAgent._monitor_workers",
        "torch.distributed.launcher.api:LocalElasticAgent",
        "torch.distributed.elastic.multiprocessing.api:SubprocessContext",
        # dryrun/dry_run.py, dryrun/dry_run_trace.py
        "torch.testing._internal.distributed.fake_pg:FakeStore",
        "torch._subclasses.fake_tensor:FakeTensorMode",
        "torch._subclasses.fake_tensor:FakeTensor",
        "torch.utils._python_dispatch:TorchDispatchMode",
        "torch.utils._pytree:tree_leaves",
        "torch._guards:detect_fake_mode",
        "torch.distributed._tools.mod_tracker:ModTracker",
        "torch._C:_current_autograd_node",
        "torch._C._distributed_c10d:_create_work_from_future",
        "torch.distributed.tensor._sharding_prop:ShardingPropagator._propagate_tensor_meta_non_cached",
        "torch.distributed.pipelining.schedules:_PipelineSchedule._warmup_p2p",
        "torch.distributed.pipelining._utils:InferenceMode.needs_dynamic",
        "torch.nn.parallel.distributed:_verify_param_shape_across_processes",
        "torch.distributed:Reducer._rebuild_buckets",
        # dryrun/fake_cuda.py
        "torch._C:_ensureCUDADeviceGuardSet",
    ],
)
def test_internal_used_in_place_exists(path):
    attribute(path)


def test_internals_used_in_place_keep_their_shape():
    from torch.distributed.tensor import DTensor

    need(
        source_mentions("torch.nn.modules.module:Module.__getattr__", "_parameters[name]"),
        "nn.Module._parameters",
        "parallel/expert.py swaps the expert weights for their local shards in it",
    )
    need(
        "_local_tensor" in getattr(DTensor, "__slots__", ()),
        "DTensor._local_tensor",
        "parallel/grads.py and dryrun/dry_run_trace.py read a DTensor's local shard through it",
    )
    warmup = "torch.distributed.pipelining.schedules:_PipelineSchedule._warmup_p2p"
    need(
        params(attribute(warmup)) == ["stages", "has_backward", "p2p_done"],
        warmup,
        "dryrun/dry_run.py's local_vote stub takes these arguments",
    )
    need(
        source_mentions("torch.distributed.pipelining.stage", "self._user_meta ="),
        "PipelineStage._user_meta",
        "dryrun/dry_run.py's local_vote reads it",
    )
    agent = "torch.distributed.elastic.agent.server.local_elastic_agent:LocalElasticAgent"
    need(source_mentions(agent, "self._pcontext"), "LocalElasticAgent._pcontext", "launch/local.py")
    simple = "torch.distributed.elastic.agent.server.api:SimpleElasticAgent"
    need(
        source_mentions(simple, "_remaining_restarts"),
        "SimpleElasticAgent._remaining_restarts",
        "launch/local.py",
    )
    context = "torch.distributed.elastic.multiprocessing.api:SubprocessContext"
    need(
        source_mentions(context, "self.subprocess_handlers"),
        "SubprocessContext.subprocess_handlers",
        "launch/local.py",
    )


def test_wrapper_subclasses_unwrap_to_the_tensor_holding_the_storage():
    """torchao's float8 weight wrapper (train.fp8 under FSDP2) is a traceable wrapper subclass whose
    own storage is invalid; wrapped_tensor reaches the fp32 weight inside."""
    attribute("torch.utils._python_dispatch:is_traceable_wrapper_subclass")
    config = Float8LinearConfig(enable_fsdp_float8_all_gather=True)
    weight = Float8Linear.from_float(nn.Linear(16, 16), config).weight
    assert torch_compat.is_wrapper_tensor(weight)
    inner = torch_compat.wrapped_tensor(weight)
    assert not torch_compat.is_wrapper_tensor(inner) and inner.untyped_storage().nbytes() == 16 * 16 * 4
    plain = torch.zeros(2)
    assert torch_compat.wrapped_tensor(plain) is plain and not torch_compat.is_wrapper_tensor(plain)
