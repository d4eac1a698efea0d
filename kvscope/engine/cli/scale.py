"""``audit``'s flags for logs at scale: many files, a directory of shards or gzip'd JSONL (one reader, ``shards``),
the token pass and the model pass on Ray (``--ray``, ``--workers``), and fleets of replicas behind a router
(``--replicas``, ``--routing``)."""

from __future__ import annotations

import argparse
import functools

from kvscope.engine.audit.logs.requests import RequestLogError
from kvscope.engine.audit.logs.shards import LogFiles
from kvscope.engine.audit.measure.traffic import MeasureTurns, TokenPass
from kvscope.engine.audit.scan.settings import ScanSettings
from kvscope.engine.audit.scan.traffic_scan import TrafficScan
from kvscope.engine.audit.simulate.budgets import DTYPE_BYTES, LLAMA_CACHE_RAM_MIB, VLLM_GPU_UTILIZATION, ModelKV, ServerSize
from kvscope.engine.audit.simulate.caches import CacheSettings
from kvscope.engine.audit.simulate.fleet import ROUTINGS, fleet_grid
from kvscope.engine.cache.loaded import LoadedModel, LoadedTokenizer
from kvscope.engine.cli.common import Group, arg, progress

SCALE: Group = (
    arg(
        "--ray",
        nargs="?",
        const="local",
        metavar="ADDRESS",
        help="run the token pass and the sampled turns on Ray: 'local' (the default) starts one of --workers CPUs, "
        "an address joins a cluster (whose nodes load --model by its name)",
    ),
    arg(
        "--workers",
        type=int,
        default=2,
        help="with --ray: tokenizer actors, then model actors (and, for --ray local, the CPUs it starts with)",
    ),
    arg("--replicas", help="also simulate fleets of this many replicas (comma-separated, e.g. 2,4), each engine per replica"),
    arg("--routing", help=f"the fleets' routers (comma-separated; default all): {', '.join(ROUTINGS)}"),
)
SERVER_SIZE: Group = (  # budgets as the servers compute them from their size (``simulate.budgets``), where no budget flag is given
    arg("--gpu-memory-gib", type=float, help="one GPU's memory in GiB: vLLM's and SGLang's KV budgets as each server computes them"),
    arg(
        "--gpu-memory-utilization",
        type=float,
        default=VLLM_GPU_UTILIZATION,
        help=f"vLLM's --gpu-memory-utilization (default {VLLM_GPU_UTILIZATION})",
    ),
    arg("--mem-fraction-static", type=float, help="SGLang's --mem-fraction-static (default: 0.88 assumed, said in the report)"),
    arg("--vllm-cpu-kvcache-space", type=float, help="vLLM's CPU backend: VLLM_CPU_KVCACHE_SPACE in GiB (replaces the GPU for vLLM)"),
    arg("--llama-ctx-size", type=int, help="llama-server's -c: the context in tokens, split across its slots"),
    arg("--llama-parallel", type=int, help="llama-server's -np: its slots (default: auto, 4 slots sharing one KV cache)"),
    arg("--server-dtype", choices=list(DTYPE_BYTES), help="the dtype served (default: the checkpoint's, float32 in bfloat16)"),
    arg(
        "--llama-cache-ram",
        type=int,
        default=LLAMA_CACHE_RAM_MIB,
        help=f"llama-server's --cache-ram in MiB: its RAM prompt cache (default {LLAMA_CACHE_RAM_MIB}; 0: none, -1: no limit)",
    ),
)


def log_files(args: argparse.Namespace) -> LogFiles:
    """The log's files as given, which the token pass reads: in this process, or on Ray (--ray), where what one
    process alone measures is refused by name."""
    if args.ray:
        if args.rewritten or args.template:
            raise RequestLogError("--rewritten and --template measure a rewrite in one process: drop --ray")
        if args.fit_observed:
            raise RequestLogError("--fit-observed re-runs the block cache over every request's tokens, not kept by --ray: drop --ray")
    return LogFiles.of(args.log, args.format)


def fleet_of(args: argparse.Namespace) -> list[tuple[int, str]]:
    """The (replicas, routing) fleets asked for (none without --replicas)."""
    if args.replicas is None:
        if args.routing:
            raise RequestLogError("--routing names the fleets' routers: add --replicas N")
        return []
    return fleet_grid(args.replicas, args.routing)


def _start_ray(args: argparse.Namespace) -> None:
    try:
        from kvscope.engine.audit.distributed.ray_setup import start_ray
    except ImportError:
        raise RequestLogError('--ray needs Ray: pip install -e ".[scale]"') from None
    start_ray(args.ray, args.workers)


def scan_settings(args: argparse.Namespace, lm: LoadedModel | LoadedTokenizer) -> ScanSettings:
    """The token pass's settings from the flags: the simulated engines' (with a server's size, ``server_size``),
    --observed-engine and the fleets asked for (no --block-size: the default, or the block a vLLM log's counts show,
    ``ScanSettings.for_log``)."""
    block = CacheSettings.block if args.block_size is None else args.block_size
    server = server_size(args, lm)
    sizes = {"server": server, "cache_ram_mib": args.llama_cache_ram, "model": ModelKV.known(lm)}
    cache = CacheSettings(block, args.kv_budget_blocks, args.kv_budget_tokens, args.slots, args.cache_reuse, args.prompt_cache, **sizes)
    return ScanSettings(cache, args.observed_engine, tuple(fleet_of(args)), block_given=args.block_size is not None)


def server_size(args: argparse.Namespace, lm: LoadedModel | LoadedTokenizer) -> ServerSize | None:
    """The server's size from its flags (None where none is given), for the model's KV shape read from its config."""
    named = [args.gpu_memory_gib, args.vllm_cpu_kvcache_space, args.llama_ctx_size, args.llama_parallel, args.mem_fraction_static]
    if all(value is None for value in named):
        return None
    model = ModelKV.of_loaded(lm)
    sizes = {"gpu_gib": args.gpu_memory_gib, "mem_fraction_static": args.mem_fraction_static, "dtype": args.server_dtype}
    counts = {"cpu_kvcache_gib": args.vllm_cpu_kvcache_space, "context": args.llama_ctx_size, "parallel": args.llama_parallel}
    return ServerSize(model, gpu_memory_utilization=args.gpu_memory_utilization, **sizes, **counts)


def token_pass(args: argparse.Namespace, lm: LoadedModel) -> TokenPass | None:
    """With --ray, the distributed token pass (given the log's files and the settings) for ``audit_traffic``; else None."""
    if not args.ray:
        return None
    _start_ray(args)
    from kvscope.engine.audit.distributed.ray_scan import ray_scan

    def run(log: LogFiles, settings: ScanSettings) -> TrafficScan:
        return ray_scan(
            lm.tokenizer, log, settings, model=lm.name, workers=args.workers, sample=args.sample, progress=progress("token pass: requests")
        )

    return run


def turn_pass(args: argparse.Namespace, lm: LoadedModel) -> MeasureTurns | None:
    """With --ray and --sample above 0, the sampled turns measured by --workers Ray actors, each loading --model as
    ``lm`` was loaded (``ray_turns``), for ``audit_traffic``; else None (in this process)."""
    if not args.ray or args.sample <= 0:
        return None
    _start_ray(args)
    from kvscope.engine.audit.distributed.turns import ModelSpec, ray_measure_turns

    return functools.partial(ray_measure_turns, ModelSpec.of(args.model, lm), args.workers)
