"""Chat sessions replayed on real servers as every chat client sends them, each reply fed back as the next turn's
assistant message, and the audit's simulated cache checked against the count each server reports, request by request.

    bash scripts/vllm_cpu.sh && bash scripts/build_llama_server.sh      # once
    python -m benchmarks.interop.chat_replay [--servers vllm-32,vllm-128,llama-pinned,llama-default] [--sessions 4] [--turns 5]
                                             [--max-tokens 8,24,64]

The sessions (``SESSIONS``: a system prompt each, and user turns) are sent interleaved (turn 1 of every session, then
turn 2, ...) to ``/v1/chat/completions`` at temperature 0, session k with ``max_tokens`` the k-th of ``--max-tokens``
(cycled), so that some replies end on the end-of-turn token and others are cut. Each call is logged as a gateway
record (``request``, ``response``, ``timestamp``, ``session_id``), the log a gateway in front of the server writes.

The log is then audited as ``kvscope audit LOG --observed-engine E --block-size B`` reads it (``reading.read_log``,
``traffic_scan.scan_log``: the replies go into the simulated caches as servers cache them, ``kvscope.engine.audit.logs.replies``), and per
request the server's ``usage.prompt_tokens_details.cached_tokens`` is set beside the simulated engine's reuse:

- ``vllm-B``: vLLM's CPU build (``scripts/vllm_cpu.sh``) at block size B, the simulated ``vllm`` engine at block B.
  vLLM returns the reply's token ids (``return_token_ids``), so each reply is read twice: from its ids, and from its
  text alone (``text_only``: the ids dropped from the log, as most gateways log it).
- ``llama-pinned``: the pinned llama-server build, one slot per session (``id_slot``; ``-np`` = sessions), RAM prompt
  cache off, against the simulated ``llama_cpp`` engine (a slot per session).
- ``llama-default``: the same server with its defaults (4 slots with one KV cache, the RAM prompt cache), the client
  naming no slot (as LiteLLM and most clients send), against ``--prompt-cache`` (``caches.ServerSlots``).
  Its chat endpoint returns no ids, so each llama way runs twice on a fresh server: through the chat endpoint (the
  reply read from its text) and through ``/completion`` with the prompt's ids and the generated ids returned.

Each log is also audited with no flags at all (``ScanSettings()``, ``no_flags``): the engine compared with is the one
the log's answers name, llama.cpp's mode follows whether the log pins ``id_slot``, and a vLLM log's block size is read
from its own counts (``ScanSettings.for_log``); each records the engine, its evidence and the settings decided.

Writes benchmarks/interop/results/chat_replay-<model>-cpu.json: per server, every request (the server's count, the
simulation's, their difference) and the share equal, with the flags above and with none.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx

from benchmarks.common import cpu_info
from benchmarks.serving.serving_servers import SERVER_BINARY, LlamaServer, VllmServer, embedded_gguf
from kvscope.engine.audit.logs.reading import read_log
from kvscope.engine.audit.scan.settings import ScanSettings
from kvscope.engine.audit.scan.traffic_scan import scan_log
from kvscope.engine.audit.simulate.caches import CacheSettings

RESULTS = Path(__file__).resolve().parent / "results"
SESSIONS = (
    (
        "You are a support agent for Northwind Traders. Answer in one short paragraph.",
        ("Where is my order 4417?", "Can you change the address?", "And the delivery date?", "Thanks. Anything else?", "Bye."),
    ),
    (
        "You are a Python tutor. Keep answers brief and show code when it helps.",
        ("What is a list comprehension?", "Show one that squares numbers.", "Now filter the even ones.", "Why use it?", "Done."),
    ),
    (
        "You are a travel assistant. Reply in at most two sentences.",
        ("Plan a day in Lisbon.", "Add a museum.", "Where should I eat dinner?", "Is the tram worth it?", "Great."),
    ),
    (
        "You translate English into French. Reply with the translation only.",
        ("Good morning.", "Where is the station?", "I would like a coffee.", "How much is it?", "Thank you."),
    ),
)


def chat(client: httpx.Client, base_url: str, body: dict) -> dict:
    """One chat completion; the server's JSON answer."""
    response = client.post(f"{base_url}/v1/chat/completions", json=body)
    response.raise_for_status()
    return response.json()


def replay_sessions(base_url: str, model: str, sessions: int, turns: int, max_tokens: Sequence[int], extra: dict[str, Any]) -> list[dict]:
    """``sessions`` chats of ``turns`` turns sent interleaved, each reply fed back; the gateway records, in order.
    ``extra``: what each body adds for this server (token ids returned, a slot per session)."""
    chats = [[{"role": "system", "content": SESSIONS[k % len(SESSIONS)][0]}] for k in range(sessions)]
    records = []
    with httpx.Client(trust_env=False, timeout=600.0) as client:
        for turn in range(turns):
            for k, messages in enumerate(chats):
                users = SESSIONS[k % len(SESSIONS)][1]
                messages.append({"role": "user", "content": users[turn % len(users)]})
                body = {"model": model, "messages": list(messages), "max_tokens": max_tokens[k % len(max_tokens)], "temperature": 0.0}
                body |= {key: value(k) if callable(value) else value for key, value in extra.items()}
                sent = time.time()
                answer = chat(client, base_url, body)
                records.append({"request": body, "response": answer, "timestamp": sent, "session_id": f"session-{k + 1}"})
                messages.append({"role": "assistant", "content": answer["choices"][0]["message"]["content"] or ""})
    return records


def replay_sessions_as_ids(base_url: str, tokenizer: Any, sessions: int, turns: int, max_tokens: Sequence[int], pinned: bool) -> list[dict]:
    """The sessions sent to llama-server's native ``/completion`` as token ids (the chat template rendered here, as the
    audit renders it; ``pinned``: a slot per session), the generated ids returned (``return_tokens``): the gateway
    records hold the chat request and the server's answer, ids, ``stop_type`` and ``timings.cache_n``."""
    chats = [[{"role": "system", "content": SESSIONS[k % len(SESSIONS)][0]}] for k in range(sessions)]
    records = []
    with httpx.Client(trust_env=False, timeout=600.0) as client:
        for turn in range(turns):
            for k, messages in enumerate(chats):
                users = SESSIONS[k % len(SESSIONS)][1]
                messages.append({"role": "user", "content": users[turn % len(users)]})
                ids = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True, return_dict=False)
                n_predict = max_tokens[k % len(max_tokens)]
                body = {"prompt": list(ids), "n_predict": n_predict, "temperature": 0.0, "cache_prompt": True, "return_tokens": True}
                body |= {"id_slot": k} if pinned else {}
                sent = time.time()
                response = client.post(f"{base_url}/completion", json=body)
                response.raise_for_status()
                answer = response.json()
                request = {"model": "embedded", "messages": list(messages), "max_tokens": n_predict}
                request |= {"id_slot": k} if pinned else {}  # the slot the server was sent, logged as a gateway logs it
                records.append({"request": request, "response": answer, "timestamp": sent, "session_id": f"session-{k + 1}"})
                messages.append({"role": "assistant", "content": answer["content"]})
    return records


def without_token_ids(records: Sequence[dict]) -> list[dict]:
    """The records as a gateway that logs text only keeps them: every ``token_ids`` dropped from the responses."""
    out = []
    for record in records:
        response = json.loads(json.dumps(record["response"]))
        for choice in response.get("choices", []):
            choice.pop("token_ids", None)
        response.pop("prompt_token_ids", None)
        response.pop("tokens", None)  # llama-server's /completion
        out.append({**record, "response": response})
    return out


def compared(tokenizer: Any, records: Sequence[dict], settings: ScanSettings = ScanSettings()) -> dict:
    """The records audited (``read_log`` + ``scan_log`` with ``settings``; the default: with no flags, the engine and
    its settings decided from the log, ``ScanSettings.for_log``): the engine compared with and why, the settings
    simulated, per request the server's cached count beside the simulation's, and the share equal."""
    log = read_log("\n".join(json.dumps(record) for record in records))
    scan = scan_log(tokenizer, log, settings)
    engine = scan.settings.observed_engine
    rows = []
    for row in scan.requests:
        rendered = scan.rendered[row.request]
        reply = rendered.request.reply
        rows.append(
            {
                "request": row.request,
                "session": row.session,
                "prompt_tokens": row.tokens,
                "reply_tokens_cached": len(rendered.reply_ids),
                "finish": reply.finish if reply else None,
                "reply_from": reply.source if reply else None,
                "server_cached_tokens": row.observed_cached_tokens,
                "simulated_cached_tokens": row.reused_tokens[engine],
                "prompts_only_cached_tokens": row.prompts_only_reused_tokens[engine],
                "difference": None if row.observed_cached_tokens is None else row.observed_cached_tokens - row.reused_tokens[engine],
            }
        )
    counted = [row for row in rows if row["server_cached_tokens"] is not None]
    equal = sum(row["difference"] == 0 for row in counted)
    plain = sum(row["server_cached_tokens"] == row["prompts_only_cached_tokens"] for row in counted)
    return {
        "engine": engine,
        "engine_evidence": scan.observed_evidence,
        "settings": scan.settings.cache.as_dict(),
        "requests": len(rows),
        "equal": equal,
        "equal_share": round(equal / len(counted), 4) if counted else None,
        "equal_prompts_only": plain,
        "replies": scan.totals().replies,
        "rows": rows,
    }


def run_vllm(model_dir: Path, tokenizer: Any, block: int, args: argparse.Namespace) -> dict:
    """The sessions on vLLM's CPU build at ``block``, compared with the replies' ids and with their text alone."""
    with VllmServer(model_dir, RESULTS / f"vllm-{block}-server.log", block=block, name="embedded") as server:
        server.reset_cache()
        records = replay_sessions(server.base_url, server.model, args.sessions, args.turns, args.max_tokens, {"return_token_ids": True})
        settings = server.settings()
    flags = ScanSettings(CacheSettings(block=block), "vllm", block_given=True)  # --observed-engine vllm --block-size B
    logs = {"token_ids": records, "text_only": without_token_ids(records)}
    return {
        "settings": settings,
        **{way: compared(tokenizer, log, flags) for way, log in logs.items()},
        "no_flags": {way: compared(tokenizer, log) for way, log in logs.items()},
        "log_token_ids": records,
    }


def run_llama(tokenizer: Any, args: argparse.Namespace, pinned: bool) -> dict:
    """The sessions on llama-server: ``pinned``, one slot per session (``id_slot``, RAM prompt cache off) against the
    simulated slot per session; else the server's defaults (4 slots, one KV cache, its RAM prompt cache) with no slot
    named, against the simulated ``ServerSlots`` (``--prompt-cache``). Each way twice, each on a fresh server: through
    the chat endpoint (the reply read from its text, as most gateways log it) and through ``/completion`` with the
    generated ids returned (what the slot holds is then known)."""
    slots, cache_ram = (args.sessions, 0) if pinned else (None, None)
    flags = ScanSettings(CacheSettings(block=1, prompt_cache=not pinned), "llama_cpp")  # --observed-engine llama_cpp [--prompt-cache]
    result: dict[str, Any] = {"no_flags": {}}
    for way in ("text_only", "token_ids"):
        log = RESULTS / f"llama-{'pinned' if pinned else 'default'}-{way}-server.log"
        server = LlamaServer(SERVER_BINARY, embedded_gguf(), 4096 * args.sessions, args.threads, log, model="embedded", slots=slots,
                             cache_ram_mib=cache_ram)  # fmt: skip
        with server:
            if way == "text_only":
                extra = {"id_slot": lambda k: k} if pinned else {}
                records = replay_sessions(server.base_url, server.model, args.sessions, args.turns, args.max_tokens, extra)
            else:
                records = replay_sessions_as_ids(server.base_url, tokenizer, args.sessions, args.turns, args.max_tokens, pinned)
            result["settings"] = server.settings()
        result[way] = compared(tokenizer, records, flags)
        result["no_flags"][way] = compared(tokenizer, records)
        result[f"log_{way}"] = records
    return result


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--servers",
        default="vllm-32,vllm-128,llama-pinned,llama-default",
        help="vllm-<block> (a multiple of 32), llama-pinned, llama-default",
    )
    parser.add_argument("--sessions", type=int, default=4)
    parser.add_argument("--turns", type=int, default=5)
    parser.add_argument("--max-tokens", default="8,24,64", help="per session, cycled")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=RESULTS / "chat_replay-embedded-cpu.json")
    return parser


def main(argv: Sequence[str] | None = None) -> dict:
    from transformers import AutoTokenizer

    from kvscope.engine.models.gguf import converted_alias

    args = _parser().parse_args(argv)
    args.max_tokens = [int(part) for part in args.max_tokens.split(",")]
    model_dir, _, _ = converted_alias("embedded", print)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    results: dict[str, Any] = {}
    for name in args.servers.split(","):
        started = time.monotonic()
        if name.startswith("llama"):
            results[name] = run_llama(tokenizer, args, pinned=name == "llama-pinned")
        else:
            results[name] = run_vllm(model_dir, tokenizer, int(name.split("-")[1]), args)
        results[name]["wall_s"] = round(time.monotonic() - started, 1)
        for way in ("token_ids", "text_only"):
            if way in results[name]:
                part = results[name][way]
                bare = results[name]["no_flags"][way]
                print(
                    f"{name} ({way}): simulation = server on {part['equal']}/{part['requests']} requests; with no flags "
                    f"({bare['engine']}, block {bare['settings']['block']}) {bare['equal']}/{bare['requests']}",
                    flush=True,
                )
    out = {
        "benchmark": "chat_replay",
        "cpu": cpu_info(),
        "sessions": args.sessions,
        "turns": args.turns,
        "max_tokens": args.max_tokens,
        "servers": results,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, separators=(",", ":")) + "\n")  # compact: it keeps every raw answer
    print(f"wrote {args.out}")
    return out


if __name__ == "__main__":
    main()
