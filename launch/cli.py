"""The ``actorserve`` command line.

``actorserve generate PROMPT [--chat]`` completes prompts with the offline engine.
Engine flags have vLLM's names (``--max-num-seqs``, ``--block-size``, ...). A
configuration or model-loading mistake prints one ``error:`` line and exits 2.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

from services.config import ConfigError, EngineConfig, add_engine_args, add_serve_args


def _add_generate(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "generate",
        help="complete prompts with the offline engine",
        description="Complete one or more prompts with continuous batching and print the results.",
    )
    p.add_argument("prompt", nargs="*", help="prompt text (several allowed)")
    p.add_argument("--prompts-file", type=Path, default=None, help="one prompt per line")
    p.add_argument("--chat", action="store_true", help="apply the model's chat template")
    p.add_argument("--system", default=None, help="system message (with --chat)")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--stats", action="store_true", help="print token counts and throughput")
    p.add_argument(
        "--disable-tqdm",
        "--no-progress",
        action="store_true",
        help="no 'Processed prompts' progress bar on stderr (vLLM's flag name)",
    )
    add_engine_args(p)
    p.set_defaults(func=_run_generate)


def _read_prompts(args: argparse.Namespace) -> list[str]:
    prompts = list(args.prompt)
    if args.prompts_file is not None:
        try:
            lines = args.prompts_file.read_text(encoding="utf-8").splitlines()
        except OSError as e:
            raise ConfigError(
                f"cannot read --prompts-file: {e.strerror}: {args.prompts_file}"
            ) from None
        prompts += [line for line in lines if line.strip()]
    if not prompts:
        raise ConfigError("give a prompt, or --prompts-file with one prompt per line")
    return prompts


def _run_generate(args: argparse.Namespace) -> int:
    import time

    from launch.llm import LLM
    from services.protocol import SamplingParams

    prompts = _read_prompts(args)
    params = SamplingParams(
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        seed=args.seed,
        max_tokens=args.max_tokens,
        ignore_eos=args.ignore_eos,
    )
    try:
        params.validate()
    except ValueError as e:
        raise ConfigError(str(e)) from None
    llm = LLM(**EngineConfig.cli_kwargs(args))
    if args.chat:
        system = [{"role": "system", "content": args.system}] if args.system else []
        prompts = [
            llm.apply_chat_template([*system, {"role": "user", "content": p}]) for p in prompts
        ]
    start = time.perf_counter()
    results = llm.generate(prompts, params, use_tqdm=not args.disable_tqdm)
    elapsed = time.perf_counter() - start
    for i, result in enumerate(results):
        if len(results) > 1:
            print(f"--- [{i}] {args.prompt[i] if i < len(args.prompt) else ''}".rstrip())
        print(result.outputs[0].text)
    if args.stats:
        n_out = sum(len(r.outputs[0].token_ids) for r in results)
        n_in = sum(len(r.prompt_token_ids) for r in results)
        print(
            f"{len(results)} prompts, {n_in} prompt tokens, {n_out} output tokens in "
            f"{elapsed:.2f} s: {n_out / elapsed:.1f} output tok/s",
            file=sys.stderr,
        )
    return 0


def _add_serve(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "serve",
        help="start the OpenAI-compatible server",
        description="Start the server: api_server, tokenizer, scheduler, worker and detokenizer processes.",
    )
    p.add_argument(
        "model_tag",
        nargs="?",
        default=None,
        metavar="MODEL",
        help="GGUF file or Hugging Face folder (default: SmolLM2-135M-Instruct)",
    )
    add_serve_args(p)
    p.set_defaults(func=_run_serve)


def _run_serve(args: argparse.Namespace) -> int:
    from launch.serve import run_server

    if args.model_tag is not None:
        if args.model is not None and args.model != args.model_tag:
            raise ConfigError("give the model once: as MODEL or as --model, not both")
        args.model = args.model_tag
    return run_server(args)


def _add_bench(sub: argparse._SubParsersAction) -> None:
    from bench.serve import add_cli_args

    p = sub.add_parser(
        "bench",
        help="benchmark an OpenAI-compatible server (vllm bench serve's flags)",
        description="Send a workload to a running server; print vLLM's result table, write JSON and PNG plots.",
    )
    add_cli_args(p)
    p.set_defaults(func=_run_bench)


def _run_bench(args: argparse.Namespace) -> int:
    from bench.serve import main as bench_main

    return bench_main(args)


def _add_router(sub: argparse._SubParsersAction) -> None:
    from services.router.config import QUIET_ENDPOINTS
    from services.router.policies import POLICIES

    p = sub.add_parser(
        "router",
        help="route requests over several servers (cache-aware)",
        description="An OpenAI-compatible router in front of several servers (ours or vLLM's).",
    )
    p.add_argument(
        "--backend",
        action="append",
        default=[],
        metavar="URL",
        help="a replica's base URL (repeat for each; more can be added at run time)",
    )
    _add_discovery_args(p, ["--selector"])
    p.add_argument("--policy", default="cost", choices=sorted(POLICIES), help="default: cost")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback)")
    p.add_argument("--port", type=int, default=8080)
    p.add_argument(
        "--api-key", default=None, help="enables /admin/backends, guarded by 'Bearer KEY'"
    )
    p.add_argument(
        "--tokenizer",
        default=None,
        help="tokenize prompts here with this model's tokenizer (folder or GGUF; 'default' for "
        "the default model) instead of the replicas' /tokenize",
    )
    p.add_argument(
        "--block-size", type=int, default=None, help="default: the replicas' (from /metrics)"
    )
    p.add_argument(
        "--prefix-caching-hash-algo",
        default=None,
        choices=["sha256", "sha256_cbor", "builtin"],
        help="default: the replicas'",
    )
    p.add_argument(
        "--session-header",
        default="x-session-id",
        help="the header whose value sticks a session to a replica (policy session; else "
        "the body's 'user')",
    )
    p.add_argument(
        "--kv-events",
        action="append",
        default=[],
        metavar="URL=ENDPOINT[,REPLAY[,TOPIC]]",
        help="where a replica that does not report it (vLLM started with --kv-events-config) "
        "publishes its KV events; ours report theirs at GET /kv_events",
    )
    p.add_argument(
        "--burst-window-ms",
        type=float,
        default=50.0,
        help="policy burst: requests sharing a new prefix within this window go together",
    )
    p.add_argument("--health-check-interval", type=float, default=2.0, help="seconds")
    p.add_argument(
        "--load-interval-ms", type=float, default=100.0, help="how often the cost policy reads load"
    )
    p.add_argument("--seed", type=int, default=None, help="seeds the random choices")
    p.add_argument("--uvicorn-log-level", default="warning")
    p.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="seconds in-flight requests get to finish after SIGTERM")  # fmt: skip
    p.add_argument("--timeout-keep-alive", type=int, default=75, metavar="SECONDS",
                   help="how long an idle client connection stays open (default: 75, longer "
                   "than clients keep theirs: a shorter one races their next request)")  # fmt: skip
    p.add_argument("--disable-uvicorn-access-log", action="store_true",
                   help="no access log line per request (vLLM's flag)")  # fmt: skip
    p.add_argument("--disable-access-log-for-endpoints", default=QUIET_ENDPOINTS,
                   metavar="PATHS", help="comma-separated paths without an access line "
                   f"(default: {QUIET_ENDPOINTS}: probes; '' logs every request)")  # fmt: skip
    p.set_defaults(func=_run_router)


def _run_router(args: argparse.Namespace) -> int:
    from launch.ports import check_port
    from services.router.app import RouterConfig, run_router
    from services.router.replicas import backend_url

    discovery = _discovery(args, {"--selector": args.selector})["--selector"]
    if not args.backend and args.api_key is None and discovery is None:
        raise ConfigError(
            "give at least one --backend (or --service-discovery with --selector, or "
            "--api-key, to add them at run time)"
        )
    try:
        backends = [backend_url(url) for url in args.backend]
    except ValueError as e:
        raise ConfigError(f"--backend {e}") from None
    if args.block_size is not None and (
        args.block_size < 1 or args.block_size & (args.block_size - 1)
    ):
        raise ConfigError(f"--block-size must be a power of two, got {args.block_size}")
    if args.health_check_interval <= 0 or args.load_interval_ms <= 0:
        raise ConfigError("--health-check-interval and --load-interval-ms must be positive")
    if not args.shutdown_timeout >= 0:
        raise ConfigError("--shutdown-timeout must be at least 0")
    if args.timeout_keep_alive < 1:
        raise ConfigError("--timeout-keep-alive must be at least 1")
    check_port(args.host, args.port)
    from services.router.kv_events import Publisher
    from services.router.replicas import normalize_url

    kv_events = {}
    for item in args.kv_events:
        url, sep, where = item.partition("=")
        parts = where.split(",")
        if not sep or not parts[0] or len(parts) > 3:
            raise ConfigError(f"--kv-events takes URL=ENDPOINT[,REPLAY[,TOPIC]], got {item!r}")
        kv_events[normalize_url(url)] = Publisher(*parts)
    tokenizer = args.tokenizer
    if tokenizer is not None:
        from services.model_loader import prepare_model

        tokenizer = str(prepare_model(None if tokenizer == "default" else tokenizer))
    config = RouterConfig(
        backends=backends,
        policy=args.policy,
        host=args.host,
        port=args.port,
        api_key=args.api_key,
        tokenizer=tokenizer,
        block_size=args.block_size,
        prefix_caching_hash_algo=args.prefix_caching_hash_algo,
        session_header=args.session_header.lower(),
        burst_window_ms=args.burst_window_ms,
        health_check_interval=args.health_check_interval,
        load_interval_ms=args.load_interval_ms,
        log_level=args.uvicorn_log_level,
        seed=args.seed,
        kv_events=kv_events,
        shutdown_timeout=args.shutdown_timeout,
        timeout_keep_alive=args.timeout_keep_alive,
        access_log=not args.disable_uvicorn_access_log,
        access_log_skip=_paths(args.disable_access_log_for_endpoints),
        discovery=discovery,
    )
    return run_router(config)


def _add_discovery_args(p: argparse.ArgumentParser, selectors: list[str]) -> None:
    """Kubernetes service discovery, named as sglang-router names it
    (services/router/discovery.py)."""
    p.add_argument("--service-discovery", action="store_true",
                   help="find replicas in Kubernetes: the ready pods " + " / ".join(selectors)
                   + " names, watched through the API (in cluster: the service account)")  # fmt: skip
    for flag in selectors:
        what = flag.removeprefix("--").removesuffix("-selector").replace("selector", "replica")
        p.add_argument(flag, nargs="+", default=[], metavar="KEY=VALUE",
                       help=f"labels every {what} pod has (with --service-discovery)")  # fmt: skip
    p.add_argument("--service-discovery-port", type=int, default=8000,
                   help="the port each discovered pod serves on (default: 8000)")  # fmt: skip
    p.add_argument("--service-discovery-namespace", default=None,
                   help="the pods' namespace (default: the router's own pod's)")  # fmt: skip
    p.add_argument("--service-discovery-api-url", default=None, metavar="URL",
                   help="the Kubernetes API without the service account's token (kubectl "
                   "proxy's http://127.0.0.1:8001, a test's fake; default: in cluster)")  # fmt: skip


def _discovery(args: argparse.Namespace, selectors: dict[str, list[str]]) -> dict[str, Any]:
    """Each selector flag's ``DiscoveryConfig`` (None where discovery is off); ConfigError."""
    from services.router.discovery import DiscoveryConfig, parse_selector

    if not args.service_discovery:
        given = [flag for flag, items in selectors.items() if items]
        if given:
            raise ConfigError(f"{given[0]} needs --service-discovery")
        return dict.fromkeys(selectors)
    if not 0 < args.service_discovery_port < 65536:
        raise ConfigError("--service-discovery-port must be between 1 and 65535")
    configs: dict[str, Any] = {}
    for flag, items in selectors.items():
        try:
            selector = parse_selector(items)
        except ValueError as e:
            raise ConfigError(f"{flag}: {e} (--service-discovery needs it)") from None
        configs[flag] = DiscoveryConfig(
            selector=selector,
            port=args.service_discovery_port,
            namespace=args.service_discovery_namespace,
            api_url=args.service_discovery_api_url,
        )
    if args.service_discovery_api_url is None and not os.environ.get("KUBERNETES_SERVICE_HOST"):
        raise ConfigError(
            "--service-discovery: not in a Kubernetes pod (KUBERNETES_SERVICE_HOST is not "
            "set); give --service-discovery-api-url (e.g. kubectl proxy's http://127.0.0.1:8001)"
        )
    return configs


def _paths(value: str | None) -> list[str]:
    """``--disable-access-log-for-endpoints``: its comma-separated paths."""
    return [p.strip() for p in (value or "").split(",") if p.strip()]


def _add_pd_proxy(sub: argparse._SubParsersAction) -> None:
    from services.router.config import QUIET_ENDPOINTS
    from services.router.policies import POLICIES

    p = sub.add_parser(
        "pd-proxy",
        help="prefill/decode disaggregation: one prefill, then the decode elsewhere",
        description="An OpenAI-compatible proxy over prefill instances (--kv-transfer-config "
        "kv_producer) and decode instances (kv_consumer): each request is prefilled on one "
        "(max_tokens 1), then generated on another, which pulls the KV from the first.",
    )
    p.add_argument("--prefill", action="append", default=[], metavar="URL",
                   help="a prefill instance's base URL (repeat for each)")  # fmt: skip
    p.add_argument("--decode", action="append", default=[], metavar="URL",
                   help="a decode instance's base URL (repeat for each)")  # fmt: skip
    _add_discovery_args(p, ["--prefill-selector", "--decode-selector"])
    p.add_argument("--prefill-policy", default="cost", choices=sorted(POLICIES),
                   help="how to choose the prefill instance (default: cost, prefix-aware)")  # fmt: skip
    p.add_argument("--decode-policy", default="cost", choices=sorted(POLICIES),
                   help="how to choose the decode instance (default: cost: by load)")  # fmt: skip
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback)")
    p.add_argument("--port", type=int, default=8080)
    p.add_argument("--tokenizer", default=None,
                   help="tokenize prompts here (as the router's --tokenizer)")  # fmt: skip
    p.add_argument("--health-check-interval", type=float, default=2.0, help="seconds")
    p.add_argument("--load-interval-ms", type=float, default=100.0)
    p.add_argument("--seed", type=int, default=None, help="seeds the random choices")
    p.add_argument("--uvicorn-log-level", default="warning")
    p.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="seconds in-flight requests get to finish after SIGTERM")  # fmt: skip
    p.add_argument("--timeout-keep-alive", type=int, default=75, metavar="SECONDS",
                   help="how long an idle client connection stays open (default: 75, longer "
                   "than clients keep theirs: a shorter one races their next request)")  # fmt: skip
    p.add_argument("--disable-uvicorn-access-log", action="store_true",
                   help="no access log line per request (vLLM's flag)")  # fmt: skip
    p.add_argument("--disable-access-log-for-endpoints", default=QUIET_ENDPOINTS,
                   metavar="PATHS", help="comma-separated paths without an access line "
                   f"(default: {QUIET_ENDPOINTS}: probes; '' logs every request)")  # fmt: skip
    p.set_defaults(func=_run_pd_proxy)


def _run_pd_proxy(args: argparse.Namespace) -> int:
    from launch.ports import check_port
    from services.router.app import RouterConfig
    from services.router.pd_proxy import run_pd_proxy
    from services.router.replicas import backend_url

    found = _discovery(
        args,
        {"--prefill-selector": args.prefill_selector, "--decode-selector": args.decode_selector},
    )
    discovery = {"prefill": found["--prefill-selector"], "decode": found["--decode-selector"]}
    for role in ("prefill", "decode"):
        if not getattr(args, role) and discovery[role] is None:
            raise ConfigError(
                f"give at least one --{role} (or --service-discovery with --{role}-selector)"
            )
    urls: dict[str, list[str]] = {"prefill": [], "decode": []}
    for flag, given in (("prefill", args.prefill), ("decode", args.decode)):
        try:
            urls[flag] = [backend_url(url) for url in given]
        except ValueError as e:
            raise ConfigError(f"--{flag} {e}") from None
    if args.health_check_interval <= 0 or args.load_interval_ms <= 0:
        raise ConfigError("--health-check-interval and --load-interval-ms must be positive")
    if not args.shutdown_timeout >= 0:
        raise ConfigError("--shutdown-timeout must be at least 0")
    if args.timeout_keep_alive < 1:
        raise ConfigError("--timeout-keep-alive must be at least 1")
    check_port(args.host, args.port)
    tokenizer = args.tokenizer
    if tokenizer is not None:
        from services.model_loader import prepare_model

        tokenizer = str(prepare_model(None if tokenizer == "default" else tokenizer))

    def side(role: str, policy: str) -> RouterConfig:
        return RouterConfig(
            backends=urls[role],
            role=role,
            policy=policy,
            host=args.host,
            port=args.port,
            tokenizer=tokenizer,
            health_check_interval=args.health_check_interval,
            load_interval_ms=args.load_interval_ms,
            log_level=args.uvicorn_log_level,
            seed=args.seed,
            shutdown_timeout=args.shutdown_timeout,
            timeout_keep_alive=args.timeout_keep_alive,
            access_log=not args.disable_uvicorn_access_log,
            access_log_skip=_paths(args.disable_access_log_for_endpoints),
            discovery=discovery[role],
        )

    return run_pd_proxy(side("prefill", args.prefill_policy), side("decode", args.decode_policy))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="actorserve", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    _add_generate(sub)
    _add_serve(sub)
    _add_bench(sub)
    _add_router(sub)
    _add_pd_proxy(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    from services.model_loader import ModelLoadError

    try:
        return int(args.func(args))
    except (ConfigError, ModelLoadError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
