#!/usr/bin/env python3
"""Soak test (not part of `make test`): N minutes at twice the measured capacity (`--load`), mixed
good and bad requests, random replica kills. Prints requests sent, completed with correct tokens,
rejected with a clear error (of those, `cut_after_tokens`: streams ended by an error event after
their first tokens, with `cut_examples`), and lost (must be 0), plus memory per Ray process, and
where completed requests went on after their replica died (`failovers`, by deployment: with
`--gpu-engine '{"replicas": 2}'` a GPU engine's streams go on on the other where it has a place).
The GPU pool admits with `kv_growth_reserve`, as deployments/app.yaml's does (`--gpu-engine
'{"kv_growth_reserve": false}'`: lazy).
A completion whose tokens differ from transformers' generate() (`completed_wrong`, must be 0) is
kept in `wrong_examples` (its prompt and X-Request-Id, the tokens around where they part and the
shape of the difference, the logit gap there, and the request's path); one that parts from it
only at a float32 near-tie (generate()'s top logit within `tests.helpers.TIE_ULPS` float32
spacings of the server's token there, the spread of two correct computations measured by
`scripts/logit_spread.py`, and generate()'s own continuation after it) counts as
`completed_near_tie`, kept in `near_tie_examples` with the gap.
With --tiers: prompts share a few long heads (prefix caching), the emulated GPU pool's block
pool holds a fraction of them, host and disk KV tiers under every pool; it also reports the
longest gap inside a stream (`worst_gaps`: the 8 longest over 1 s, each with its path) and, once idle,
any replica whose KV blocks are not all free again.
Gaps over 2 s are counted per 10 s of the run (`gaps_over_2s_by_10s`) and by where on the path
(`gaps_over_2s_where`: inside a pool's segment, or moving from one pool to the next), and without
the part of each that this client's own loop was late (`stream_gaps_over_2s_less_client_lag`),
beside that lag itself (`client_loop_lag_max_s`: the client shares the server's cores, and a gap
it was too busy to read counts as the server's). `--rate R` offers R requests/s instead of
`--load` times the capacity measured first (which moves between runs), so that two commits meet
the same load. `--client-nice -10` puts this client's loop ahead of the server's processes (root):
its lag, and the guess at it, leave the gap counts.

    python scripts/soak.py --minutes 3
    python scripts/soak.py --minutes 3 --tiers
    python scripts/soak.py --minutes 1 --tiers --policy-options '{"cpu_reserved_places": 4}'
    python scripts/soak.py --minutes 1.5 --tiers --kill-every-s 100000 --rate 75
    python scripts/soak.py --minutes 1.5 --tiers --gpu-engine '{"replicas": 2}' --kill-only GpuDecode
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

BAD = [b"{oops", b'{"model": "tiny-qwen3"}', b'{"model": "nope", "prompt": "x"}',
       b'{"model": "tiny-qwen3", "prompt": "x", "max_tokens": -5}',
       b'{"model": "tiny-qwen3", "prompt": "x", "temperature": "hot"}', b"\xff\xfe",
       b'{"model": "tiny-qwen3", "prompt": "x", "n": 65}', b'{"model": "tiny-qwen3", "prompt": [1, 2, 99999999]}']
WORDS = "the quick brown fox jumps over a lazy dog while engines decode tokens on every core".split()


def ray_processes_rss() -> dict[str, int]:
    import psutil

    out = {}
    for p in psutil.process_iter(["pid", "cmdline", "memory_info"]):
        cmd = " ".join(p.info["cmdline"] or [])
        if "ray::" in cmd or "raylet" in cmd or "gcs_server" in cmd:
            name = cmd.split()[0][:60] if cmd.startswith("ray::") else cmd.split("/")[-1].split()[0][:40]
            out[f"{name}[{p.info['pid']}]"] = p.info["memory_info"].rss
    return out


# --tiers: a few long heads (system prompts) that most prompts begin with
# (one generator per head: a generator made again for every word gave heads of one word repeated)
HEADS = [" ".join(r.choice(WORDS) for _ in range(120)) for r in (random.Random(i) for i in range(6))]


async def where(request_id: str) -> list[dict]:
    """Where the router counts request `request_id` (its X-Request-Id) right now: hop and seconds."""
    from ray import serve

    from keyacc_ray.serve.pools import ROUTER_NAME

    try:
        rows = await serve.get_deployment_handle(ROUTER_NAME, "keyacc").requests_in_flight.remote(10_000)
    except Exception as e:  # noqa: BLE001 - the router restarting: nothing to say
        return [{"error": repr(e)[:80]}]
    return [r for r in rows if r["request_id"].startswith(f"cmpl-{request_id}-")]


def gap_place(segments: list[dict], at: int) -> str:
    """Where on a request's path the client waited with `at` tokens: inside a segment ("gpu",
    "cpu"), or between two, from one pool to the next ("gpu->cpu"; ",kv": the next segment's KV
    was received or computed again there)."""
    done = 0
    for i, g in enumerate(segments):
        done += g.get("tokens") or 0
        if at < done:
            return str(g.get("pool"))
        if at == done and i + 1 < len(segments):
            nxt = segments[i + 1]
            return f"{g.get('pool')}->{nxt.get('pool')}" + (",kv" if nxt.get("kv") else "")
    return "end"


async def good(client, rng, checks, stats, stream: bool, tiers: bool = False):
    rid = f"soak-{stats['sent']}"
    prompt = " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 20)))
    if tiers and rng.random() < 0.8:
        prompt = rng.choice(HEADS) + " " + prompt
    n = rng.randint(8, 64)
    body = {"model": "tiny-qwen3", "prompt": prompt, "max_tokens": n, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True, "stream": stream}
    t0, ids = time.monotonic(), []
    try:
        if stream:
            async with client.stream("POST", "/v1/completions", json=body, headers={"X-Request-Id": rid}) as r:
                if r.status_code != 200:
                    return record_reject(stats, r.status_code, await r.aread())
                last = None  # gaps between a stream's events, from its first (the wait for it is TTFT)
                worst = (0.0, 0, 0.0)  # this stream's longest gap, the tokens streamed before it, when it began
                long_gaps = []  # each gap over 2 s: (tokens streamed before it, its start, its end)
                trace, cut = None, None
                async for line in r.aiter_lines():
                    now = time.monotonic()
                    if last is not None and line:
                        stats["max_stream_gap_s"] = round(max(stats["max_stream_gap_s"], now - last), 3)
                        worst = max(worst, (now - last, len(ids), last - t0))
                        if now - last > 2.0:  # when (10 s windows from the soak's start): a burst or all along
                            stats["stream_gaps_over_2s"] += 1
                            tally(stats["gaps_over_2s_by_10s"], window(stats, now))
                            long_gaps.append((len(ids), last, now))
                    last = now if line else last
                    if line.startswith("data: ") and line != "data: [DONE]":
                        chunk = json.loads(line[6:])
                        if "error" in chunk:  # a stream ended by an error event, after its first tokens
                            cut = chunk["error"]
                            break
                        for c in chunk.get("choices", []):
                            ids += c.get("token_ids", [])
                        trace = chunk.get("keyacc", trace)
                for at, a, b in long_gaps:
                    # less this client's own lag meanwhile: still over 2 s? and where on its path
                    w = gap_place((trace or {}).get("segments", []), at)
                    tally(stats["gaps_over_2s_where"], w)
                    if b - a - client_share(a, b) > 2.0:  # the server's: when (10 s windows) and where
                        stats["stream_gaps_over_2s_less_client_lag"] += 1
                        tally(stats["server_gaps_by_10s"], window(stats, b))
                        tally(stats["server_gaps_where"], w)
                if worst[0] > 1.0:  # where the longest stalls happened (over 1 s): the request's path
                    # (each segment with when the hop before it ended at the ingress (`ended..`: from there
                    # to `sent`, the router's answer), when the ingress sent its hop (`sent>`), when its
                    # replica took it and when its first token reached the ingress, ms from the request's
                    # start there; its longest wait between tokens at the ingress and when it began; the token
                    # that ended that wait: its batch's way from the pool to the ingress's reader + from
                    # there to the driver, or "own call" (not multiplexed); in its replica: the longest
                    # wait between the engine's steps that made its tokens (after how many tokens of the
                    # hop), for the replica's event loop, and how long its token stream held batches back
                    # for acks. The gap's own start, after the list, is ms from sending the request.)
                    segs = [f"{g.get('pool')}/{g.get('phase')}:{g.get('tokens')}"
                            + "".join(f",{k}" for k in ("kv", "failed", "withdrawn") if g.get(k))
                            + "@" + (f"{g['prev_end_ms']:.0f}.." if "prev_end_ms" in g else "")
                            + (f"{g['sent_ms']:.0f}>" if "sent_ms" in g else "")
                            + (f"{g['start_ms']:.0f}/{g.get('first_token_ms', -1):.0f}ms" if "start_ms" in g else "")
                            + (f" gap {g['ingress_gap_ms']:.0f}ms@{g['ingress_gap_at_ms']:.0f}" if "ingress_gap_ms" in g
                               else "")
                            + (f" (came {g['gap_transport_ms']:.0f}+{g['gap_local_ms']:.0f}ms)"
                               if g.get("gap_transport_ms") is not None else " (own call)" if "gap_transport_ms" in g
                               else "")
                            + (f" made {g['made_gap_ms']:.0f}ms@{g['made_gap_after']} lag {g['loop_lag_ms']:.0f}ms"
                               if "made_gap_ms" in g else "")
                            + (f" held {g['mux_wait_ms']:.0f}ms" if g.get("mux_wait_ms") else "")
                            for g in (trace or {}).get("segments", [])]
                    stats["worst_gaps"].append((round(worst[0], 2), worst[1], segs, rid,  # (rid: its X-Request-Id)
                                                round(worst[2] * 1e3)))
                    stats["worst_gaps"] = sorted(stats["worst_gaps"], reverse=True)[:8]
                if cut is not None:  # (a clear error, but the client had tokens: a request the server gave up)
                    stats["rejected_clear_error"] += 1
                    stats["cut_after_tokens"] += 1
                    stats["cut_examples"] = stats["cut_examples"][-4:] + [
                        {"message": str(cut.get("message"))[:120], "tokens": len(ids), "request_id": rid}]
                    return
        else:
            r = await client.post("/v1/completions", json=body, headers={"X-Request-Id": rid})
            if r.status_code != 200:
                return record_reject(stats, r.status_code, r.content)
            body = r.json()
            ids = body["choices"][0]["token_ids"]
            trace = body.get("keyacc")
        for a, b in zip(*[((trace or {}).get("segments") or [])[i:] for i in (0, 1)]):
            if a.get("failed"):  # where a stream went on after its replica died: "GpuDecode->GpuDecode"
                tally(stats["failovers"], f"{a.get('deployment')}->{b.get('deployment')}")
        checks.append((prompt, n, stream, ids, trace, rid))  # against generate() once the soak is over
    except (httpx.HTTPError, json.JSONDecodeError, KeyError) as e:
        # (what the client had: a stream cut or stalled after some tokens, or a request never answered)
        stats["lost"] += 1
        stats["lost_examples"].append({"error": repr(e)[:80], "stream": stream, "tokens": len(ids), "max_tokens": n,
                                       "after_s": round(time.monotonic() - t0, 1), "request_id": rid,
                                       "router_has_it": await where(rid)})


def verify(checks, ref, stats) -> None:
    """Each completion's tokens against generate()'s, after the soak: computed during it, in this
    client's event loop, each generate() held up every stream's reading for its duration (the
    client's own stalls counted as the server's gaps) and took the server's cores."""
    for prompt, n, stream, ids, trace, rid in checks:
        want = ref(prompt, n)
        if ids == want:
            stats["completed_correct"] += 1
            continue
        # kept for a look: where the tokens part from generate()'s, and the request's path
        at = next((i for i, (a, b) in enumerate(zip(ids, want)) if a != b), min(len(ids), len(want)))
        example = {"prompt": prompt, "max_tokens": n, "stream": stream, "first_difference_at": at,
                   "got_len": len(ids), "want_tokens": len(want), "trace": trace, "request_id": rid}
        part = ref.parting(prompt, want, at, ids) if len(ids) == len(want) and at < len(ids) else None
        if part is not None and part["near_tie"]:  # float32's near-tie: another order of sums may pick either
            stats["completed_near_tie"] += 1
            stats["near_tie_examples"] = stats["near_tie_examples"][-2:] + [{**example, **part}]
        else:
            # what kind of difference: the tokens around it, a token dropped or repeated (a
            # stream's bookkeeping) against a token computed wrong (and whether the server's own
            # continuation of it is generate()'s: one step wrong, its KV right, or KV wrong after)
            example.update(got_around=ids[max(0, at - 2):at + 6], want_around=want[max(0, at - 2):at + 6],
                           shape=shape_of(ids, want, at), **(part or {}))
            stats["completed_wrong"] += 1
            stats["wrong_examples"] = stats["wrong_examples"][-4:] + [example]


def shape_of(got: list[int], want: list[int], at: int) -> str:
    """How `got` parts from `want` at `at`: it ends there ("short", "long"), a token dropped or
    repeated there (the tokens after it shifted by one), two swapped, or other."""
    if at >= len(got) or at >= len(want):
        return "short" if len(got) < len(want) else "long"
    k = min(len(got) - at, len(want) - at - 1)
    if k > 0 and got[at:at + k] == want[at + 1:at + 1 + k]:
        return "dropped"
    k = min(len(got) - at - 1, len(want) - at)
    if k > 0 and got[at + 1:at + 1 + k] == want[at:at + k]:
        return "repeated"
    if at + 1 < min(len(got), len(want)) and (got[at], got[at + 1]) == (want[at + 1], want[at]):
        return "swapped"
    return "other"


def record_reject(stats, status, content):
    try:
        ok = 400 <= status < 600 and status != 500 and "message" in json.loads(content)["error"]
    except Exception:  # noqa: BLE001
        ok = False
    stats["rejected_clear_error" if ok else "lost"] += 1
    if not ok:
        stats["lost_examples"].append(f"{status} {content[:100]!r}")


async def bad(client, rng, stats):
    try:
        r = await client.post("/v1/completions", content=rng.choice(BAD), headers={"content-type": "application/json"})
        body = r.json()
        err = body.get("error") if isinstance(body, dict) else None
        clear = isinstance(err, dict) and "message" in err
        if r.status_code == 503 and clear:  # refused before it was read: the server is full (Retry-After)
            stats["bad_overloaded_503"] += 1
        else:
            stats["bad_rejected_4xx" if 400 <= r.status_code < 500 and clear else "bad_wrong_answer"] += 1
    except (httpx.HTTPError, ValueError, KeyError) as e:
        stats["lost"] += 1
        stats["lost_examples"].append(repr(e)[:120])


async def main_async(args, url):
    from keyacc_ray.bench.loadgen import Workload, closed_loop
    from tests.helpers import float32_parting, hf_greedy, hf_model

    path = str(ROOT / "models" / "tiny-qwen3")
    _, tok = hf_model(path)
    cache = {}

    def ref(prompt, n):
        key = (prompt, n)
        if key not in cache:
            cache[key] = hf_greedy(path, tok(prompt)["input_ids"], n)
        return cache[key]

    def parting(prompt, want, at, got):
        """Where the tokens part (tests.helpers.float32_parting): generate()'s top logit less
        that of the server's token there, whether the rest is generate()'s own continuation from
        it, and whether that makes it a float32 near-tie."""
        return float32_parting(path, tok(prompt)["input_ids"], want, got, at)

    ref.parting = parting

    # capacity on prompts as long as the soak's (with --tiers: a head of ~200 tokens, random here:
    # no cache hits, so the figure errs low)
    wl = Workload(prompt_tokens=200 if args.tiers else 16, output_tokens=36)
    res, wall = await closed_loop(url, "tiny-qwen3", 8, 10, wl)
    capacity = sum(r.ok for r in res) / wall
    rate = args.rate or args.load * capacity  # (--rate: the same offered load for runs to compare)
    print(f"measured capacity {capacity:.1f} req/s; soaking at {rate:.1f} req/s for {args.minutes} min", flush=True)
    stats = {"sent": 0, "completed_correct": 0, "completed_near_tie": 0, "near_tie_examples": [],
             "completed_wrong": 0, "rejected_clear_error": 0, "lost": 0,
             "bad_rejected_4xx": 0, "bad_overloaded_503": 0, "bad_wrong_answer": 0, "kills": 0, "max_stream_gap_s": 0.0,
             "stream_gaps_over_2s": 0, "stream_gaps_over_2s_less_client_lag": 0, "lost_examples": [],
             "worst_gaps": [], "wrong_examples": [], "gaps_over_2s_by_10s": {}, "gaps_over_2s_where": {},
             "server_gaps_by_10s": {}, "server_gaps_where": {}, "kills_at_s": [],
             "cut_after_tokens": 0, "cut_examples": [], "failovers": {},
             "client_loop_lag_max_s": 0.0, "client_loop_lags_over_1s": 0, "t0": time.monotonic()}
    rng = random.Random(args.seed)
    lag_probe = asyncio.create_task(client_lag(stats))
    mem: dict[str, list[int]] = {}
    tasks = set()
    checks: list[tuple] = []  # completions, checked against generate() at the end
    async with httpx.AsyncClient(base_url=url, timeout=120, limits=httpx.Limits(max_connections=512)) as client:
        end = time.monotonic() + args.minutes * 60
        next_kill = time.monotonic() + args.kill_every_s
        next_mem = time.monotonic()
        while time.monotonic() < end:
            stats["sent"] += 1
            if rng.random() < 0.2:
                coro = bad(client, rng, stats)
            else:
                coro = good(client, rng, checks, stats, stream=rng.random() < 0.5, tiers=args.tiers)
            t = asyncio.create_task(coro)
            tasks.add(t)
            t.add_done_callback(tasks.discard)
            # (blocking calls off the event loop: it reads every stream and times their gaps)
            if time.monotonic() > next_kill:
                await asyncio.to_thread(kill_random_replica, rng,
                                        args.kill_only or ("CpuDecode", "GpuDecode", "GpuPrefill"))
                stats["kills"] += 1
                stats["kills_at_s"].append(round(time.monotonic() - stats["t0"], 1))
                next_kill += args.kill_every_s
            if time.monotonic() > next_mem:
                for k, v in (await asyncio.to_thread(ray_processes_rss)).items():
                    mem.setdefault(k, []).append(v)
                next_mem += 10
            await asyncio.sleep(rng.expovariate(rate))
        await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 300)
        lag_probe.cancel()
        stats["blocks_in_use_at_idle"] = await blocks_in_use(client)
    print(f"checking {len(checks)} completions against generate()", flush=True)
    verify(checks, ref, stats)
    return stats, mem


async def client_lag(stats, every_s: float = 0.1) -> None:
    """This client's own event loop lag: a gap the client was too busy to read counts as the
    server's (the soak shares the server's cores). A stall over 2 s with no lag here was the server's."""
    while True:
        t = time.monotonic()
        await asyncio.sleep(every_s)
        lag = time.monotonic() - t - every_s
        stats["client_loop_lag_max_s"] = round(max(stats["client_loop_lag_max_s"], lag), 3)
        stats["client_loop_lags_over_1s"] += lag > 1.0
        if lag > 0.1:
            LAGS.append((time.monotonic(), lag))


LAGS: list[tuple[float, float]] = []  # (when, how long) this client's loop ran late


def tally(counts: dict, key: str) -> None:
    counts[key] = counts.get(key, 0) + 1


def window(stats: dict, t: float) -> str:
    """The 10 s window of the soak that `t` falls in ("0", "10", ...)."""
    return str(int((t - stats["t0"]) // 10) * 10)


def client_share(start: float, end: float) -> float:
    """Seconds of [start, end] this client's own loop was late (too busy to read anything)."""
    return sum(max(0.0, min(end, t) - max(start, t - lag)) for t, lag in LAGS if t > start and t - lag < end)


async def blocks_in_use(client, settle_s: float = 20.0) -> dict:
    """Once the server is idle: per replica, KV blocks not free (must be none: cached blocks
    nobody holds count as free), after the replicas' next load reports."""
    deadline = time.monotonic() + settle_s
    while True:
        text = (await client.get("/metrics")).text
        got: dict[str, dict] = {}
        for line in text.splitlines():
            for name in ("keyacc_free_kv_blocks", "keyacc_total_kv_blocks", "keyacc_running_sequences"):
                if line.startswith(name + "{"):
                    labels, value = line[len(name):].rsplit(" ", 1)
                    got.setdefault(labels, {})[name] = float(value)
        busy = {k: v for k, v in got.items()
                if v.get("keyacc_free_kv_blocks") != v.get("keyacc_total_kv_blocks")}
        if not busy or time.monotonic() > deadline:
            return busy
        await asyncio.sleep(1.0)


def kill_random_replica(rng, deployments=("CpuDecode", "GpuDecode", "GpuPrefill")):
    import ray

    names = [a for a in ray.util.list_named_actors(all_namespaces=True) if a["name"].startswith("SERVE_REPLICA::")
             and any(f"#{d}#" in a["name"] for d in deployments)]
    if names:
        a = rng.choice(names)
        print(f"  killing {a['name']}", flush=True)
        ray.kill(ray.get_actor(a["name"], namespace=a["namespace"]), no_restart=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--minutes", type=float, default=3)
    ap.add_argument("--kill-every-s", type=float, default=40)
    ap.add_argument("--load", type=float, default=2.0, help="offered requests/s as a multiple of the measured capacity")
    ap.add_argument("--rate", type=float, default=None,
                    help="offered requests/s, instead of --load times the capacity measured at the start")
    ap.add_argument("--policy", default="auto")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--port", type=int, default=8041)
    ap.add_argument("--tiers", action="store_true",
                    help="shared prompt heads, a small emulated GPU block pool, host and disk KV tiers")
    ap.add_argument("--no-prefix-caching", action="store_true", help="with --tiers: the same load, caching off")
    ap.add_argument("--node-tier", action="store_true",
                    help="with --tiers: the node's shared KV tier under both pools too (a directory of this run's own)")
    ap.add_argument("--client-nice", type=int, default=0, metavar="N",
                    help="this client's event-loop thread at nice N (negative: ahead of the server's processes, "
                         "root only), so that it reads streams when they come on a box it shares with the server")
    ap.add_argument("--kill-only", nargs="+", metavar="DEPLOYMENT", default=None,
                    help="kill replicas of these deployments only (e.g. CpuDecode)")
    ap.add_argument("--no-mux", action="store_true", help="one Serve stream per hop (stream_mux: false)")
    ap.add_argument("--gpu-engine", type=json.loads, default={}, metavar="JSON",
                    help='engine settings for the GPU pool, over the soak\'s (e.g. \'{"kv_allocation": "reserve"}\')')
    ap.add_argument("--cpu-engine", type=json.loads, default={}, metavar="JSON", help="the same for the CPU pool")
    ap.add_argument("--policy-options", type=json.loads, default={},
                    help='more policy options, JSON (e.g. \'{"cpu_reserved_places": 4}\')')
    args = ap.parse_args()
    import ray
    from ray import serve

    from keyacc_ray.serve.app import apply_cluster_env, build_app

    apply_cluster_env()
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    serve.start(http_options={"host": "127.0.0.1", "port": args.port})
    cfg = {"model": str(ROOT / "models" / "tiny-qwen3"), "max_model_len": 512, "policy": args.policy,
           "policy_options": {"trigger_window_s": 0.2, "return_window_s": 1.0, **args.policy_options},
           "stream_mux": not args.no_mux}
    if args.tiers:  # tiny-qwen3: 8 KiB a block; the GPU pool holds 40 (about 2 prompts with a head)
        tiers = {"kv_host_tier_gb": 64 * 8192 / 2**30, "kv_disk_tier_gb": 4096 * 8192 / 2**30,
                 "enable_prefix_caching": not args.no_prefix_caching}
        if args.node_tier:
            node_dir = tempfile.mkdtemp(prefix="keyacc-soak-node-",
                                        dir="/dev/shm" if os.access("/dev/shm", os.W_OK) else None)
            tiers.update(kv_node_tier_gb=1024 * 8192 / 2**30, kv_node_tier_dir=node_dir)
        cfg["gpu"] = {"device": "auto", "max_num_seqs": 8, "num_kv_blocks": 40, **tiers}
        cfg["cpu"] = {"device": "cpu", "max_num_seqs": 16, "num_kv_blocks": 160, **tiers}
    cfg["gpu"] = {**cfg.get("gpu", {}), "kv_growth_reserve": True}  # (deployments/app.yaml's)
    for pool, extra in (("gpu", args.gpu_engine), ("cpu", args.cpu_engine)):
        if extra:
            cfg[pool] = {**cfg.get(pool, {}), **extra}
    serve.run(build_app(cfg), name="keyacc", route_prefix="/")
    if args.client_nice:  # (Linux: this thread only; Ray's own threads in this process keep theirs)
        os.setpriority(os.PRIO_PROCESS, 0, args.client_nice)
    stats, mem = asyncio.run(main_async(args, f"http://127.0.0.1:{args.port}"))
    stats["lost_examples"] = stats["lost_examples"][:12]
    del stats["t0"]
    # first, middle and last samples: growth that stops by the middle is warm-up; growth that
    # continues through the second half is what a leak looks like
    growth = {k: {"first_mib": v[0] >> 20, "mid_mib": v[len(v) // 2] >> 20, "peak_mib": max(v) >> 20,
                  "last_mib": v[-1] >> 20} for k, v in mem.items() if len(v) >= 3}
    for k, v in sorted(growth.items()):
        print(f"  {k:<60} first {v['first_mib']:>5} MiB  mid {v['mid_mib']:>5}  peak {v['peak_mib']:>5}  "
              f"last {v['last_mib']:>5}")
    for k, v in stats.items():
        print(f"{k:<22} {v}")
    print(json.dumps({**stats, "memory": growth}))
    serve.shutdown()
    ray.shutdown()
    if args.tiers and args.node_tier:
        shutil.rmtree(cfg["gpu"]["kv_node_tier_dir"], ignore_errors=True)


if __name__ == "__main__":
    main()
