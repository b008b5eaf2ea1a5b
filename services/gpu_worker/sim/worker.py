"""``--worker-backend sim``: a worker rank without a forward pass.

Everything else stays real: the StepPlans come from the real scheduler over the real
sockets, and the tokens go back the same way. Each step sleeps for the time the
roofline model (``cost_model.py``) gives the simulated device for the plan's real shape
(prefill chunks and decodes, each over its real context), times ``--sim-speed``; no
weights are loaded and no KV cache is allocated, but the block pool has the size the
simulated device would give it.

The device keeps its own timeline: a step starts when its plan was sent (``sent_at``) or
when the previous step ends, whichever is later, and this process sleeps until the step's
end; ``device_seconds`` reports the busy time and the time the device waited for plans
(``actorserve:device_seconds_total``). A late wake-up of this process on a busy host is
made up in the next step rather than counted against the engine.

Only the output rank (TP rank 0 of the last stage) models the step: it alone returns
tokens, and it charges the time of every stage (ranks of a stage run in parallel; the
stages of one step run one after another: the simulation does not overlap a pipeline's
micro-batches). The other ranks only follow the plans.

Expert parallelism over data-parallel engines (``ParallelConfig.dp_lockstep``): before
each step the worker loop tells every rank each engine's token count
(``begin_dp_step``); the step then lasts what ``StepCostModel.step_cost`` gives for the
whole lock-step step (this engine's attention and dense part, or more if another
engine's count alone shows it is slower; the routed experts over every engine's tokens;
dispatch and combine), and an engine with no tokens of its own spends that time in
``execute_dummy``. Each engine knows only its own work exactly, so the slowest engine
computes the longest step, and the next agreement waits for it: the fleet's pace is the
slowest engine's. In lock-step the device's timeline starts each step at the agreement
(``begin_dp_step``), not when the plan was sent: the wait for the slowest engine is
counted as idle, never made up in the next step.

Tokens are a function of the request (its prompt, and its seed when it has one; an
unseeded request that samples also its id, as a real sampler would differ) and of the
output position, so a greedy or seeded request gives the same tokens every run, and
after a preemption. They avoid the EOS and stop tokens; ``--sim-eos DIST`` makes a
request end with EOS at an output length drawn from DIST (its own random stream).
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import random
import struct
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from services.config import EngineConfig
from services.flags import ConfigError
from services.gpu_worker.base import WorkerBackend
from services.gpu_worker.distributed import ParallelState
from services.gpu_worker.sim.cost_model import (
    RequestWork,
    SimHardware,
    StepCost,
    StepCostModel,
    sim_dtype,
)
from services.gpu_worker.sim.model_shape import load_sim_model
from services.model_loader import load_hf_config
from services.model_loader.sim_model import SIM_ARCHITECTURE_KEY
from services.protocol import KVLayout, NewRequest, StepPlan, StepResult, TokenLogprobs

logger = logging.getLogger(__name__)

_MASK = (1 << 64) - 1


def _mix(x: int) -> int:
    """splitmix64's finaliser: a well-spread 64-bit hash of ``x``."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK
    return x ^ (x >> 31)


def request_key(req: NewRequest) -> int:
    """What a request's tokens are a function of (see the module docstring)."""
    s = req.sampling
    h = hashlib.blake2b(digest_size=8)
    h.update(struct.pack(f"<{req.num_prompt_tokens}q", *req.token_ids[: req.num_prompt_tokens]))
    if s.seed is not None:
        h.update(b"seed" + struct.pack("<q", s.seed))
    elif not s.greedy:
        h.update(b"id" + req.req_id.encode())
    return int.from_bytes(h.digest(), "little")


class OutputLengths:
    """``--sim-eos DIST``: the output length at which a request samples EOS.

    DIST is ``fixed:N``, ``uniform:LO,HI``, ``exp:MEAN``, ``lognormal:MEDIAN,SIGMA`` or
    the path of a JSON list of lengths (drawn uniformly, e.g. a dataset's outputs)."""

    def __init__(self, spec: str) -> None:
        self.spec = spec
        kind, _, args = spec.partition(":")
        self._values: list[int] | None = None
        try:
            nums = [float(x) for x in args.split(",")] if args else []
            if kind == "fixed" and len(nums) == 1:
                self._draw = lambda rng: nums[0]
            elif kind == "uniform" and len(nums) == 2 and nums[0] <= nums[1]:
                self._draw = lambda rng: rng.randint(int(nums[0]), int(nums[1]))
            elif kind == "exp" and len(nums) == 1 and nums[0] > 0:
                self._draw = lambda rng: rng.expovariate(1 / nums[0])
            elif kind == "lognormal" and len(nums) == 2 and nums[0] > 0:
                self._draw = lambda rng: rng.lognormvariate(math.log(nums[0]), nums[1])
            elif Path(spec).is_file():
                values = [int(v) for v in json.loads(Path(spec).read_text())]
                if not values:
                    raise ValueError("the list is empty")
                self._draw = lambda rng: rng.choice(values)
            else:
                raise ValueError("unknown form")
        except ValueError as e:
            raise ConfigError(
                f"--sim-eos {spec!r}: {e}; give fixed:N, uniform:LO,HI, exp:MEAN, "
                "lognormal:MEDIAN,SIGMA or a JSON file of lengths"
            ) from None

    def sample(self, key: int) -> int:
        return max(1, round(self._draw(random.Random(key ^ 0x5EED))))


@dataclass
class _SimRequest:
    key: int
    num_tokens: int  # known: prompt and outputs so far
    num_prompt_tokens: int
    eos_at: int | None  # the output index that is EOS (None: never)
    eos_token_id: int | None
    avoid: frozenset[int]
    allowed: list[int] | None
    logprobs: int | None

    def token(self, index: int, low: int, high: int) -> int:
        """Output token ``index`` (0-based)."""
        if index == self.eos_at and self.eos_token_id is not None:
            return self.eos_token_id
        x = _mix(self.key ^ _mix(index))
        if self.allowed is not None:
            return self.allowed[x % len(self.allowed)]
        t = low + x % (high - low)
        while t in self.avoid:
            t = low + (t - low + 1) % (high - low)
        return t


def _grammar_rows(plan: StepPlan) -> dict[str, np.ndarray]:
    """Each constrained request's bitmask row of the plan (structured outputs)."""
    if not plan.grammar_req_ids:
        return {}
    rows = np.frombuffer(plan.grammar_bitmask, dtype=np.int32)
    rows = rows.reshape(len(plan.grammar_req_ids), -1)
    return dict(zip(plan.grammar_req_ids, rows, strict=True))


def _allowed_token(row: np.ndarray, token: int) -> int:
    """``token`` if the grammar allows it, else an allowed one that depends on it (as a real
    sampler under the mask would pick another)."""
    if token < 32 * len(row) and (int(row[token >> 5]) >> (token & 31)) & 1:
        return token
    allowed = np.flatnonzero(np.unpackbits(row.view(np.uint8), bitorder="little"))
    if len(allowed) == 0:
        return token
    return int(allowed[_mix(token) % len(allowed)])


class SimWorker(WorkerBackend):
    """A worker rank whose steps take the simulated device's modelled time."""

    uses_collectives = False

    def __init__(self, config: EngineConfig, folder: Path | None, parallel: ParallelState) -> None:
        if folder is None:
            raise ConfigError("--worker-backend sim needs a model folder (its config.json)")
        w = config.worker
        self.config = config
        self.parallel = parallel
        hf = load_hf_config(folder)
        self.arch, extras = load_sim_model(hf)
        self.architecture = str(hf.get(SIM_ARCHITECTURE_KEY, self.arch.architecture))
        self.hardware = SimHardware.load(w.sim_hardware)
        dtype = config.model.dtype
        if dtype == "auto":
            dtype = str(hf.get("torch_dtype", "bfloat16"))
        p = config.parallel
        stages = p.stage_layers(self.arch.num_hidden_layers)
        self.cost = StepCostModel(
            self.arch,
            self.hardware,
            sim_dtype(dtype),
            p.tensor_parallel_size,
            [end - start for start, end in stages],
            config.cache.kv_cache_dtype,
            expert_parallel_size=p.expert_parallel_size,
            data_parallel_size=p.data_parallel_size if p.dp_lockstep else 1,
            extras=extras,
        )
        self.speed = w.sim_speed
        self.lengths = OutputLengths(w.sim_eos) if w.sim_eos else None
        self.high = min(self.arch.vocab_size, 32_000)  # inside any tokenizer the model may use
        self.low = min(100, self.high // 2)  # past the special tokens at the start
        self.requests: dict[str, _SimRequest] = {}
        self.modelled_s = 0.0  # the device's busy time so far, in simulated seconds
        self.idle_s = 0.0  # its time waiting for a plan after the first, simulated seconds
        self.last_step_s = 0.0  # the modelled time of the last step (or dummy step)
        self.last_cost = StepCost()  # ... by part
        self._free_at: float | None = None  # (time.monotonic) when it ends its last step
        # Lock-step (begin_dp_step): each engine's tokens this step, and when the ranks
        # agreed on it (time.monotonic): the step starts then.
        self._dp_tokens: tuple[int, ...] | None = None
        self._agreed_at = 0.0

    def determine_num_blocks(self) -> int:
        """What ``--gpu-memory-utilization`` of the simulated memory holds after the
        weights and a forward's activations (``--num-gpu-blocks-override`` wins)."""
        cache = self.config.cache
        if cache.num_gpu_blocks_override is not None:
            return cache.num_gpu_blocks_override
        stage = self.parallel.pp_rank
        weights = self.cost.weight_bytes(stage)
        if cache.kv_cache_memory_bytes is not None:
            budget = float(cache.kv_cache_memory_bytes)
        else:
            a, tp = self.arch, self.parallel.tp_size
            tokens = self.config.scheduler.token_budget
            activations = tokens * (4 * a.hidden_size + 3 * a.intermediate_size // tp)
            budget = (
                self.hardware.memory_capacity * cache.gpu_memory_utilization
                - weights
                - activations * self.cost.bytes
            )
        block = cache.block_size * self.cost.kv_bytes_per_token(stage)
        if budget < block:
            raise ConfigError(
                f"the simulated model's weights ({weights / 1e9:.1f} GB per rank) leave no "
                f"room for a KV cache block in {self.hardware.name}'s "
                f"{self.hardware.memory_capacity / 1e9:.0f} GB at --gpu-memory-utilization "
                f"{cache.gpu_memory_utilization}; use more ranks (-tp/-pp) or a larger device"
            )
        return int(budget // block)

    def initialize_kv_cache(self, num_blocks: int) -> None:
        logger.info(
            "sim: %s on %s x%d (EP %d over %d engines), %d KV blocks (nothing allocated), "
            "--sim-speed %g",
            self.architecture,
            self.hardware.name,
            self.parallel.world_size,
            self.cost.ep,
            self.cost.dp,
            num_blocks,
            self.speed,
        )

    # ---- steps

    def _add(self, req: NewRequest) -> _SimRequest:
        s = req.sampling
        key = request_key(req)
        eos_at = None
        if self.lengths is not None and not s.ignore_eos and req.eos_token_id is not None:
            eos_at = max(self.lengths.sample(key), s.min_tokens + 1) - 1
        sim = _SimRequest(
            key=key,
            num_tokens=len(req.token_ids),
            num_prompt_tokens=req.num_prompt_tokens,
            eos_at=eos_at,
            eos_token_id=req.eos_token_id,
            avoid=frozenset(
                [*s.stop_token_ids, *([req.eos_token_id] if req.eos_token_id is not None else [])]
            ),
            allowed=s.allowed_token_ids,
            logprobs=s.logprobs,
        )
        self.requests[req.req_id] = sim
        return sim

    def execute(self, plan: StepPlan) -> StepResult:
        arrived = time.monotonic()
        for req_id in plan.finished_req_ids:
            self.requests.pop(req_id, None)
        if not self.parallel.is_output_rank:
            return StepResult(plan.step_id)
        work: list[RequestWork] = []
        result = StepResult(plan.step_id)
        entries = [(r.req_id, r.num_computed_tokens, r) for r in plan.new_requests] + [
            (r.req_id, r.num_computed_tokens, None) for r in plan.running
        ]
        grammar = _grammar_rows(plan)
        for (req_id, computed, new), n in zip(entries, plan.num_scheduled_tokens, strict=True):
            sim = self._add(new) if new is not None else self.requests[req_id]
            samples = computed + n >= sim.num_tokens
            work.append(RequestWork(n, computed, samples))
            if not samples:
                continue
            token = sim.token(sim.num_tokens - sim.num_prompt_tokens, self.low, self.high)
            if (row := grammar.get(req_id)) is not None:
                token = _allowed_token(row, token)
            sim.num_tokens += 1
            result.req_ids.append(req_id)
            result.sampled_token_ids.append(token)
            result.logprobs.append(None if sim.logprobs is None else TokenLogprobs(token, 0.0, 1))
        if all(lp is None for lp in result.logprobs):
            result.logprobs = []  # none asked: nothing on the wire
        tokens = self._dp_tokens
        if tokens is None:
            self._advance(self.cost.step_cost(work), plan.sent_at or arrived)
        elif plan.total_num_scheduled_tokens or not any(tokens):
            cost = self.cost.step_cost(work, tokens, self.parallel.dp_rank)
            self._advance(cost, self._agreed_at)
        else:  # an empty plan in a step the others run: execute_dummy takes the step
            self._advance(StepCost(), self._agreed_at)
        return result

    def begin_dp_step(self, num_tokens: tuple[int, ...]) -> None:
        if len(num_tokens) != self.cost.dp or self.parallel.dp_rank >= len(num_tokens):
            raise ValueError(
                f"lock-step token counts {num_tokens} for {self.cost.dp} engines, "
                f"this one {self.parallel.dp_rank}"
            )
        self._dp_tokens = tuple(num_tokens)
        self._agreed_at = time.monotonic()

    def execute_dummy(self) -> None:
        """The lock-step step's MoE layers with none of this engine's tokens: the device
        is busy as long as the engines that have some."""
        tokens = self._dp_tokens
        if not self.parallel.is_output_rank or not tokens or not any(tokens):
            return  # nobody has tokens: no step
        self._advance(self.cost.step_cost([], tokens, self.parallel.dp_rank), self._agreed_at)

    def _advance(self, cost: StepCost, start: float) -> None:
        """Run the device for ``cost.total`` simulated seconds from ``start`` (monotonic).

        The device's timeline: it starts the step when the plan was sent (in lock-step:
        when the ranks agreed on the step), or when it ends the previous step if that is
        later. A late wake-up of this process (a busy host) is made up in the next step,
        as a device that never waited would."""
        modelled = cost.total
        self.last_cost = cost
        self.last_step_s = modelled
        self.modelled_s += modelled
        if self._free_at is not None:
            self.idle_s += max(0.0, start - self._free_at) / self.speed
            start = max(start, self._free_at)
        self._free_at = start + modelled * self.speed
        remaining = self._free_at - time.monotonic()
        if remaining > 0:
            time.sleep(remaining)

    def kv_caches_for_transfer(self) -> tuple[list[Any], KVLayout]:
        """No tensors; the layout a real rank would have (what a transfer would move)."""
        a, stage = self.arch, self.parallel.pp_rank
        # MLA's one latent row a token, as a K and a V half of one head each
        head_dim = a.head_dim if self.cost.mla is None else self.cost.mla.cache_dim // 2
        layout = KVLayout(
            num_layers=self.cost.stage_layers[stage],
            block_size=self.config.cache.block_size,
            num_kv_heads=self.cost.kv_heads,
            head_dim=head_dim,
            dtype=f"sim-{self.cost.dtype}-kv-{self.cost.kv_cache_dtype}",
        )
        return [], layout

    def simulated_kv_link(self) -> tuple[float, float, float]:
        hw = self.hardware
        return hw.interconnect_bandwidth, hw.interconnect_latency_s, self.speed

    def device_seconds(self) -> tuple[float, float]:
        return self.modelled_s, self.idle_s
