"""Token sampling, the whole batch at once.

Greedy rows take one batched argmax. Sampled rows go through a few batched tensor ops on the
logits' device: temperature; top-k (ties with the k-th value kept, as vLLM) on the candidates of
one batched top-k; min-p; top-p on the candidates in descending order (rows with top-p and no
top-k take the 256 likeliest tokens, and widen only where those hold less than top-p); then one
uniform draw per row inverted through the cumulative distribution of the candidates in token-id
order. Top-p keeps the likeliest tokens until their mass reaches top_p, and every token exactly as
likely as the one that reaches it (ties kept, as top-k keeps them). One device-to-host copy of
the sampled ids per step. Rows with penalties, a logit bias or min_tokens have their logits
adjusted first, all of them in a few flat index operations (`engine/penalties.py`).

On CPU, where the C++ kernels are built, the filters and the draw run in one kernel call for the
batch (`keyacc_ray/kernels/csrc/sampling.cpp`: a selection per row instead of torch's CPU topk and
sort); the torch path below is the same rule, run on CUDA and compared with the kernel in the tests.

The draw (the rule since the paged engine): the uniform number for a token is a hash of the
request's seed and the token's position in the sequence (splitmix64), not the state of a
generator. So a seeded request draws the same tokens whatever else is in the batch, on any
device, after any hand-off or recomputation: nothing but the seed travels in a KV package.
Unseeded requests get a random seed when they arrive.
"""
from __future__ import annotations

import operator
import random

import numpy as np
import torch

from keyacc_ray.engine import penalties
from keyacc_ray.engine.request import SamplingParams
from keyacc_ray.errors import InvalidRequest

CANDIDATES = 256  # tokens taken for a top-p row without top-k before widening

_M1, _M2, _GOLD = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB), np.uint64(0x9E3779B97F4A7C15)


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finalizer over uint64 arrays (wrapping arithmetic)."""
    with np.errstate(over="ignore"):
        x = x + _GOLD
        x = (x ^ (x >> np.uint64(30))) * _M1
        x = (x ^ (x >> np.uint64(27))) * _M2
        return x ^ (x >> np.uint64(31))


_MASK = 2**64 - 1


def _mix_int(x: int) -> int:
    """_mix for one Python int (a few rows: cheaper than numpy's per-call overhead)."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK
    return x ^ (x >> 31)


def uniforms(seeds: list[int], positions: list[int]) -> np.ndarray:
    """One uniform number in [0, 1) per (seed, position): the draw for that token."""
    if len(seeds) <= 16:
        return np.array([(_mix_int(_mix_int(s % 2**64) ^ p) >> 11) * 2.0 ** -53 for s, p in zip(seeds, positions)])
    s = np.array([x % 2**64 for x in seeds], dtype=np.uint64)
    return _draws(_mix(s), np.array(positions, dtype=np.uint64))


def _draws(premixed: np.ndarray, positions: np.ndarray) -> np.ndarray:
    """uniforms() from the seeds already through _mix once (uint64 arrays)."""
    return (_mix(premixed ^ positions) >> np.uint64(11)).astype(np.float64) * 2.0 ** -53


class _Plan:
    """What sampling needs from a batch's rows, kept while the batch is the same requests in the
    same order with the same parameters (a decode batch, step after step): per-row flags, which
    rows process logits (of which those with penalties, a bias or min_tokens, and their
    histories), which are greedy, and the sampled rows' parameters as arrays and their seeds
    premixed for the draw. Built again whenever the batch changes (a few µs a row); kept,
    a step's sampling costs no Python per row but the check that it still holds."""

    __slots__ = ("ids", "params", "flags", "proc", "adjusted", "histories", "adjustments", "rows", "greedy",
                 "kernel_rows", "seeds", "kernel_args")

    def __init__(self, request_ids: list[str], params: list[SamplingParams], info: dict, seeds: dict,
                 histories: dict):
        self.ids, self.params = list(request_ids), list(params)
        self.flags = [f if (f := info.get(r)) is not None and f[0] is p else _info(p)
                      for r, p in zip(request_ids, params)]
        self.proc = [i for i, f in enumerate(self.flags) if f[2]]
        self.adjusted = [i for i in self.proc if params[i].adjusts_logits]
        self.histories = [histories.get(request_ids[i]) or histories.setdefault(request_ids[i], penalties.History())
                          for i in self.adjusted]
        self.adjustments: penalties.Adjustments | None = None  # (made at the first step, with the end ids)
        self.rows = [i for i, f in enumerate(self.flags) if not f[1]]
        self.greedy = [i for i, f in enumerate(self.flags) if f[1]]
        self.kernel_rows = kernel_rows([self.flags[i][3] for i in self.rows]) if self.rows else None
        self.seeds = (_mix(np.array([seeds[request_ids[i]] for i in self.rows], dtype=np.uint64))
                      if self.rows else None)
        self.kernel_args = None  # (vocabulary, the CPU kernel's arguments for the sampled rows)

    def holds_for(self, request_ids: list[str], params: list[SamplingParams]) -> bool:
        return self.ids == request_ids and all(map(operator.is_, self.params, params))

    def kernel_draw(self, kernels, x: torch.Tensor, positions) -> torch.Tensor:
        """kernel_sample_rows for the sampled rows (x: their logits), the uniforms made in the
        kernel from the premixed seeds and the positions (all rows' given): the batch's
        arguments made once, not every step."""
        vocab = x.shape[1]
        ka = self.kernel_args
        if ka is None or ka[0] != vocab:
            temp, k, top_p, min_p = self.kernel_rows
            k = np.where(k >= vocab, 0, k)
            ka = self.kernel_args = (vocab, temp, torch.from_numpy(k), top_p, min_p,
                                     torch.from_numpy(self.seeds.view(np.int64)), bool(k.all()))
        _, temp, k, top_p, min_p, seeds, every_top_k = ka
        p = np.asarray(positions, dtype=np.int64)
        if len(self.rows) < len(p):
            p = p[self.rows]
        xf = x.float()
        e = torch.empty(0) if every_top_k else _exp(xf, temp)
        return kernels.sample_rows_seeded(xf, temp, k, top_p, min_p, seeds, torch.from_numpy(p), e)

    def uniforms(self, positions: list[int]) -> np.ndarray:
        """uniforms() of the sampled rows at these positions (all rows' positions given)."""
        p = np.array(positions, dtype=np.uint64)
        if len(self.rows) < len(positions):
            p = p[self.rows]
        return _draws(self.seeds, p)


class Sampler:
    def __init__(self, kernels=None, grammars=None):
        """`kernels`: the compiled CPU kernels (keyacc_ray.kernels.load()), used for rows on the CPU.
        `grammars`: the engine's structured.Grammars (requests with a grammar need one)."""
        self._kernels = kernels if kernels is not None and hasattr(kernels, "argmax_rows") else None
        self.grammars = grammars
        self._seeds: dict[str, int] = {}
        self._drawn: dict[str, int] = {}  # draws so far, for callers that give no positions
        self._info: dict[str, tuple] = {}  # request id -> (its params, greedy, processes logits)
        # request id -> what its penalties read of its tokens, kept up to date as they grow (rebuilt
        # from the whole history every step, the repetition penalty cost about 0.6 ms a row at
        # 1000 tokens)
        self._history: dict[str, penalties.History] = {}
        self._plan: _Plan | None = None

    def add(self, request_id: str, params: SamplingParams, state: np.ndarray | None = None) -> None:
        """A request arrives (its grammar's matcher made first: an InvalidRequest if it does not
        compile for this model, and nothing is kept)."""
        if params.grammar is not None:
            if self.grammars is None:
                raise InvalidRequest("structured outputs are not available on this engine", param="grammar")
            self.grammars.add(request_id, params.grammar)
        if state is not None:  # from a KV package: the seed the request has drawn with so far
            seed = int(np.asarray(state, dtype=np.uint64).reshape(-1)[0])
        else:
            seed = params.seed if params.seed is not None else random.SystemRandom().getrandbits(63)
        self._seeds[request_id] = seed % 2**64
        self._drawn[request_id] = 0
        self._info[request_id] = _info(params)
        self._plan = None

    def remove(self, request_id: str) -> None:
        self._plan = None
        self._seeds.pop(request_id, None)
        self._drawn.pop(request_id, None)
        self._info.pop(request_id, None)
        self._history.pop(request_id, None)
        if self.grammars is not None:
            self.grammars.remove(request_id)

    def state(self, request_id: str) -> np.ndarray:
        return np.array([self._seeds[request_id]], dtype=np.uint64)

    def sample(self, logits: torch.Tensor, request_ids: list[str], params: list[SamplingParams],
               history=None, positions: list[int] | None = None, keep_logits: bool = True,
               to_host: bool = True) -> list[int] | torch.Tensor:
        """logits: [B, vocab] on any device; returns one token id per row. `history(row)` gives a
        row's (token ids so far, number of prompt tokens, end-of-sequence ids), read only for rows
        whose logits are processed (penalties, logit bias, min_tokens, a grammar). `positions`: each row's
        new token's position in its sequence (what its draw is keyed by); without them, the
        number of draws the request has made here. `keep_logits=False`: the caller reads `logits`
        no more (no logprobs), so rows whose logits are processed are processed in place in a
        float32 `logits` (a batch-by-vocabulary copy saved). `to_host=False`: the ids stay on the
        logits' device (a tensor; asynchronous scheduling feeds them to the next step there)."""
        plan = self._plan
        if plan is None or not plan.holds_for(request_ids, params):
            plan = self._plan = _Plan(request_ids, params, self._info, self._seeds, self._history)
        flags, proc, rows = plan.flags, plan.proc, plan.rows
        if proc:
            if logits.dtype != torch.float32:
                logits = logits.float()
            elif keep_logits:
                logits = logits.clone()
            if plan.adjusted:  # penalties, a logit bias, min_tokens: every such row at once
                for i, h in zip(plan.adjusted, plan.histories):
                    tokens, num_prompt, eos_ids = history(i)
                    h.update(tokens, num_prompt, params[i])
                if plan.adjustments is None:
                    plan.adjustments = penalties.Adjustments(plan.adjusted, [params[i] for i in plan.adjusted], eos_ids)
                plan.adjustments.apply(logits, plan.histories, self._kernels)
            constrained = []  # (row, (request id, grammar, output so far)), eos ids
            for i in proc:
                p = params[i]
                if p.grammar is not None:
                    tokens, num_prompt, eos_ids = history(i)
                    constrained.append((i, (request_ids[i], p.grammar, tokens[num_prompt:])))
            if constrained:
                logits = self._mask(logits, constrained, eos_ids)
        if len(rows) < len(params):
            greedy = plan.greedy
            g = _take(logits, greedy)
            out = (self._kernels.argmax_rows(g) if self._kernels is not None and g.device.type == "cpu"
                   else g.argmax(dim=-1))
            if rows:
                out = torch.empty(len(params), dtype=torch.long, device=logits.device).index_copy_(
                    0, to_dev(greedy, logits.device), out)
        if positions is None:  # callers that keep no positions: the draws made here
            positions = [self._drawn[r] for r in request_ids]
            for r in request_ids:
                self._drawn[r] += 1
        if rows:
            if self._kernels is not None and logits.device.type == "cpu":
                got = plan.kernel_draw(self._kernels, _take(logits, rows), positions)
            else:
                got = sample_rows(_take(logits, rows), [params[i] for i in rows], plan.uniforms(positions))
            if len(rows) == len(params):
                out = got
            else:
                out[to_dev(rows, logits.device)] = got
        return host_list(out) if to_host else out

    def _mask(self, logits: torch.Tensor, constrained: list, eos_ids) -> torch.Tensor:
        """The grammar rows' logits with every token their grammar does not allow at -inf (all at
        once: one bitmask for the rows, one masked fill). A row left with nothing (its grammar
        complete while min_tokens forbids the end) may still end: end of sequence is let through."""
        rows = [i for i, _ in constrained]
        allowed = torch.from_numpy(self.grammars.allowed([c for _, c in constrained], logits.shape[1]))
        idx = torch.tensor(rows, device=logits.device)
        sub = logits.index_select(0, idx).masked_fill_(~allowed.to(logits.device), float("-inf"))
        dead = ~torch.isfinite(sub).any(dim=-1)
        if bool(dead.any()) and eos_ids:
            ends = torch.tensor(sorted(eos_ids), device=logits.device)
            sub[dead.nonzero()[:, 0][:, None], ends[None]] = 0.0
        return logits.index_copy_(0, idx, sub)

    @staticmethod
    def logprobs(logits: torch.Tensor, token_ids: list[int], num_top: list[int], ranks: bool = False) -> list[tuple]:
        """For each row: (log-probability of token_ids[row], [(id, logprob) of its num_top[row]
        most likely tokens]), under the model's own distribution (log-softmax of the raw logits);
        with `ranks`, a third element: token_ids[row]'s rank in it (1: the most likely)."""
        lp = torch.log_softmax(logits.float(), dim=-1)
        chosen_t = lp.gather(1, torch.tensor(token_ids, device=lp.device)[:, None])
        chosen = chosen_t[:, 0].tolist()
        top_v, top_i = lp.topk(max(num_top), dim=-1)
        top_v, top_i = top_v.tolist(), top_i.tolist()
        out = [(chosen[r], list(zip(top_i[r][:n], top_v[r][:n]))) for r, n in enumerate(num_top)]
        if ranks:
            rank = ((lp > chosen_t).sum(dim=-1) + 1).tolist()
            out = [(*e, rank[r]) for r, e in enumerate(out)]
        return out



_rings: dict = {}  # device -> HostCopy.ring(): the synchronous path's way to the host


def host_list(t: torch.Tensor) -> list[int]:
    """The step's one device-to-host copy: on CUDA non-blocking into pinned memory, then a wait on
    an event recorded after it that blocks (the engine thread sleeps while the GPU finishes the
    step, instead of spinning on a core as a plain `.tolist()`'s synchronous copy does)."""
    if t.device.type != "cuda":
        return t.tolist()
    return HostCopy(t, _rings.setdefault(t.device, HostCopy.ring())).wait()


class HostCopy:
    """A device tensor's copy to the host, started now and read later (`wait`): asynchronous
    scheduling starts step n's copy, launches step n+1, then reads step n's ids. On CUDA a
    non-blocking copy into one of the two pinned buffers of `ring` (the caller's own, from
    `HostCopy.ring()`), used in turn (one step's copy in flight while the previous one is read: at
    most two of a ring's copies may be unread at a time), with an event recorded after it;
    elsewhere the tensor itself."""

    @staticmethod
    def ring() -> list:
        """[the next buffer's index, [(pinned buffer, blocking event) or None] * 2]."""
        return [0, [None, None]]

    def __init__(self, t: torch.Tensor, ring: list):
        self.n = t.numel()
        self._event = None
        if t.device.type != "cuda":
            self._host = t
            return
        k = ring[0]
        ring[0] ^= 1
        got = ring[1][k]
        if got is None or got[0].numel() < self.n or got[0].dtype != t.dtype:
            got = ring[1][k] = (torch.empty(max(self.n, 1024), dtype=t.dtype, pin_memory=True),
                                torch.cuda.Event(blocking=True))
        self._host, self._event = got
        self._host[:self.n].copy_(t.reshape(-1), non_blocking=True)
        self._event.record()

    def wait(self) -> list[int]:
        if self._event is not None:
            self._event.synchronize()
        return self._host[:self.n].tolist()


def to_dev(data, device: torch.device, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A small host list or array on `device`. On CUDA through pinned memory, without a wait: a
    plain copy from pageable memory synchronises the stream (the host would wait for all the GPU
    work queued before it, which defeats asynchronous scheduling)."""
    t = torch.as_tensor(data, dtype=dtype)
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def _take(x: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """x's rows `rows` (x itself when they are all of them: a vocabulary-wide copy saved; the
    index through to_dev: a Python list as an index is a synchronising copy on CUDA)."""
    return x if len(rows) == x.shape[0] else x.index_select(0, to_dev(rows, x.device))


def sample_rows(x: torch.Tensor, params: list[SamplingParams], u: np.ndarray) -> torch.Tensor:
    """Sampled token ids [rows] (on x's device) for logits x [rows, vocab], one uniform draw per
    row, in vLLM's order: temperature, top-k, min-p, top-p. Batched: no per-row host work but
    for the rare rows whose candidates must widen. Vocabulary-wide work only where the filters
    need it: a top-k row is reduced to its candidates before anything else (temperature does not
    change which tokens are the k best)."""
    dev, (n, vocab) = x.device, x.shape
    out = torch.empty(n, dtype=torch.long, device=dev)
    plain = [i for i, p in enumerate(params) if not _top_k(p, vocab) and p.top_p >= 1.0]
    if plain:  # no filter but min-p: the whole vocabulary, in token-id order (the draw needs no normalising)
        probs = _min_p(_exp(_take(x, plain), [params[i].temperature for i in plain]), [params[i].min_p for i in plain])
        got = _draw(probs, None, u[plain])
        if len(plain) == n:
            return got
        out[to_dev(plain, dev)] = got
    plain_rows = set(plain)
    part = [i for i in range(n) if i not in plain_rows]
    probs, ids = _candidates(_take(x, part), [params[i] for i in part])
    tp = to_dev([params[i].top_p for i in part], dev, probs.dtype)
    keep = probs >= _top_p_threshold(probs, tp)  # candidates in descending order; ties kept
    ids, order = torch.sort(ids, dim=-1)  # the draw walks them in token-id order
    got = _draw((probs * keep).gather(1, order), ids, u[part])
    if len(part) == n:
        return got
    out[to_dev(part, dev)] = got
    return out


def _info(p: SamplingParams) -> tuple:
    """(params, greedy, processes logits, (temperature, top-k, top-p, min-p))."""
    return (p, p.greedy, p.processes_logits, (p.temperature, p.top_k if p.top_k and p.top_k > 0 else 0, p.top_p, p.min_p))


def kernel_rows(rows) -> tuple:
    """The kernel's per-row parameters from rows of (temperature, top-k (0: none), top-p, min-p):
    (temperature float32, top-k int64 as a numpy array, top-p float32, min-p float32)."""
    rows = np.asarray(rows, dtype=np.float64).reshape(-1, 4)
    return (torch.from_numpy(rows[:, 0].astype(np.float32)), rows[:, 1].astype(np.int64),
            torch.from_numpy(rows[:, 2].astype(np.float32)), torch.from_numpy(rows[:, 3].astype(np.float32)))


def kernel_sample_rows(kernels, x: torch.Tensor, rows, u: np.ndarray) -> torch.Tensor:
    """sample_rows through the CPU kernel, every row at once. `rows`: kernel_rows(), or the rows
    it takes ([n, 4] temperature, top-k (0: none), top-p, min-p). Rows without top-k (or with a k
    the vocabulary does not exceed) get their softmax numerators from torch (its vectorised exp
    over the whole vocabulary)."""
    temp, k, top_p, min_p = rows if isinstance(rows, tuple) else kernel_rows(rows)
    xf = x.float()
    vocab = x.shape[1]
    if k.size and k.max() >= vocab:
        k = np.where(k >= vocab, 0, k)
    e = _exp(xf, temp) if not k.all() else torch.empty(0)
    return kernels.sample_rows(xf, temp, torch.from_numpy(k), top_p, min_p, torch.from_numpy(u), e)


def _top_p_threshold(probs: torch.Tensor, tp: torch.Tensor) -> torch.Tensor:
    """[rows, 1]: the probability of the candidate (descending order) at which the cumulative mass
    first reaches top_p; the tokens at least that likely are kept."""
    before = torch.cumsum(probs, dim=-1) - probs
    last = (before < tp[:, None]).sum(dim=-1, keepdim=True) - 1  # the first candidate always counts
    return probs.gather(1, last.clamp_(min=0))


def _top_k(p: SamplingParams, vocab: int) -> int:
    return p.top_k if p.top_k and 0 < p.top_k < vocab else 0


def _min_p(probs: torch.Tensor, min_p: list[float]) -> torch.Tensor:
    """Tokens less likely than min_p x the row's most likely one ruled out, in place (not
    renormalised; `probs` is this sampler's own tensor)."""
    if not any(min_p):
        return probs
    mp = to_dev(min_p, probs.device, probs.dtype)
    return probs.masked_fill_(probs < mp[:, None] * torch.amax(probs, dim=-1, keepdim=True), 0.0)


def _exp(x: torch.Tensor, temperature) -> torch.Tensor:
    """exp((x - max) / T) per row, float32, unnormalised: softmax's numerator, made in place in
    one new tensor (a vocabulary-wide row costs memory bandwidth per pass). `temperature`: a list
    or a float32 tensor, one per row."""
    t = to_dev(temperature, x.device, torch.float32)[:, None]
    y = x.float() / t  # a new tensor: the logits stay as they were
    return y.sub_(torch.amax(y, dim=-1, keepdim=True)).exp_()


def _normalised(probs: torch.Tensor) -> torch.Tensor:
    return probs / probs.sum(dim=-1, keepdim=True)


DRAW_CHUNK = 1024  # rows wider than 8 of these are inverted in two levels (chunk sums, then one chunk)


def _draw(probs: torch.Tensor, ids: torch.Tensor | None, u: np.ndarray) -> torch.Tensor:
    """Inverse CDF: the first candidate whose cumulative mass passes u x the row's total (never
    one of probability 0: the CDF does not rise there). A row over a whole vocabulary is walked
    in two levels, the chunk whose running sum passes the target and then inside that chunk, so
    no vocabulary-wide float64 cumulative sum is made (the result is the same candidate)."""
    n, width = probs.shape
    target = to_dev(np.ascontiguousarray(u), probs.device)[:, None]
    if width <= 8 * DRAW_CHUNK:
        cdf = torch.cumsum(probs.double(), dim=-1)  # (cumsum's own dtype= is 3x slower on CPU)
        choice = torch.searchsorted(cdf, target * cdf[:, -1:], right=True).clamp_(max=width - 1)
        return choice[:, 0] if ids is None else ids.gather(1, choice)[:, 0]
    B = DRAW_CHUNK
    whole = width - width % B
    sums = probs[:, :whole].reshape(n, -1, B).sum(dim=-1)
    if whole < width:
        sums = torch.cat([sums, probs[:, whole:].sum(dim=-1, keepdim=True)], dim=1)
    ccdf = torch.cumsum(sums.double(), dim=-1)
    goal = target * ccdf[:, -1:]
    chunk = torch.searchsorted(ccdf, goal, right=True).clamp_(max=ccdf.shape[1] - 1)  # [n, 1]
    before = torch.where(chunk > 0, ccdf.gather(1, (chunk - 1).clamp(min=0)), torch.zeros_like(goal))
    cols = chunk * B + torch.arange(B, device=probs.device)[None]  # that chunk's candidates
    inside = cols < width
    part = probs.gather(1, cols.clamp(max=width - 1)) * inside
    cdf = torch.cumsum(part.double(), dim=-1)
    j = torch.searchsorted(cdf, (goal - before).clamp(min=0), right=True)
    # rounding at the chunk's end: the last candidate of it with mass
    last = (part > 0).long().cumsum(dim=-1).argmax(dim=-1, keepdim=True)
    j = torch.minimum(j, last)
    choice = cols.gather(1, j)
    return choice[:, 0] if ids is None else ids.gather(1, choice)[:, 0]


def _candidates(x: torch.Tensor, params: list[SamplingParams]) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row the tokens that may be drawn, likeliest first, with their probabilities after
    temperature and min-p: [rows, C] each (a row's unused places have probability 0). Top-k rows:
    the k best (ties with the k-th kept), renormalised among themselves (vLLM's order); top-p rows
    without top-k: the likeliest tokens of the whole distribution, enough to hold the mass (256
    first, widened 8x at a time for the rows whose candidates hold less)."""
    n, vocab = x.shape
    dev = x.device
    kr = [i for i, p in enumerate(params) if _top_k(p, vocab)]
    pr = [i for i, p in enumerate(params) if not _top_k(p, vocab)]
    parts = []
    if kr:
        ks = [_top_k(params[i], vocab) for i in kr]
        kt = to_dev(ks, dev)
        xk = _take(x, kr)
        width = min(vocab, max(ks) + 8)
        vals, ids = torch.topk(xk, width, dim=-1)
        kth = vals.gather(1, (kt - 1)[:, None])
        if width < vocab and bool((vals[:, -1:] >= kth).any()):  # ties with the k-th past those taken
            vals, ids = torch.sort(xk, dim=-1, descending=True)
        temp = to_dev([params[i].temperature for i in kr], dev)[:, None]
        lg = (vals.float() / temp).masked_fill(vals < kth, float("-inf"))
        parts.append((kr, _normalised(_min_p(torch.softmax(lg, dim=-1), [params[i].min_p for i in kr])), ids))
    if pr:
        full = _min_p(_exp(_take(x, pr), [params[i].temperature for i in pr]), [params[i].min_p for i in pr])
        full = full.div_(full.sum(dim=-1, keepdim=True))
        need = to_dev([params[i].top_p for i in pr], dev, full.dtype)
        probs, ids = torch.topk(full, min(vocab, CANDIDATES), dim=-1)

        def short_rows(rows: list[int] | None = None) -> list[int]:
            """Rows whose candidates hold less than top_p, or end on a tie with the token that
            reaches it (more of them may lie outside)."""
            if probs.shape[1] >= vocab:
                return []
            p, nd = (probs, need) if rows is None else (probs[rows], need[rows])
            bad = (p.sum(dim=-1) < nd) | (p[:, -1:] >= _top_p_threshold(p, nd))[:, 0]
            got = torch.nonzero(bad).flatten().tolist()
            return got if rows is None else [rows[i] for i in got]

        short = short_rows()
        while short:  # the rare flat distribution: those rows' candidates widen
            width = min(vocab, probs.shape[1] * 8)
            wp, wi = torch.topk(_take(full, short), width, dim=-1)
            grow = width - probs.shape[1]
            probs = torch.cat([probs, probs.new_zeros((len(pr), grow))], dim=1)
            ids = torch.cat([ids, ids.new_zeros((len(pr), grow))], dim=1)
            r = to_dev(short, dev)
            probs[r], ids[r] = wp, wi
            short = short_rows(short)
        parts.append((pr, probs, ids))
    if len(parts) == 1:
        return parts[0][1], parts[0][2]
    width = max(p[1].shape[1] for p in parts)
    probs = torch.zeros((n, width), dtype=torch.float32, device=dev)
    ids = torch.zeros((n, width), dtype=torch.long, device=dev)
    for rows, p, i in parts:
        r = to_dev(rows, dev)
        probs[r, :p.shape[1]] = p
        ids[r, :i.shape[1]] = i
    return probs, ids
