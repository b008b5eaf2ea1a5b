"""Expert parallelism: bringing tokens to the ranks that hold their experts, and back.

With ``--enable-expert-parallel`` the ``ep_size = TP x DP`` ranks each hold
``num_experts / ep_size`` whole experts (``SparseMoeBlock``). Every rank must see every
token that may be routed to its experts:

- Within one engine core the TP ranks already hold the same tokens (attention ends in an
  all-reduce), so with DP = 1 nothing moves before the experts: each rank runs its own
  experts over all the tokens and the TP all-reduce sums the shares.
- With DP > 1 each engine core has its own tokens. Before each step every rank learns
  each engine's token count (``begin_step``, from the per-step agreement of
  ``services/gpu_worker/lockstep.py``); the MoE layer all-gathers the tokens over the
  ranks that share its TP rank (``dp_group``, padded to the longest engine's count), runs
  this rank's experts over all of them, then sums the shares back: a reduce-scatter over
  ``dp_group`` where the backend has one (NCCL), an all-reduce and a cut on gloo, and
  then the TP all-reduce. This is vLLM's all-gather / reduce-scatter ("naive") dispatch.

An engine core with no tokens of its own still calls each MoE layer (``dummy_forward``)
with zero rows: it contributes nothing and computes its experts for the others.

Every rank routes the same gathered tokens with the same router, so every rank knows the
whole step's routing; ``count`` adds it to the experts' load (``take_load``), which the
worker reports as a metric and a log line of the imbalance.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import torch
import torch.distributed as dist

from services.gpu_worker.distributed import ParallelState
from services.logging_utils import init_logger

logger = init_logger(__name__)


class MoeLayer(Protocol):
    """What the dispatch needs of a MoE layer (``moe.SparseMoeBlock``)."""

    def __call__(self, x: torch.Tensor) -> torch.Tensor: ...

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]: ...

    def experts(
        self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor
    ) -> torch.Tensor: ...


class ExpertDispatch:
    """The MoE layers' shared per-step state (one per model)."""

    def __init__(self, parallel: ParallelState, num_experts: int) -> None:
        self.parallel = parallel
        self.num_experts = num_experts
        # Tokens of each engine core in this step (engine order); set per step in lock-step.
        self.step_tokens: tuple[int, ...] = ()
        self._load: torch.Tensor | None = None  # routed (token, expert) pairs, per expert
        if parallel.ep_size > 1:
            per = num_experts // parallel.ep_size
            logger.info(
                "expert parallelism (EP %d = TP %d x DP %d): engine %d rank %d holds experts "
                "[%d, %d) of %d",
                parallel.ep_size, parallel.tp_size, parallel.ep_size // parallel.tp_size,
                parallel.dp_rank, parallel.tp_rank, parallel.ep_rank * per,
                (parallel.ep_rank + 1) * per, num_experts,
            )  # fmt: skip

    def begin_step(self, num_tokens: tuple[int, ...]) -> None:
        if len(num_tokens) != self.parallel.dp_size:
            raise ValueError(
                f"{len(num_tokens)} engine token counts for {self.parallel.dp_size} engines"
            )
        self.step_tokens = tuple(num_tokens)

    # ------------------------------------------------------------------ dispatch

    def run(self, x: torch.Tensor, block: MoeLayer) -> torch.Tensor:
        """``block``'s output for this engine's tokens ``x``, its experts spread over ranks."""
        p = self.parallel
        if p.all2all_backend == "all_to_all":
            return self._run_all_to_all(x, block)
        if p.dp_size == 1:
            weights, ids = block.route(x)
            return p.all_reduce(block.experts(x, weights, ids))
        counts = self.step_tokens
        if counts[p.dp_rank] != x.shape[0]:
            raise RuntimeError(
                f"engine {p.dp_rank} runs {x.shape[0]} tokens; the step's agreement said "
                f"{counts[p.dp_rank]}"
            )
        longest = max(counts)
        gathered = self._gather(x, longest)  # [dp, longest, H]
        tokens = torch.cat([gathered[d, :n] for d, n in enumerate(counts)])
        weights, ids = block.route(tokens)
        shares = block.experts(tokens, weights, ids)  # [sum(counts), H], this rank's experts
        mine = self._combine(shares, counts, longest)
        return p.all_reduce(mine)

    def _gather(self, x: torch.Tensor, longest: int) -> torch.Tensor:
        p = self.parallel
        padded = x.new_zeros(longest, x.shape[1])
        padded[: x.shape[0]] = x
        out = x.new_empty(p.dp_size, longest, x.shape[1])
        if _backend(p.dp_group) == "nccl":
            dist.all_gather_into_tensor(out, padded, group=p.dp_group)
        else:
            dist.all_gather(list(out.unbind(0)), padded, group=p.dp_group)
        return out

    def _combine(self, shares: torch.Tensor, counts: tuple[int, ...], longest: int) -> torch.Tensor:
        """This engine's rows of ``shares`` summed over ``dp_group``."""
        p = self.parallel
        start = sum(counts[: p.dp_rank])
        n = counts[p.dp_rank]
        if _backend(p.dp_group) == "nccl":
            padded = shares.new_zeros(p.dp_size, longest, shares.shape[1])
            offset = 0
            for d, c in enumerate(counts):
                padded[d, :c] = shares[offset : offset + c]
                offset += c
            out = shares.new_empty(longest, shares.shape[1])
            dist.reduce_scatter_tensor(out, padded.view(-1, shares.shape[1]), group=p.dp_group)
            return out[:n]
        dist.all_reduce(shares, group=p.dp_group)  # gloo has no reduce-scatter
        return shares[start : start + n]

    def _run_all_to_all(self, x: torch.Tensor, block: MoeLayer) -> torch.Tensor:
        """``--all2all-backend all_to_all``: each (token, expert) pair travels to the rank
        holding its expert and its result back (``all_to_all_single``, uneven splits; gloo
        and NCCL both have it), instead of every token to every engine. The TP ranks of an
        engine hold the same tokens: each sends a contiguous share, and an all-gather over
        the TP group puts the engine's rows back together."""
        p = self.parallel
        n, hidden = x.shape
        shares = torch.tensor_split(torch.arange(n, device=x.device), p.tp_size)
        rows = shares[p.tp_rank]
        mine = x[rows]
        weights, ids = block.route(mine)
        k = ids.shape[1]
        per_rank = self.num_experts // p.ep_size
        owner = (ids // per_rank).reshape(-1)
        order = torch.argsort(owner, stable=True)  # pairs grouped by the rank they go to
        send_counts = torch.bincount(owner, minlength=p.ep_size)
        recv_counts = torch.empty_like(send_counts)
        dist.all_to_all_single(recv_counts, send_counts, group=p.ep_group)
        send, recv = send_counts.tolist(), recv_counts.tolist()  # the one host sync
        pair_token = order // k
        sent_ids = ids.reshape(-1)[order]
        got_x = x.new_empty(sum(recv), hidden)
        dist.all_to_all_single(got_x, mine[pair_token].contiguous(), recv, send, group=p.ep_group)
        got_ids = sent_ids.new_empty(sum(recv))
        dist.all_to_all_single(got_ids, sent_ids.contiguous(), recv, send, group=p.ep_group)
        # Each received pair alone (top-1, weight 1): its expert's output for its token.
        ones = torch.ones(got_ids.shape[0], 1, dtype=torch.float32, device=x.device)
        done = block.experts(got_x, ones, got_ids[:, None]) if len(got_ids) else got_x
        back = x.new_empty(order.shape[0], hidden)
        dist.all_to_all_single(back, done, send, recv, group=p.ep_group)
        out = torch.zeros(mine.shape[0], hidden, dtype=torch.float32, device=x.device)
        weight = weights.reshape(-1)[order].float()[:, None]
        out.index_add_(0, pair_token, back.float() * weight)
        out = out.to(x.dtype)
        if p.tp_size == 1:
            return out
        return self._gather_tp(out, [len(r) for r in shares])

    def _gather_tp(self, part: torch.Tensor, sizes: list[int]) -> torch.Tensor:
        """The TP ranks' row shares (``sizes``, in rank order) concatenated."""
        p = self.parallel
        longest = max(sizes)
        padded = part.new_zeros(longest, part.shape[1])
        padded[: part.shape[0]] = part
        parts = [torch.empty_like(padded) for _ in range(p.tp_size)]
        dist.all_gather(parts, padded, group=p.group)
        return torch.cat([t[:n] for t, n in zip(parts, sizes, strict=True)])

    def dummy_forward(self, layers: Sequence[MoeLayer], hidden_size: int,
                      dtype: torch.dtype, device: torch.device) -> None:  # fmt: skip
        """Each MoE layer of ``layers`` with no tokens of this engine's own."""
        empty = torch.empty(0, hidden_size, dtype=dtype, device=device)
        for block in layers:
            block(empty)

    # ------------------------------------------------------------------ load

    def count(self, ids: torch.Tensor) -> None:
        """Add a layer's routing (``ids`` [T, k], global experts) to the load, on the device
        and without a sync (a CUDA graph may record it)."""
        flat = ids.reshape(-1)
        if self._load is None or self._load.device != flat.device:
            self._load = torch.zeros(self.num_experts, dtype=torch.int64, device=flat.device)
        self._load.scatter_add_(0, flat.to(torch.int64), torch.ones_like(flat, dtype=torch.int64))

    def take_load(self) -> list[int]:
        """Routed (token, expert) pairs per expert, over every MoE layer, since the last
        call (one host sync); zeros before any step."""
        if self._load is None:
            return [0] * self.num_experts
        with torch.inference_mode():  # the counts are an inference tensor
            load = self._load.tolist()
            self._load.zero_()
        return [int(v) for v in load]


def _backend(group: Any) -> str:
    return str(dist.get_backend(group)) if dist.is_initialized() else ""
