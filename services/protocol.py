"""Every message that crosses a process boundary, as msgspec Structs.

Messages are data: no behaviour beyond validation of user-supplied sampling
parameters. Structs are encoded ``array_like`` (positional arrays, no field
names on the wire) and ``omit_defaults``. Where one socket carries several
kinds of message, the kinds form a tagged union (``tag=True``).

The scheduler -> worker traffic follows vLLM v1's SchedulerOutput: a request's
prompt and sampling parameters travel once (``NewRequest``); later steps carry
only deltas (new block ids, scheduled token counts, finished ids). Workers keep
a persistent batch keyed by request id.

It stays whole because it is the wire format: every message on every socket in one
module, so a reader sees all traffic between the processes in one place (vLLM keeps its
engine messages together the same way) and no process imports another's code to talk to it.
"""

from __future__ import annotations

import math

import msgspec

_STRUCT = {"array_like": True, "omit_defaults": True}


DEFAULT_MAX_LOGPROBS = 20  # vLLM's --max-logprobs default


class InvalidParam(ValueError):
    """A bad request parameter whose message does not start with its name."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


class StructuredOutputsParams(msgspec.Struct, **_STRUCT):
    """vLLM's ``structured_outputs`` request field: exactly one constraint on the output.

    ``json`` is a JSON schema as JSON text; ``choice`` the strings one of which is the whole
    output; ``grammar`` EBNF (xgrammar's GBNF dialect); ``structural_tag`` xgrammar's
    structural tag, as JSON text. ``disable_any_whitespace``: JSON in one layout (``", "`` and
    ``": "`` between items, no newlines), not any whitespace the model likes (also the
    server's ``--structured-outputs-config`` setting). ``unbounded_json``: none of the
    bounds on whitespace runs and number digits that JSON constraints get by default
    (vLLM's behaviour; ``services/structured_output/json_bounds.py``);
    ``json_max_string_length``: a bound on the strings the schema leaves unbounded.
    """

    json: str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: str | None = None
    disable_any_whitespace: bool = False
    unbounded_json: bool = False
    json_max_string_length: int | None = None

    def kinds(self) -> list[str]:
        """The constraint kinds that are set (valid params set exactly one)."""
        return [
            k
            for k in ("json", "regex", "choice", "grammar", "json_object", "structural_tag")
            if getattr(self, k) is not None  # vLLM's count: json_object false is one too
        ]

    def validate(self) -> None:
        kinds = self.kinds()
        if len(kinds) > 1:
            raise InvalidParam(
                "You can only use one kind of structured outputs constraint but multiple are "
                f"specified: {', '.join(kinds)}",
                "structured_outputs",
            )
        if not kinds or (kinds == ["json_object"] and not self.json_object):
            raise InvalidParam(
                "You must use one kind of structured outputs constraint but none are specified",
                "structured_outputs",
            )
        if self.choice is not None and not self.choice:
            raise InvalidParam("Choice '[]' cannot be an empty list", "structured_outputs")
        if self.json_max_string_length is not None and self.json_max_string_length < 1:
            raise InvalidParam("json_max_string_length must be at least 1", "structured_outputs")


class ReasoningParams(msgspec.Struct, **_STRUCT):
    """A chat answer's thinking (``--reasoning-parser``), set by the tokenizer from the
    rendered prompt: the markers around the thinking, and ``phase``, where the output
    starts: "thinking" (the prompt opened it, or the model always thinks) or "opening"
    (the model opens it with ``start``, or answers at once). A prompt that closed the
    thinking (``enable_thinking: false``) gets no ReasoningParams: all of it is answer."""

    start: str
    end: str
    phase: str = "thinking"


class SamplingParams(msgspec.Struct, **_STRUCT):
    """How to sample one request's output, with vLLM's names and defaults.

    ``validate()`` raises ``ValueError`` with a user-facing message naming the
    bad parameter; the api_server turns that into an OpenAI 400 error.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: list[str] = []
    stop_token_ids: list[int] = []
    ignore_eos: bool = False
    logprobs: int | None = None  # number of top alternatives; 0 = only the sampled token
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    logit_bias: dict[int, float] = {}  # token id -> added to its logit, in [-100, 100]
    allowed_token_ids: list[int] | None = None  # only these may be sampled
    bad_words: list[str] = []  # never generated (as token sequences, after the tokenizer)
    bad_words_token_ids: list[list[int]] = []  # filled in by the tokenizer from bad_words
    # One constraint on the output (the scheduler compiles it; workers never see it)
    structured_outputs: StructuredOutputsParams | None = None
    # Thinking to split from the answer (the tokenizer sets it; services/structured_output/
    # reasoning.py): the detokenizer splits the text, the scheduler holds a constraint back
    reasoning: ReasoningParams | None = None

    def validate(self, max_logprobs: int = DEFAULT_MAX_LOGPROBS) -> None:
        """ValueError("<param> <why>") for the first bad parameter; ``max_logprobs`` is
        ``--max-logprobs`` (-1: no bound here; the tokenizer holds it to the vocabulary)."""

        def bad(param: str, why: str) -> ValueError:
            return ValueError(f"{param} {why}")

        if self.n < 1:
            raise bad("n", f"must be at least 1, got {self.n}.")
        if not math.isfinite(self.temperature) or self.temperature < 0.0:
            raise bad("temperature", f"must be non-negative, got {self.temperature}.")
        if not (0.0 < self.top_p <= 1.0):
            raise bad("top_p", f"must be in (0, 1], got {self.top_p}.")
        if self.top_k < -1:
            raise bad(
                "top_k", f"must be -1 (disable), 0 (disable) or at least 1, got {self.top_k}."
            )
        if not (0.0 <= self.min_p <= 1.0):
            raise bad("min_p", f"must be in [0, 1], got {self.min_p}.")
        if not (-2.0 <= self.presence_penalty <= 2.0):
            raise bad("presence_penalty", f"must be in [-2, 2], got {self.presence_penalty}.")
        if not (-2.0 <= self.frequency_penalty <= 2.0):
            raise bad("frequency_penalty", f"must be in [-2, 2], got {self.frequency_penalty}.")
        if not (0.0 < self.repetition_penalty <= 2.0):
            raise bad("repetition_penalty", f"must be in (0, 2], got {self.repetition_penalty}.")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise bad("max_tokens", f"must be at least 1, got {self.max_tokens}.")
        if self.min_tokens < 0:
            raise bad("min_tokens", f"must be non-negative, got {self.min_tokens}.")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise bad(
                "min_tokens",
                f"must be less than or equal to max_tokens={self.max_tokens}, got {self.min_tokens}.",
            )
        for param in ("logprobs", "prompt_logprobs"):
            value = getattr(self, param)
            if value is not None and value < 0:
                raise bad(param, f"must be non-negative, got {value}.")
            if value is not None and 0 <= max_logprobs < value:
                raise bad(param, f"must be in [0, {max_logprobs}], got {value}.")
        if any(s == "" for s in self.stop):
            raise bad("stop", "must not contain empty strings.")
        if self.allowed_token_ids is not None and not self.allowed_token_ids:
            raise bad("allowed_token_ids", "must not be empty.")
        if any(not math.isfinite(b) for b in self.logit_bias.values()):
            raise bad("logit_bias", "values must be finite numbers.")
        if self.structured_outputs is not None:
            self.structured_outputs.validate()

    def out_of_vocab_token(self, vocab_size: int) -> tuple[str, int] | None:
        """The first token id (and its parameter) that names no token of the vocabulary."""
        for param, ids in (
            ("logit_bias", self.logit_bias),
            ("allowed_token_ids", self.allowed_token_ids or ()),
        ):
            bad_id = next((t for t in ids if not 0 <= t < vocab_size), None)
            if bad_id is not None:
                return param, bad_id
        return None

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5 or self.top_k == 1


POOLING_TYPES = ("LAST", "MEAN", "CLS")  # vLLM's sequence pooling types


class PoolingParams(msgspec.Struct, **_STRUCT):
    """An embedding request's pooling, resolved from ``--pooler-config`` and the request.

    The request computes its prompt once (prefill only) and returns one vector: the final
    norm's hidden state of its last token (``LAST``), of its first (``CLS``) or the mean over
    every prompt token (``MEAN``); cut to its first ``dimensions`` entries (matryoshka), then
    L2-normalised if ``normalize``. ``truncate_prompt_tokens`` keeps the prompt's last N
    tokens (the tokenizer applies it; vLLM's rule).
    """

    pooling_type: str = "LAST"
    normalize: bool = True
    dimensions: int | None = None
    truncate_prompt_tokens: int | None = None


def choice_params(sampling: SamplingParams, index: int) -> SamplingParams:
    """The parameters of choice ``index`` of an ``n``-choice request: one sequence each,
    and with a seed, choice i uses seed + i (as vLLM), so choices differ but repeat."""
    seed = None if sampling.seed is None else sampling.seed + index
    return msgspec.structs.replace(sampling, n=1, seed=seed)


# ---------------------------------------------------------------- scheduler -> worker


class NewRequest(msgspec.Struct, **_STRUCT):
    """A request the worker has not seen, or one resumed after preemption.

    ``token_ids`` holds every known token (prompt, then outputs generated so
    far when resumed); ``num_computed_tokens`` of them are already in the KV
    cache (prefix-cache hit). ``block_ids`` is the whole block table.
    """

    req_id: str
    token_ids: list[int]
    num_prompt_tokens: int
    sampling: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int
    eos_token_id: int | None = None
    pooling: PoolingParams | None = None  # an embedding: pooled once its prompt is computed


class RunningRequestDelta(msgspec.Struct, **_STRUCT):
    """A request the worker already holds: blocks appended since the last step.

    With pipeline parallelism ``new_token_ids`` are the tokens sampled since the request
    was last scheduled (only the last stage samples; the others learn them here);
    empty, and off the wire, otherwise.
    """

    req_id: str
    new_block_ids: list[int]
    num_computed_tokens: int
    new_token_ids: list[int] = []


class StepPlan(msgspec.Struct, **_STRUCT):
    """One engine step: what every worker rank runs.

    ``num_scheduled_tokens[i]`` tokens are computed for the i-th request of
    ``new_requests + running`` (in that order), starting at its
    ``num_computed_tokens``. A request samples a token this step when its
    scheduled tokens reach the end of its known tokens (a partial prefill
    chunk samples nothing). ``finished_req_ids`` (finished, aborted or
    preempted since the last step) are dropped from the persistent batch
    before this step runs.
    """

    step_id: int
    new_requests: list[NewRequest] = []
    running: list[RunningRequestDelta] = []
    num_scheduled_tokens: list[int] = []
    finished_req_ids: list[str] = []
    # The KV connector's per-step metadata (--kv-transfer-config), encoded by the connector
    # (services/kv_transfer/): what to hold for a pull, what to load. Empty without one.
    kv_connector_metadata: bytes = b""
    # time.monotonic() when the executor sent it (0: not stamped): the simulated backend's
    # device starts the step then, or when it finishes the previous one if that is later.
    sent_at: float = 0.0
    # Structured outputs: the requests of this step that sample under a grammar, and the
    # tokens each may sample, one bitmask row per request in that order (int32 words, bit
    # t % 32 of word t // 32 set when token t is allowed; services/structured_output).
    grammar_req_ids: list[str] = []
    grammar_bitmask: bytes = b""

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(self.num_scheduled_tokens)

    @property
    def is_empty(self) -> bool:
        return not self.num_scheduled_tokens


class TokenLogprobs(msgspec.Struct, **_STRUCT):
    """Log-probability of the sampled token and of the top-N alternatives."""

    token_id: int
    logprob: float
    rank: int
    top_token_ids: list[int] = []
    top_logprobs: list[float] = []


class PromptLogprobs(msgspec.Struct, **_STRUCT):
    """Log-probabilities of one request's prompt tokens ``start .. start + len(items) - 1``,
    each given the tokens before it (vLLM's ``prompt_logprobs``); one prefill chunk's worth.

    Prompt token 0 has no logprob, so ``start`` >= 1.
    """

    req_id: str
    start: int
    items: list[TokenLogprobs]


class PooledOutput(msgspec.Struct, **_STRUCT):
    """A pooling request's vector, computed in the step that ended its prompt: float32
    little-endian bytes (raw, not a list of floats: 4 bytes an entry on the wire)."""

    req_id: str
    data: bytes


class StepResult(msgspec.Struct, **_STRUCT):
    """What rank 0 returns for a StepPlan: one sampled token per sampling request.

    ``logprobs[i]`` is set only for requests that asked for logprobs;
    ``prompt_logprobs`` has an entry for each request that asked for prompt
    logprobs and computed prompt tokens this step; ``pooled`` one per pooling
    request whose prompt ended this step (those sample nothing).
    """

    step_id: int
    req_ids: list[str] = []
    sampled_token_ids: list[int] = []
    logprobs: list[TokenLogprobs | None] = []
    prompt_logprobs: list[PromptLogprobs] = []
    pooled: list[PooledOutput] = []


# ---------------------------------------------------------------- scheduler -> detokenizer


class RequestTokens(msgspec.Struct, **_STRUCT):
    """New output tokens of one request since the last step, and whether it finished.

    ``finish_reason`` is one of "stop", "length", "abort", "error" once finished;
    ``stop_reason`` is the stop token id that ended it (None for EOS or length).
    ``num_cached_tokens`` is the prompt tokens taken from the prefix cache.
    ``prompt_logprobs`` (prompt tokens 1 onwards) comes once, with the first output token.
    """

    req_id: str
    new_token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    logprobs: list[TokenLogprobs] = []
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    prompt_logprobs: list[TokenLogprobs] = []
    kv_transfer_params: dict[str, object] | None = None  # with the finish: where its KV waits
    # With finish_reason "error" when the request itself was at fault (its grammar): why,
    # for the client (a 400); None for the engine's own failures (a 500)
    error: str | None = None
    pooled: bytes = b""  # a pooling request's vector (PooledOutput.data), with its finish


class TokenBatch(msgspec.Struct, **_STRUCT):
    """Everything one engine step produced, for the detokenizer."""

    items: list[RequestTokens] = []


# ---- serve path: api_server <-> tokenizer -> scheduler -> detokenizer -> api_server
#
# Sockets and what they carry (each union member is tagged with its class name):
#   api_server  -PUSH TokenizerInput->     tokenizer (xN, round robin)
#   tokenizer   -PUSH EngineCoreInput->    scheduler      (TokenizedBatch: a group's requests)
#   api_server  -PUSH EngineCoreInput->    scheduler      (Abort)
#   detokenizer -PUSH EngineCoreInput->    scheduler      (FinishRequest)
#   tokenizer   -PUSH RequestOutputSpec->  detokenizer    (sent before the TokenizedBatch)
#   scheduler   -PUSH TokenBatch->         detokenizer
#   tokenizer, detokenizer -PUSH ApiServerInput-> api_server
#   launcher    -PUSH ApiServerInput->     api_server     (EngineDead, EngineRestarted)
#
# The scheduler's side of the contract: for every TokenizedRequest it accepts it
# sends exactly one RequestTokens with finish_reason set (aborted and
# FinishRequest'ed requests included: finish_reason "abort"), so the detokenizer
# can free its state; it ignores Abort / FinishRequest for ids it does not hold.

_TAGGED = {**_STRUCT, "tag": True}


class GenerateRequest(msgspec.Struct, **_STRUCT):
    """A completion or chat request, validated by the api_server, not yet tokenized.

    Exactly one of ``prompt``, ``prompt_token_ids`` and ``messages`` is set.
    ``sampling.max_tokens`` None means "up to max_model_len"; the tokenizer fills
    it in. With ``echo`` the detokenizer returns the prompt text in the first delta.
    """

    req_id: str
    sampling: SamplingParams
    prompt: str | None = None
    prompt_token_ids: list[int] | None = None
    messages: list[dict[str, object]] | None = None
    chat_template: str | None = None
    chat_template_kwargs: dict[str, object] = {}
    add_generation_prompt: bool = True
    add_special_tokens: bool = True
    arrival_time: float = 0.0
    priority: int = 0
    cache_salt: str | None = None
    echo: bool = False
    return_token_ids: bool = False  # the prompt's token ids come back with the first delta
    kv_transfer_params: dict[str, object] | None = None  # PD disaggregation (vLLM's field)
    data_parallel_rank: int | None = (
        None  # X-data-parallel-rank: this engine core, not the balancer's
    )
    pooling: PoolingParams | None = None  # /v1/embeddings, /pooling: a vector, no tokens


class TokenizeRequest(msgspec.Struct, **_TAGGED):
    """``POST /tokenize``: a prompt or chat messages to turn into token ids."""

    req_id: str
    prompt: str | None = None
    messages: list[dict[str, object]] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, object] = {}
    return_token_strs: bool = False


class DetokenizeRequest(msgspec.Struct, **_TAGGED):
    """``POST /detokenize``: token ids to turn into text."""

    req_id: str
    token_ids: list[int]


class GenerateBatch(msgspec.Struct, **_TAGGED):
    """The engine requests of one HTTP request (its prompts × n), checked together by one
    tokenizer: all go on to the scheduler, or none does and the api_server gets the error
    (so a streamed answer never starts with one prompt accepted and another refused)."""

    requests: list[GenerateRequest]


TokenizerInput = GenerateBatch | TokenizeRequest | DetokenizeRequest


class TokenizedRequest(msgspec.Struct, **_TAGGED):
    """A request ready for the scheduler: prompt tokens within max_model_len, max_tokens set."""

    req_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    arrival_time: float = 0.0
    priority: int = 0
    cache_salt: str | None = None
    eos_token_id: int | None = None
    kv_transfer_params: dict[str, object] | None = None
    pooling: PoolingParams | None = None


class TokenizedBatch(msgspec.Struct, **_TAGGED):
    """The requests of one ``GenerateBatch`` bound for one engine, in one message: the
    scheduler adds them all before its next step, so a group's prompts and ``n`` choices
    share their steps from the first one on (as the offline ``LLM``'s do), and seeded
    choices come out the same run after run."""

    requests: list[TokenizedRequest]


class Abort(msgspec.Struct, **_TAGGED):
    """Stop these requests now (client gone, or the server is shutting down)."""

    req_ids: list[str]


class FinishRequest(msgspec.Struct, **_TAGGED):
    """The detokenizer matched a stop string: finish the request and free its blocks."""

    req_id: str
    finish_reason: str = "stop"
    stop_reason: str | None = None


class KVTransferDone(msgspec.Struct, **_TAGGED):
    """From one worker rank's KV connector: transfers that ended since its last report.

    ``finished_sending``: requests whose blocks this rank no longer serves (pulled and
    acknowledged, released, or their lease lapsed); ``finished_recving``: requests whose
    KV this rank loaded; ``failed_recving``: loads that failed (the request recomputes).
    The scheduler acts on a request once every rank has reported it.
    """

    rank: int
    finished_sending: list[str] = []
    finished_recving: list[str] = []
    failed_recving: list[str] = []
    num_bytes: int = 0  # moved by the loads reported here
    seconds: float = 0.0  # their time, summed
    num_expired: int = 0  # of finished_sending: holds whose lease lapsed with no pull
    connector: int = 0  # which of ``multi``'s connectors reports (0 for a lone one)


EngineCoreInput = TokenizedRequest | TokenizedBatch | Abort | FinishRequest | KVTransferDone


class RequestOutputSpec(msgspec.Struct, **_STRUCT):
    """How the detokenizer renders one request's output (sent by the tokenizer).

    ``prompt_tail_ids`` are the last prompt tokens, decoding context for the
    first output token; ``prompt_text`` is set only when the client asked for echo;
    ``first_prompt_token_id`` only when it asked for prompt logprobs.
    """

    req_id: str
    sampling: SamplingParams
    num_prompt_tokens: int
    prompt_tail_ids: list[int] = []
    prompt_text: str | None = None
    first_prompt_token_id: int | None = None
    prompt_token_ids: list[int] | None = None  # only when the client asked for token ids


class DecodedLogprob(msgspec.Struct, **_STRUCT):
    """One output token's log-probability and its top alternatives, with their text."""

    token_id: int
    token: str
    logprob: float
    rank: int = 1
    top_token_ids: list[int] = []
    top_tokens: list[str] = []
    top_logprobs: list[float] = []


class DecodedPromptLogprobs(msgspec.Struct, **_STRUCT):
    """The prompt's tokens with their log-probabilities; the first token has none."""

    first_token_id: int
    first_token: str
    items: list[DecodedLogprob] = []  # prompt tokens 1 onwards


class TextDelta(msgspec.Struct, **_STRUCT):
    """New output text of one request; the last delta of a request has ``finish_reason``.

    ``finish_reason`` is "stop", "length", "abort" or "error"; ``stop_reason`` is
    the stop string or stop token id that ended it (None for EOS or length).
    Counts are the engine's: usage is reported from them, never re-tokenized.
    """

    req_id: str
    text: str
    token_ids: list[int] = []
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    logprobs: list[DecodedLogprob] = []
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    num_output_tokens: int = 0
    prompt_text: str | None = None
    prompt_logprobs: DecodedPromptLogprobs | None = None  # on the first delta with tokens
    prompt_token_ids: list[int] | None = None  # on the first delta, with return_token_ids
    kv_transfer_params: dict[str, object] | None = None  # on the last delta, when held for PD
    error: str | None = None  # RequestTokens.error, with finish_reason "error"
    reasoning: str = ""  # new thinking text (--reasoning-parser); ``text`` is the answer's
    num_reasoning_tokens: int = 0  # of num_output_tokens, those of the thinking
    pooled: bytes = b""  # RequestTokens.pooled, passed through undecoded


class TextDeltaBatch(msgspec.Struct, **_TAGGED):
    items: list[TextDelta] = []


class RequestError(msgspec.Struct, **_TAGGED):
    """A request rejected after the api_server accepted it; becomes an OpenAI error."""

    req_id: str
    status: int
    message: str
    error_type: str = "BadRequestError"  # OpenAI's error "type"
    param: str | None = None


class TokenizeResult(msgspec.Struct, **_TAGGED):
    req_id: str
    token_ids: list[int]
    max_model_len: int
    token_strs: list[str] | None = None


class DetokenizeResult(msgspec.Struct, **_TAGGED):
    req_id: str
    text: str


class EngineDead(msgspec.Struct, **_TAGGED):
    """From the launcher: an engine process died; fail live requests, answer 503 from now on.
    ``restarting`` (``--restart-on-failure``): a new engine is on its way, and requests that
    were still waiting may be kept for it (``--retry-waiting-on-restart``)."""

    reason: str
    restarting: bool = False


class EngineRestarted(msgspec.Struct, **_TAGGED):
    """From the launcher: the new engine group is up; serve again, resend kept requests."""

    recovery_s: float  # from the death seen to every new process ready


ApiServerInput = (
    TextDeltaBatch | RequestError | TokenizeResult | DetokenizeResult | EngineDead | EngineRestarted
)


# ---- KV events: scheduler -PUB KVEventBatch-> router (prefix_precise)
#
# vLLM's wire format (vllm/distributed/kv_events.py): the prefix cache reports blocks it
# stores and evicts, so a router can tell which replica holds which prefix. Each batch
# leaves as a ZMQ multipart message (topic, 8-byte big-endian sequence number, msgpack
# KVEventBatch); services/kv_cache/events.py publishes and replays them. Every field is
# encoded (no omit_defaults) in vLLM's order, events tagged by class name, so decoders
# built on vLLM's array-like structs (vLLM's own subscriber, llm-d, Dynamo) read ours.
# Block hashes are computed in services/kv_cache/block_hash.py: bytes for sha256 /
# sha256_cbor, int for builtin.
BlockHash = bytes | int

_KV_EVENT = {"array_like": True, "tag": True}
MEDIUM_GPU = "GPU"  # vLLM's name for the engine's own KV pool, whatever the device


class BlockStored(msgspec.Struct, **_KV_EVENT):
    """Consecutive full blocks entered the prefix cache; the first one's parent is given."""

    block_hashes: list[bytes | int]
    parent_block_hash: bytes | int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = MEDIUM_GPU
    lora_name: str | None = None


class BlockRemoved(msgspec.Struct, **_KV_EVENT):
    """Blocks left the prefix cache (evicted to make room)."""

    block_hashes: list[bytes | int]
    medium: str | None = MEDIUM_GPU


class AllBlocksCleared(msgspec.Struct, **_KV_EVENT):
    """The whole prefix cache was reset."""


KVCacheEvent = BlockStored | BlockRemoved | AllBlocksCleared


class KVEventBatch(msgspec.Struct, array_like=True):
    """The KV events of one engine step, in order (its sequence number travels beside it)."""

    ts: float
    events: list[KVCacheEvent]
    data_parallel_rank: int | None = None


# ---- data parallelism: scheduler (each engine core) -PUB EngineState-> tokenizers


class EngineState(msgspec.Struct, **_STRUCT):
    """What an engine core tells the tokenizers after a step that changed it: its load,
    and the blocks that entered or left its prefix cache (for prefix affinity)."""

    dp_rank: int
    num_waiting: int
    num_running: int
    kv_cache_usage: float
    events: list[KVCacheEvent] = []


# ---- launcher: every child -PUSH Ready-> launcher (control socket)


class Ready(msgspec.Struct, **_STRUCT):
    """A child process is up and bound; a worker also reports its rank and the KV blocks
    it can hold."""

    role: str
    pid: int
    num_blocks: int = 0
    rank: int = 0
    engine: int = 0  # the data-parallel engine core a worker or scheduler belongs to
    kv_events: str = ""  # a scheduler's KV event PUB and replay addresses, as bound
    kv_events_replay: str = ""
    kv_block_bytes: int = 0  # a worker's bytes per KV block (its shard)


# ---- engine nodes (--headless with --data-parallel-size-local): the node's launcher
#   -PUSH EngineNodeMessage-> node 0's launcher (TCP, --data-parallel-rpc-port)


class EngineNodeHello(msgspec.Struct, **_TAGGED):
    """An engine node (``node``: a random id per start) is starting these engine cores;
    each binds its input and state sockets at these addresses on that machine."""

    node: str
    engine_cores: dict[int, str]
    engine_states: dict[int, str]


class EngineNodeStatus(msgspec.Struct, **_TAGGED):
    """Every second: whether the node's engine cores are all READY, and its processes'
    Prometheus text (node 0's ``/metrics`` includes it). Also the node's heartbeat."""

    node: str
    engines: list[int]
    ready: bool
    metrics: str = ""


class EngineNodeDown(msgspec.Struct, **_TAGGED):
    """A process of the engine node died; the node is stopping."""

    node: str
    engines: list[int]
    reason: str


EngineNodeMessage = EngineNodeHello | EngineNodeStatus | EngineNodeDown


# ---- KV transfer, p2p connector (services/kv_transfer/p2p/, side_channel.py)
#   scheduler -StepPlan.kv_connector_metadata (P2PMetadata)-> its worker ranks
#   decode worker rank r -DEALER KVSideChannelInput-> prefill worker rank r (ROUTER, side channel)
#   prefill rank r -> decode rank r: KVPullLayer + 2 raw frames (K, V) per layer it covers, or
#   KVPullRefused
#   decode scheduler -DEALER KVRenew-> every prefill rank, while its request is queued


class P2PHold(msgspec.Struct, **_STRUCT):
    """Prefill side: serve these blocks to one pull until released or ``lease_s`` without
    a renewal passes."""

    req_id: str
    block_ids: list[int]
    generations: list[int]
    lease_s: float


class P2PLoad(msgspec.Struct, **_STRUCT):
    """Decode side: pull ``remote_block_ids`` of ``remote_request_id`` into ``block_ids``."""

    req_id: str
    block_ids: list[int]
    remote_request_id: str
    remote_block_ids: list[int]
    remote_generations: list[int]
    remote_host: str
    remote_port: int


class P2PMetadata(msgspec.Struct, **_STRUCT):
    """One step's p2p work: holds to start, loads to start, holds or loads to cancel."""

    holds: list[P2PHold] = []
    loads: list[P2PLoad] = []
    cancels: list[str] = []


# ---- KV transfer, block-store connectors (offload.py, storage.py)
#   scheduler -StepPlan.kv_connector_metadata (BlockStoreMetadata)-> its worker ranks


class BlockStoreLoad(msgspec.Struct, **_STRUCT):
    """Copy the stored blocks ``keys`` into the request's cache blocks ``block_ids``."""

    req_id: str
    keys: list[int | str]
    block_ids: list[int]


class BlockStoreMetadata(msgspec.Struct, **_STRUCT):
    """One step's block-store work: save cache block ``save_block_ids[i]`` under
    ``save_keys[i]`` (before the step runs, in order), then start ``loads``."""

    save_keys: list[int | str] = []
    save_block_ids: list[int] = []
    loads: list[BlockStoreLoad] = []


class KVLayout(msgspec.Struct, **_STRUCT):
    """The shape of one rank's KV cache; a pull between different layouts is refused."""

    num_layers: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: str


class KVPull(msgspec.Struct, **_TAGGED):
    """Send me these blocks of a held request, layer by layer (``generations`` must match
    the hold's: blocks freed and reused since are never sent)."""

    remote_request_id: str
    block_ids: list[int]
    generations: list[int]
    layout: KVLayout
    transport: str = "zmq"  # "nixl": answer where the blocks are (KVPullNixl), not them


class KVRenew(msgspec.Struct, **_TAGGED):
    """The decode side still wants this request's blocks: extend its lease."""

    remote_request_id: str


class KVRelease(msgspec.Struct, **_TAGGED):
    """The decode side is done with (or gave up on) this request's blocks: free them."""

    remote_request_id: str


KVSideChannelInput = KVPull | KVRenew | KVRelease


class KVPullLayer(msgspec.Struct, **_TAGGED):
    """Header of layers ``layer`` .. ``layer + count - 1`` of a pull; 2 x ``count`` raw frames
    follow (K then V of each layer, the blocks in order). Small layers travel together."""

    layer: int
    count: int = 1


class KVPullRefused(msgspec.Struct, **_TAGGED):
    reason: str


class KVPullNixl(msgspec.Struct, **_TAGGED):
    """The answer to a NIXL pull: the prefill rank's NIXL agent (its metadata, to connect)
    and where its blocks are: per layer, K then V, the tensor's address and bytes per block
    (block b at ``bases[i] + b * block_bytes[i]``). The decode rank READs them itself."""

    agent: str
    metadata: bytes
    bases: list[int]
    block_bytes: list[int]
    mem_type: str  # "DRAM" or "VRAM"
    device: int = 0


KVSideChannelReply = KVPullLayer | KVPullRefused | KVPullNixl
