"""Randomised requests, each sent down every route at once: the outputs must be the same.

"Same tokens wherever a request ran" checked on combinations of parameters no hand-written test
makes together: each case is a random prompt (text or token ids) with random sampling settings
(greedy, or seeded temperature with top-p / top-k / min-p), penalties, a logit bias, min_tokens,
stop strings, logprobs, echo, n, and is sent pinned to `gpu`, `cpu`, `stage`, and `stage` and
`cpu` with `migrate_back_after` (two hand-offs), plus once more streamed on one of those routes,
and optionally unpinned copies that go where the server's policy sends them. `api="chat"` (or
"both") makes chat cases instead (`chat_fuzz.py`: conversations with tools, tool choices,
response formats, structured outputs, top logprobs).
Every answer must equal the first one: the text, token ids, finish reason and logprob tokens of
each choice exactly, the logprob values within `LOGPROB_TOL`, and the usage counts; an error must
be the same error everywhere. Several cases run at once, so the pools batch, preempt and hand off
under each other's load. Exact equality is a float32 property; a bf16 model diverges at near-ties
(the tie-aware rule), which this does not judge.

Needs a server with route pinning allowed (`allow_route_pinning`, on by default). Plain Python and
httpx; `scripts/fuzz_routes.py` is its command line."""
from __future__ import annotations

import concurrent.futures as cf
import json
import random
from dataclasses import dataclass, field

import httpx

LOGPROB_TOL = 1e-3
WORDS = ("the of and to in is you that it he was for on are as with his they I at be this have from or one had by "
         "word but not what all were we when your can said there use an each which she do how their if will up "
         "other about out many then them these so some her would make like him into time has look two more write go "
         "see number no way could people my than first water been call who its now find long down day did get come "
         "made may part").split()


@dataclass
class Mismatch:
    case: int
    route: dict
    stream: bool
    params: dict
    prompt: object
    got: object
    want: object

    def to_dict(self) -> dict:
        return {"case": self.case, "route": self.route, "stream": self.stream, "params": self.params,
                "prompt": self.prompt, "got": self.got, "want": self.want}


@dataclass
class Report:
    cases: int = 0
    requests: int = 0
    errors: int = 0  # cases every route refused alike (a bad combination: the same 4xx everywhere)
    refusals: list = field(default_factory=list)  # (case, the first route's error) of those
    mismatches: list[Mismatch] = field(default_factory=list)


def random_sampling(rng: random.Random, vocab: int, greedy_only: bool = False) -> dict:
    """Random sampling settings (greedy, or seeded temperature with top-p / top-k / min-p, n),
    penalties and a logit bias: the part both kinds of case (completions, chat) draw alike."""
    p: dict = {}
    p["temperature"] = 0 if greedy_only else rng.choice([0, 0, 0.7, 1.3])
    if p["temperature"] > 0:
        p["seed"] = rng.randrange(1 << 30)
        if rng.random() < 0.4:
            p["top_p"] = rng.choice([0.5, 0.9, 0.95])
        if rng.random() < 0.4:
            p["top_k"] = rng.choice([1, 5, 20, 50])
        if rng.random() < 0.2:
            p["min_p"] = rng.choice([0.05, 0.1])
        if rng.random() < 0.3:
            p["n"] = rng.randint(2, 3)
    if rng.random() < 0.25:
        p["presence_penalty"] = rng.choice([-0.5, 0.5, 1.5])
    if rng.random() < 0.25:
        p["frequency_penalty"] = rng.choice([-0.5, 0.5, 1.0])
    if rng.random() < 0.25:
        p["repetition_penalty"] = rng.choice([0.9, 1.1, 1.3])
    if rng.random() < 0.2:
        p["logit_bias"] = {str(rng.randrange(5, vocab)): rng.choice([-100, -5, 5, 100]) for _ in range(rng.randint(1, 4))}
    return p


def random_case(rng: random.Random, vocab: int, max_prompt: int = 200, greedy_only: bool = False) -> tuple:
    """(prompt, params) of one case."""
    if rng.random() < 0.3:
        prompt = [rng.randrange(5, vocab) for _ in range(rng.randint(1, max_prompt))]
    else:
        prompt = " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, max_prompt * 3 // 4)))
    p: dict = {"max_tokens": rng.randint(1, 60)}
    p.update(random_sampling(rng, vocab, greedy_only))
    if rng.random() < 0.2:
        p["min_tokens"] = rng.randint(0, p["max_tokens"])
    if rng.random() < 0.3:
        p["ignore_eos"] = True
    if rng.random() < 0.2:
        p["stop"] = [rng.choice(WORDS) for _ in range(rng.randint(1, 3))]
    if rng.random() < 0.3:
        p["logprobs"] = rng.choice([0, 1, 3])
    if rng.random() < 0.1:
        p["echo"] = True
    return prompt, p


def routes_for(rng: random.Random, max_tokens: int, unpinned: int = 0) -> list[dict]:
    """The pinned routes, then `unpinned` copies with no pin ({}: where the policy sends it)."""
    k = rng.randint(1, max(1, max_tokens - 1))
    return [{"route": "gpu"}, {"route": "cpu"}, {"route": "stage"},
            {"route": "stage", "migrate_back_after": k}, {"route": "cpu", "migrate_back_after": k}] + [{}] * unpinned


def _choices(items: dict) -> list:
    return [items[k] for k in sorted(items)]


def complete(client: httpx.Client, base: str, body: dict):
    """One request's comparable answer: (per choice (text, ids, finish, logprob tokens, logprob
    values), completion tokens, prompt tokens), or ("error", status, body) for a refusal."""
    if not body["stream"]:
        r = client.post(f"{base}/v1/completions", json=body)
        if r.status_code != 200:
            return ("error", r.status_code, r.json())
        j = r.json()
        out = {c["index"]: (c["text"], c.get("token_ids"), c["finish_reason"], (c.get("logprobs") or {}).get("tokens"),
                            (c.get("logprobs") or {}).get("token_logprobs")) for c in j["choices"]}
        return (_choices(out), j["usage"]["completion_tokens"], j["usage"]["prompt_tokens"])
    events = sse_events(client, f"{base}/v1/completions", body)
    if isinstance(events, tuple):  # ("error", status, body)
        return events
    text: dict = {}
    ids: dict = {}
    fin: dict = {}
    toks: dict = {}
    lps: dict = {}
    for j in events:
        for c in j["choices"]:
            k = c["index"]
            text[k] = text.get(k, "") + c["text"]
            ids.setdefault(k, []).extend(c.get("token_ids") or [])
            fin[k] = c.get("finish_reason") or fin.get(k)
            if c.get("logprobs"):
                toks.setdefault(k, []).extend(c["logprobs"].get("tokens") or [])
                lps.setdefault(k, []).extend(c["logprobs"].get("token_logprobs") or [])
    out = {k: (text[k], ids.get(k), fin.get(k), toks.get(k), lps.get(k)) for k in text}
    return (_choices(out), *usage_of(events))


def sse_events(client: httpx.Client, url: str, body: dict):
    """A streamed answer's events, parsed (the list), or ("error", status, body) for a refusal
    or an error event in the stream."""
    events = []
    with client.stream("POST", url, json=body) as r:
        if r.status_code != 200:
            return ("error", r.status_code, json.loads(r.read()))
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            j = json.loads(line[6:])
            if "error" in j:
                return ("error", "in stream", j)
            events.append(j)
    return events


def usage_of(events: list) -> tuple:
    """(completion tokens, prompt tokens) of a stream's last usage, or (None, None)."""
    usage = next((j["usage"] for j in reversed(events) if j.get("usage")), None)
    return (usage and usage["completion_tokens"], usage and usage["prompt_tokens"])


def _near(x, y) -> bool:
    """Logprob values (a list of floats or None, or a list of such lists) within LOGPROB_TOL."""
    if (x is None) != (y is None):  # a choice with logprobs over no tokens: null in one answer, absent in a stream
        return not (x or y)
    if x is None:
        return True
    if isinstance(x, (int, float)) or isinstance(y, (int, float)):
        return isinstance(x, (int, float)) and isinstance(y, (int, float)) and abs(x - y) <= LOGPROB_TOL
    return len(x) == len(y) and all(_near(a, b) for a, b in zip(x, y))


def same(got, want) -> bool:
    """Per choice the first four fields exactly (text or content, token ids or tool calls, finish
    reason, logprob tokens), the rest (logprob values) within LOGPROB_TOL; the usage exactly."""
    if got[0] == "error" or want[0] == "error":
        return got == want
    if got[1:] != want[1:] or len(got[0]) != len(want[0]):
        return False
    for a, b in zip(got[0], want[0]):
        if a[:4] != b[:4] or len(a) != len(b) or not all(_near(x, y) for x, y in zip(a[4:], b[4:])):
            return False
    return True


def run(base: str, model: str, vocab: int, cases: int, seed: int = 0, concurrent_cases: int = 3,
        greedy_only: bool = False, timeout_s: float = 300, log=None, unpinned: int = 0, api: str = "completions") -> Report:
    """`cases` random cases against the server at `base` serving `model` (token ids below
    `vocab`), `concurrent_cases` at a time; `unpinned` more copies of each go where the server's
    policy sends them (with enough cases at once, some move between the pools). `api`:
    "completions", "chat" (`chat_fuzz`: conversations, tools, structured outputs) or "both"
    (alternate cases)."""
    from keyacc_ray.bench import chat_fuzz

    rng = random.Random(seed)
    plan = []
    for case in range(cases):
        chat = api == "chat" or (api == "both" and case % 2 == 1)
        if chat:
            msgs, params = chat_fuzz.random_case(rng, vocab, WORDS, greedy_only=greedy_only)
            body = {**params, "messages": msgs}
        else:
            prompt, params = random_case(rng, vocab, greedy_only=greedy_only)
            body = {**params, "prompt": prompt, "return_token_ids": True}
        routes = routes_for(rng, params["max_tokens"], unpinned)
        plan.append((case, chat, body, [(r, False) for r in routes] + [(rng.choice(routes), True)]))
    report = Report()
    with httpx.Client(timeout=timeout_s) as client, \
            cf.ThreadPoolExecutor(concurrent_cases * (6 + unpinned)) as pool, cf.ThreadPoolExecutor(concurrent_cases) as outer:
        def one(job):
            chat, body, (route, stream) = job
            body = {**body, "model": model, "stream": stream}
            if route:
                body["keyacc"] = route
            if stream:
                body["stream_options"] = {"include_usage": True}
            return (chat_fuzz.ask if chat else complete)(client, base, body)

        def one_case(c):
            _, chat, body, jobs = c
            return c, list(pool.map(one, [(chat, body, j) for j in jobs]))

        for (case, chat, body, jobs), outs in outer.map(one_case, plan):
            report.cases += 1
            report.requests += len(outs)
            want = outs[0]
            if all(o[0] == "error" for o in outs):
                report.errors += 1
                report.refusals.append((case, want))
            prompt = body.get("messages") if chat else body["prompt"]
            params = {k: v for k, v in body.items() if k not in ("messages", "prompt")}
            for (route, stream), got in zip(jobs[1:], outs[1:]):
                if not same(got, want):
                    m = Mismatch(case, route, stream, params, prompt, got, want)
                    report.mismatches.append(m)
                    if log:
                        log(json.dumps(m.to_dict())[:2000])
    return report
