"""The all-reduce, the residual add and the RMSNorm after it in one kernel.

At tp_size > 1 each row-parallel product (o_proj, down_proj) ends in an
all-reduce, and the next thing the layer does is add the residual stream and
normalise (`layers.norm.RMSNorm`). On the GPU this module does the three in
one launch with FlashInfer's fused all-reduce (its TensorRT-LLM kernels):
each rank writes its partial sums into every peer's buffer (peer-to-peer
mapped memory, no NVLink multicast) and each sums them, adds the residual
and normalises its rows. The products before it then leave their sums
unreduced (`models.decoder`, `TPComm.fuses_norms`).

Up to `max_tokens` rows (decode batches); longer prefill chunks keep the
all-reduce and the norm kernel. The buffers (about 16 x max_tokens x hidden
bytes per rank in bf16 at two ranks) live outside the engine's releasable
memory until the engine's ranks leave their group (`close`).
The kernel rounds the normalised row once, after the weight, where
`RMSNorm` rounds it before the weight as Hugging Face does: an element may
differ in its last bit. So batch-invariant mode never takes it.

`ROLLOUT_ENGINE_ALLREDUCE` picks the path (`fast_allreduce.allreduce_mode`):
`fused` or unset, the norms take the all-reduce: in the fused kernel on the
GPU, in two steps on the CPU (the same structure); `one-shot`, the one-shot
kernel (`fast_allreduce`) for small messages and NCCL for the rest, each
norm its own kernel; `nccl`, NCCL for every all-reduce. The fused kernel's
first use on a machine builds FlashInfer's kernels (257 s on a 16-core H200
host, over 250 s on a 32-core one; cached after, its progress logged). A GPU where it cannot be set up
goes on as `one-shot` (a warning when `fused` was asked for by name or a
build or setup failed, INFO where the kernel does not apply). Measured:
BENCHMARKS.md, "Tensor parallelism".
"""
from __future__ import annotations

import logging

import torch

from rollout_engine.distributed.fast_allreduce import ENV, agree_everywhere, allreduce_mode, allreduce_mode_is_set

log = logging.getLogger("rollout_engine")

# The kernels' buffers set up per group (by id), freed when the group's ranks leave it (`close_for`): the
# engine's parts hold their own copy of the comm, not the one the group's teardown sees.
_OPEN: dict[int, "FusedAllReduceNorm"] = {}

MAX_TOKENS = 512  # rows per call: the decode batches (a longer prefill chunk takes NCCL and the norm kernel)
WORLD_SIZES = (2, 4, 8)  # what the kernel is built for


class FusedAllReduceNorm:
    """RMSNorm(all_reduce(x) + residual) of up to `max_tokens` rows of
    `hidden` columns in one kernel; returns (normalised rows, new residual
    stream). Every rank of the group calls it for the same rows in the same
    order, as it does any collective."""

    def __init__(self, group, tp_rank: int, tp_size: int, hidden: int, dtype: torch.dtype, device: torch.device,
                 max_tokens: int = MAX_TOKENS):
        from flashinfer.comm import create_allreduce_fusion_workspace

        self.hidden, self.dtype, self.max_tokens = hidden, dtype, max_tokens
        with torch.cuda.device(device):
            # "trtllm" by name: the automatic choice takes a backend that needs NVLink multicast
            self.workspace = create_allreduce_fusion_workspace(
                backend="trtllm", world_size=tp_size, rank=tp_rank, max_token_num=max_tokens, hidden_dim=hidden,
                dtype=dtype, group=group)

    def fits(self, x: torch.Tensor, residual: torch.Tensor) -> bool:
        """Decided by what every rank has alike (the rows' count, width and
        type): a rank in the kernel waits for every other's rows, so all must
        take it or none."""
        return (x.is_cuda and x.dim() == 2 and 0 < x.shape[0] <= self.max_tokens and x.shape[1] == self.hidden
                and x.dtype == self.dtype and residual.shape == x.shape and residual.dtype == x.dtype)

    def __call__(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        from flashinfer.comm import AllReduceFusionPattern, allreduce_fusion

        from rollout_engine.kernels._triton import use_pdl

        x, residual = x.contiguous(), residual.contiguous()
        weight = weight.to(x.dtype).contiguous()  # the kernel reads the weight as the rows' type
        normed, new_residual = torch.empty_like(x), torch.empty_like(x)
        allreduce_fusion(x, self.workspace, AllReduceFusionPattern.kARResidualRMSNorm, launch_with_pdl=use_pdl(x),
                         output=normed, residual_out=new_residual, norm_out=normed, residual_in=residual,
                         rms_gamma=weight, rms_eps=eps, fp32_acc=True)  # the ranks' sum rounded once
        return normed, new_residual

    def close(self) -> None:
        """Free the buffers (after this rank's last kernel: every peer's
        writes into them are done by then). FlashInfer keeps its own
        reference to them besides the workspace's: both are dropped."""
        from flashinfer.comm.trtllm_ar import trtllm_destroy_ipc_workspace_for_all_reduce_fusion

        torch.cuda.synchronize()
        trtllm_destroy_ipc_workspace_for_all_reduce_fusion(self.workspace.ipc_handles)
        self.workspace.destroy()


class AllReduceThenNorm:
    """The structure without the kernel (the CPU, where
    `ROLLOUT_ENGINE_ALLREDUCE` is `fused` or unset): the products leave their
    sums to the norms as with the kernel, and no rows fit it, so
    `TPComm.all_reduce_norm` all-reduces, then calls the norm itself."""

    def __init__(self, max_tokens: int = MAX_TOKENS):
        self.max_tokens = max_tokens

    def fits(self, x: torch.Tensor, residual: torch.Tensor) -> bool:
        return False


def make_fused_norm(comm, hidden: int, dtype: torch.dtype, device: torch.device):
    """This rank's fused all-reduce + norm for `comm`'s group where
    `ROLLOUT_ENGINE_ALLREDUCE` is `fused` or unset (the kernel on the GPU,
    the two steps on the CPU), else None (also on a GPU where the kernel
    cannot be set up). Every rank of the group calls this together."""
    if comm.tp_size == 1 or allreduce_mode() != "fused":
        return None
    fused, error = None, None
    if device.type == "cuda" and comm.tp_size in WORLD_SIZES and hidden % 8 == 0:
        # The kernels are built before any rank launches one (a rank inside the kernel waits for the
        # others' rows: one that failed to build would leave them spinning), then the buffers are set up.
        try:
            _build_kernels(first=comm.tp_rank == 0)
        except Exception as e:  # noqa: BLE001 - an optional fast path: the norms still work unfused
            error = e
        if agree_everywhere(error is None, comm.group, device):
            try:
                fused = FusedAllReduceNorm(comm.group, comm.tp_rank, comm.tp_size, hidden, dtype, device)
            except Exception as e:  # noqa: BLE001
                error = e
            if not agree_everywhere(fused is not None, comm.group, device):
                fused, error = None, error or RuntimeError("another rank could not set up its buffers")
        elif error is None:
            error = RuntimeError("another rank could not build or load the kernels")
    if fused is not None:
        log.info("tensor parallelism: the all-reduce, residual add and RMSNorm in one kernel (up to %d rows)",
                 fused.max_tokens)
        _OPEN[id(comm.group)] = fused
        return fused
    if device.type == "cuda":  # two steps would only cost the one-row products their norm: as one-shot
        why = error or f"tp_size {comm.tp_size}, hidden size {hidden}"
        # Said aloud when asked for by name, or when a build or setup failed (the speed-up lost for a reason
        # the user can act on); quietly where the kernel does not apply (the shape, FlashInfer not installed).
        loud = allreduce_mode_is_set() or (error is not None and not isinstance(error, ImportError))
        log.log(logging.WARNING if loud else logging.INFO, "tensor parallelism: no fused all-reduce + norm here (%s); "
                "the all-reduce and the norm stay separate, as with %s=one-shot", why, ENV)
        return None
    log.info("tensor parallelism on the CPU: all-reduces over gloo; each norm sums the ranks' partial results "
             "before it, then normalises (the fused all-reduce + norm kernel is GPU-only)")
    return AllReduceThenNorm()


def _build_kernels(first: bool) -> None:
    """FlashInfer's fused all-reduce kernels, built on their first use on
    this machine (minutes; the ranks share one build) and loaded."""
    from flashinfer.comm.trtllm_ar import get_trtllm_comm_module
    from flashinfer.jit.comm import gen_trtllm_comm_module

    from rollout_engine.progress import Ticking

    if not first or gen_trtllm_comm_module().is_compiled:
        get_trtllm_comm_module()  # loaded, or built while the first rank shows the time
        return
    log.warning("tensor parallelism: building FlashInfer's fused all-reduce + norm kernels (first use on this "
                "machine: 4 to 5 minutes; cached after). %s=one-shot skips them.", ENV)
    with Ticking(log, "building FlashInfer's fused all-reduce + norm kernels"):
        get_trtllm_comm_module()


def close_for(group) -> None:
    """Free the fused kernel's buffers set up for `group`, if any
    (`tp_group.leave`, after this rank's last step)."""
    fused = _OPEN.pop(id(group), None)
    if fused is not None:
        fused.close()
