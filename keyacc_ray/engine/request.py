"""Request state: sampling parameters, the ordered status enum, and a running sequence."""
from __future__ import annotations

import enum
import math
from dataclasses import asdict, dataclass, field
from typing import Any

from keyacc_ray.errors import InvalidRequest

MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256
MAX_SEED = 2**63 - 1
MAX_LOGPROBS = 20
MAX_LOGIT_BIAS = 1024


@dataclass
class SamplingParams:
    """Per-request sampling parameters. `temperature == 0` means greedy."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    min_p: float = 0.0  # tokens less likely than min_p x the most likely one are ruled out (0: off)
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    # Log-probabilities of each generated token (under the model's distribution, before
    # temperature / top-k / top-p) and of this many most likely alternatives; None: none.
    logprobs: int | None = None
    # vLLM's prompt_logprobs: each prompt token's log-probability given the tokens before it (and
    # this many alternatives), computed at the first prefill; what `echo` with logprobs returns.
    prompt_logprobs: int | None = None
    # OpenAI's penalties over the tokens generated so far: logit -= frequency * count + presence
    # * (count > 0); and transformers' / vLLM's repetition penalty over prompt and output
    # (a positive logit divided by it, a negative one multiplied). Neutral: 0, 0, 1.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    # OpenAI's logit_bias: token id -> a bias in [-100, 100] added to its logit before sampling
    logit_bias: dict[int, float] | None = None
    # vLLM's min_tokens: no end-of-sequence or stop token id before this many tokens
    min_tokens: int = 0
    # vLLM's: the stop string (or the stop token's text) that ended the output stays in its text;
    # special tokens' text is left out of the output text
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    # structured outputs: llguidance grammar text (engine/structured.compile_grammar, made where the
    # request is parsed); the sampler masks every token the grammar does not allow
    grammar: str | None = None

    def validate(self) -> "SamplingParams":
        def bad(msg: str, param: str) -> InvalidRequest:
            return InvalidRequest(msg, param=param)

        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise bad(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}", "max_tokens")
        for name, lo, hi in (("temperature", 0.0, 2.0), ("top_p", 0.0, 1.0)):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                raise bad(f"{name} must be a number, got {v!r}", name)
        if not 0.0 <= self.temperature <= 2.0:
            raise bad(f"temperature must be in [0, 2], got {self.temperature}", "temperature")
        for name, lo, hi in (("presence_penalty", -2.0, 2.0), ("frequency_penalty", -2.0, 2.0),
                             ("repetition_penalty", 0.0, 2.0)):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                raise bad(f"{name} must be a number, got {v!r}", name)
            if not lo <= v <= hi or (name == "repetition_penalty" and v == 0):
                raise bad(f"{name} must be in {'(' if name == 'repetition_penalty' else '['}{lo:g}, {hi:g}], got {v}",
                          name)
        if (isinstance(self.min_tokens, bool) or not isinstance(self.min_tokens, int)
                or not 0 <= self.min_tokens <= self.max_tokens):
            raise bad(f"min_tokens must be an integer in [0, max_tokens], got {self.min_tokens!r}", "min_tokens")
        if self.logit_bias is not None:
            lb = self.logit_bias
            if (not isinstance(lb, dict) or len(lb) > MAX_LOGIT_BIAS
                    or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in lb)
                    or not all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
                               and -100 <= v <= 100 for v in lb.values())):
                raise bad(f"logit_bias must map at most {MAX_LOGIT_BIAS} token ids to biases in [-100, 100]",
                          "logit_bias")
        if isinstance(self.min_p, bool) or not isinstance(self.min_p, (int, float)) or not 0.0 <= self.min_p <= 1.0:
            raise bad(f"min_p must be a number in [0, 1], got {self.min_p!r}", "min_p")
        if not 0.0 < self.top_p <= 1.0:
            raise bad(f"top_p must be in (0, 1], got {self.top_p}", "top_p")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < -1:
            raise bad(f"top_k must be an integer >= -1, got {self.top_k!r}", "top_k")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)
                                      or not -MAX_SEED <= self.seed <= MAX_SEED):
            raise bad(f"seed must be an integer in [-2^63+1, 2^63-1], got {self.seed!r}", "seed")
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if not isinstance(self.stop, list) or not all(isinstance(s, str) and s for s in self.stop):
            raise bad("stop must be a non-empty string or a list of non-empty strings", "stop")
        if len(self.stop) > MAX_STOP_STRINGS or any(len(s) > MAX_STOP_STRING_CHARS for s in self.stop):
            raise bad(f"at most {MAX_STOP_STRINGS} stop strings of at most {MAX_STOP_STRING_CHARS} "
                      "characters each", "stop")
        if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in self.stop_token_ids):
            raise bad("stop_token_ids must be non-negative integers", "stop_token_ids")
        for name in ("include_stop_str_in_output", "skip_special_tokens", "ignore_eos"):
            if not isinstance(getattr(self, name), bool):
                raise bad(f"{name} must be a boolean, got {getattr(self, name)!r}", name)
        if self.grammar is not None and (not isinstance(self.grammar, str) or not self.grammar):
            raise bad("grammar must be a non-empty string (a compiled grammar)", "grammar")
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= MAX_LOGPROBS):
                raise bad(f"{name} must be an integer in [0, {MAX_LOGPROBS}], got {v!r}", name)
        return self

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def adjusts_logits(self) -> bool:
        """Penalties, a logit bias or min_tokens: the row's logits change (engine/penalties.py)."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0
                    or self.logit_bias or self.min_tokens)

    @property
    def processes_logits(self) -> bool:
        """Adjusted logits or a grammar's mask: the row's logits change before sampling."""
        return self.adjusts_logits or self.grammar is not None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class SeqStatus(enum.IntEnum):
    """Ordered: everything >= FINISHED_STOPPED is finished."""

    WAITING = 0
    RUNNING = 1
    FINISHED_STOPPED = 2
    FINISHED_LENGTH = 3
    FINISHED_ABORTED = 4
    FINISHED_EXPORTED = 5

    @property
    def finished(self) -> bool:
        return self >= SeqStatus.FINISHED_STOPPED

    @property
    def finish_reason(self) -> str | None:
        return {SeqStatus.FINISHED_STOPPED: "stop", SeqStatus.FINISHED_LENGTH: "length",
                SeqStatus.FINISHED_ABORTED: "abort", SeqStatus.FINISHED_EXPORTED: "migrated"}.get(self)


@dataclass
class Sequence:
    """One request inside an engine. `num_cached` tokens of `token_ids` have KV in the cache;
    the rest (at least one while running) are fed by the next forward."""

    request_id: str
    token_ids: list[int]
    num_prompt_tokens: int
    params: SamplingParams
    status: SeqStatus = SeqStatus.WAITING
    num_cached: int = 0
    imported: Any = None  # a KVPackage waiting to be written into a slot on admission
    kv_from: int = 0  # admitted with `imported`: the head its prefix cache held (shared, not written)
    # Tokens this engine produced, and where the output text stands (for hand-offs).
    emitted_text_chars: int = 0
    max_chunk: int = 0  # the most prompt tokens one step may feed (0: the scheduler's budget)
    # prefix caching: the keys of its full blocks (blocks.chain_hashes), whether it may share cached
    # blocks (not when every prompt position's logits are wanted), and the prompt tokens it found
    # cached at admission (OpenAI's usage.prompt_tokens_details.cached_tokens)
    block_hashes: list = field(default_factory=list)
    share_prefix: bool = True
    num_cached_prompt_tokens: int = 0
    arrival: float | None = None  # when it joined this engine's queue (monotonic); None once first scheduled
    scheduled_at: float | None = None  # when this engine first scheduled it
    first_token_at: float | None = None  # when this engine made its first token

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def max_total_tokens(self) -> int:
        """Prompt plus every token it may still generate: what admission reserves."""
        return self.num_prompt_tokens + self.params.max_tokens

    @property
    def decoding(self) -> bool:
        """One token to feed and KV for the rest: a decode row (not a prompt, or a prompt's chunk)."""
        return self.num_cached > 0 and len(self.token_ids) - self.num_cached == 1

    @property
    def num_pending(self) -> int:
        return len(self.token_ids) - self.num_cached
