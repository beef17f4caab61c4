"""Simulated traffic: requests with prompt and output lengths, arriving closed-loop (N clients,
each sending its next request when the last one ends), as a Poisson process, in bursts, or from
a trace (arrival time, prompt tokens, output tokens per line). Seeded: the same seed, the same
requests."""
from __future__ import annotations

import json
import random
from dataclasses import dataclass


@dataclass
class SimRequest:
    rid: str
    prompt_tokens: int
    output_tokens: int  # what it generates (it stops then, as at an end-of-sequence token)
    max_tokens: int  # what it asks for (the router's KV estimate reads it)
    arrival: float = 0.0
    client: int | None = None  # closed loop: the client that sends it
    route: str | None = None  # a client's pin (keyacc.route): "gpu", "cpu" or "stage"


@dataclass
class Workload:
    """`kind`: closed (`clients` clients, `requests_per_client` each), poisson (`rate` per second
    for `duration_s`), bursty (`burst` requests every `period_s` for `duration_s`) or trace
    (`trace`: a JSON-lines file of {"arrival", "prompt_tokens", "output_tokens"})."""

    kind: str = "closed"
    clients: int = 16
    requests_per_client: int = 4
    rate: float = 4.0
    burst: int = 32
    period_s: float = 10.0
    duration_s: float = 60.0
    prompt_tokens: tuple[int, int] = (128, 512)  # uniform range
    output_tokens: tuple[int, int] = (64, 256)
    max_tokens: int | None = None  # None: the output length (a client that knows it); else this
    trace: str | None = None
    seed: int = 0

    def requests(self) -> list[SimRequest]:
        rng = random.Random(self.seed)

        def one(i: int, arrival: float, client: int | None = None) -> SimRequest:
            p = rng.randint(*self.prompt_tokens)
            o = rng.randint(*self.output_tokens)
            return SimRequest(f"r{i}", p, o, max(o, self.max_tokens or o), arrival, client)

        if self.kind == "closed":
            return [one(c * self.requests_per_client + k, 0.0, c) for c in range(self.clients)
                    for k in range(self.requests_per_client)]
        if self.kind == "poisson":
            out, t = [], 0.0
            while True:
                t += rng.expovariate(self.rate)
                if t > self.duration_s:
                    return out
                out.append(one(len(out), t))
        if self.kind == "bursty":
            return [one(b * self.burst + k, b * self.period_s) for b in range(int(self.duration_s // self.period_s) + 1)
                    for k in range(self.burst)]
        if self.kind == "trace":
            out = []
            with open(self.trace) as f:
                for i, line in enumerate(x for x in f if x.strip()):
                    d = json.loads(line)
                    out.append(SimRequest(f"r{i}", int(d["prompt_tokens"]), int(d["output_tokens"]),
                                          int(d.get("max_tokens", d["output_tokens"])), float(d["arrival"])))
            return out
        raise ValueError(f"unknown workload kind {self.kind!r}")
