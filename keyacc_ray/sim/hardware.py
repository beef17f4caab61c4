"""Machines the project cannot run, described by published figures, for planning (scripts/simulate.py
--plan): GPUs, CPU sockets, models, and the three scenarios of docs/planning.md. Every figure says
where it comes from; the efficiencies (the share of a peak an engine reaches) are anchored on
measurements, and a profile fitted on the real host (scripts/sim_calibrate.py) replaces them.

A scenario turns into a ServerSpec: each pool's step time from the roofline of its device
(`steptime.roofline`), its KV blocks from the memory left after the weights, its slots (the CPU
pool's so that a full batch still steps within the TPOT objective), the hand-off's bandwidth.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from keyacc_ray.sim.server import PoolSpec, ServerSpec
from keyacc_ray.sim.steptime import StepTime, roofline

GB = 1e9
GIB = 1 << 30


@dataclass(frozen=True)
class Device:
    name: str
    mem_bytes: float  # what an engine can allocate (GPU: as torch reports it; CPU: the socket's DRAM)
    bw_bytes_s: float  # peak memory bandwidth
    flops: float  # peak dense bf16 FLOP/s
    bw_eff: float  # the share of the bandwidth an engine's decode step reaches
    flop_eff: float  # the share of the FLOP/s its matrix products reach
    step_fixed_s: float  # per step: launches, scheduling, sampling on the host
    source: str


# GPUs. Efficiencies: vLLM decodes Llama-3-8B (16.1 GB of bf16) at 130-156 tokens/s at batch 1 on an
# H100 SXM (3.35 TB/s): 0.62-0.75 of the bandwidth roofline; a bf16 8192-cube matmul ran at 770-800 of
# 989 TFLOP/s on the lent H200 (../shared/NOTES.md), engines' whole steps less: 0.6.
# The H200's bandwidth share and step overhead are our own engine's, on the lent host: its Qwen3-14B
# decode steps at 1, 16 and 64 sequences (sim/measured/h200-host.json) are 0.3 ms + the weights and
# the rows' KV at 0.7 of 4.8 TB/s, within 6% (tests/sim: test_the_h200_host_entries_reproduce_its_steps).
H200 = Device("H200", 139.8 * GIB, 4.8e12, 989e12, 0.7, 0.6, 0.0003,
              "NVIDIA H200 SXM datasheet: 141 GB HBM3e (139.8 GiB seen by torch on the lent host), 4.8 TB/s, "
              "989 TFLOP/s bf16 dense; bandwidth share and 0.3 ms a step from our engine's 14B steps there")
L40S = Device("L40S", 44.5 * GIB, 864e9, 362e12, 0.7, 0.6, 0.002,
              "NVIDIA L40S datasheet: 48 GB GDDR6 (44.5 GiB allocatable), 864 GB/s, 362 TFLOP/s bf16 dense")

# CPU sockets. 8 channels of DDR5-4800: 8 x 38.4 = 307 GB/s. AMX: 1024 bf16 FLOP per cycle per core.
# Efficiencies: on this box the engine's batch-1 decode step reads its weights at 1/1.10 of what a
# two-thread torch.sum reads (make bench-engine: fast_roofline_ratio_bs1), and a STREAM-class read
# reaches about 0.8 of a Sapphire Rapids socket's peak: 0.73. The AMX share (0.3) is assumed: the
# engine's prefill on this box's AMX has not been set against the unit's peak yet.
SPR_8CH = Device("Xeon SPR 32-core, 8 x DDR5-4800", 256 * GB, 307.2e9, 32 * 2.0e9 * 1024, 0.73, 0.3, 0.002,
                 "Intel Xeon 4th gen (Sapphire Rapids), 32 cores at 2.0 GHz, 8 channels DDR5-4800, 256 GB per socket")
# The lent H200 host's 16 cores, measured (sim/measured/h200-host.json): a 16-thread read of 100 GB/s
# (taken as the bandwidth), our engine's batch-1 step of the 0.4B shape at 1.11x the weights over that
# (0.9 of it), and its AMX prefill at 2.84 TFLOP/s, 0.087 of 16 cores x 2.0 GHz x 1024 (the clock is a
# nominal figure: the ratio is what was measured). Decode steps of 8-32 rows ran 1.6-2.5x longer than
# this roofline says (AMX's tile setup below 32 rows), so its CPU slots are an upper bound.
H200_HOST_CPU = Device("H200 host, 16 cores", 128 * GIB, 100e9, 16 * 2.0e9 * 1024, 0.9, 0.087, 0.0005,
                       "the lent H200 host's 16 Xeon cores (AMX) and 128 GiB, measured: 100 GB/s read with 16 "
                       "threads, the engine's batch-1 step at 1/0.9 of it, AMX prefill at 0.087 of the nominal peak")


@dataclass(frozen=True)
class Model:
    name: str
    params: float
    layers: int
    kv_heads: int
    head_dim: int

    def weight_bytes(self, bytes_per_param: float) -> float:
        return self.params * bytes_per_param

    def kv_bytes_per_token(self, dtype_bytes: int = 2) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * dtype_bytes


QWEN3_14B = Model("Qwen3-14B", 14.8e9, 40, 8, 128)  # config.json: 40 layers, 8 KV heads of 128
LLAMA3_70B = Model("Llama-3-70B", 70.6e9, 80, 8, 128)  # config.json: 80 layers, 8 KV heads of 128


@dataclass(frozen=True)
class Pool:
    device: Device
    replicas: int
    weight_bytes_per_param: float = 2.0  # bf16; 1.0: 8-bit weights
    max_num_seqs: int = 256  # the GPU's slots (vLLM's default); a CPU pool's: from the TPOT objective
    mem_utilization: float = 0.9  # the share of mem_bytes the engine may take (weights + KV)
    reserve_bytes: float = 2 * GB  # activations, the runtime


@dataclass(frozen=True)
class Workload:
    prompt_tokens: tuple[int, int] = (256, 1024)  # uniform
    output_tokens: tuple[int, int] = (64, 512)
    max_tokens: int = 512  # what clients ask for (the router's KV estimate)

    @property
    def mean_context(self) -> float:
        """The average context a decode row reads: the prompt and half the output."""
        return sum(self.prompt_tokens) / 2 + sum(self.output_tokens) / 4


@dataclass(frozen=True)
class Scenario:
    name: str
    title: str
    model: Model
    gpu: Pool
    cpu: Pool
    handoff_bw_bytes_s: float  # the KV's path between the pools (PCIe, or the network across nodes)
    handoff_fixed_s: float
    ttft_slo_s: float
    tpot_slo_s: float
    workload: Workload = field(default_factory=Workload)
    notes: str = ""

    def steptime(self, pool: Pool) -> StepTime:
        d, m = pool.device, self.model
        return roofline(f"{self.name}-{d.name}", m.weight_bytes(pool.weight_bytes_per_param), m.params,
                        d.bw_bytes_s, d.flops, m.kv_bytes_per_token(), d.bw_eff, d.flop_eff, d.step_fixed_s,
                        f"{d.source}; bandwidth x {d.bw_eff:g}, FLOP/s x {d.flop_eff:g}")

    def kv_blocks(self, pool: Pool, block_size: int = 16) -> int:
        free = pool.device.mem_bytes * pool.mem_utilization - self.model.weight_bytes(pool.weight_bytes_per_param) \
            - pool.reserve_bytes
        if free <= 0:
            raise ValueError(f"{self.model.name} does not fit {pool.device.name}")
        return int(free // (self.model.kv_bytes_per_token() * block_size))

    def cpu_slots(self) -> int:
        """The CPU pool's slots: the most decode rows whose step, at the workload's mean context,
        takes at most 0.8 of the TPOT objective (the rest is for prompt chunks; a pool with more
        slots fills to a batch that misses it; a deployment sets this as max_num_seqs). 0 when
        not even one row does."""
        st, ctx = self.steptime(self.cpu), self.workload.mean_context
        rows = 0
        while rows < self.cpu.max_num_seqs and st.seconds(0, rows + 1, int((rows + 1) * ctx)) <= 0.8 * self.tpot_slo_s:
            rows += 1
        return rows

    def cpu_prefill_chunk(self, block_size: int = 16) -> int:
        """The CPU pool's prompt tokens per step (max_prefill_tokens): the most, in whole blocks,
        that a step of a full batch can take and still end within the TPOT objective (a CPU step
        is bound by reading the weights: prompt tokens up to its compute are nearly free); one
        block at least."""
        st, ctx, rows = self.steptime(self.cpu), self.workload.mean_context, max(1, self.cpu_slots())
        chunk = block_size
        while chunk < 8192 and st.seconds(chunk + block_size, rows, int(rows * ctx)) <= self.tpot_slo_s:
            chunk += block_size
        return chunk

    def spec(self, block_size: int = 16) -> ServerSpec:
        g, c = self.gpu, self.cpu
        return ServerSpec(
            PoolSpec(self.steptime(g), replicas=g.replicas, max_num_seqs=g.max_num_seqs,
                     num_blocks=self.kv_blocks(g, block_size), block_size=block_size, max_prefill_tokens=8192),
            PoolSpec(self.steptime(c), replicas=c.replicas, max_num_seqs=max(1, self.cpu_slots()),
                     num_blocks=self.kv_blocks(c, block_size), block_size=block_size,
                     max_prefill_tokens=self.cpu_prefill_chunk(block_size)),
            kv_bytes_per_token=self.model.kv_bytes_per_token(), handoff_bw_bytes_s=self.handoff_bw_bytes_s,
            handoff_fixed_s=self.handoff_fixed_s, max_model_len=4096)

    def describe(self) -> dict:
        g, c = self.steptime(self.gpu), self.steptime(self.cpu)
        return {"scenario": self.name, "model": self.model.name,
                "gpu": f"{self.gpu.replicas} x {self.gpu.device.name}", "cpu": f"{self.cpu.replicas} x {self.cpu.device.name}",
                "cpu_bw_gb_s_per_replica": round(self.cpu.device.bw_bytes_s / GB, 1),
                "cpu_bw_gb_s_total": round(self.cpu.replicas * self.cpu.device.bw_bytes_s / GB, 1),
                "gpu_bw_gb_s_total": round(self.gpu.replicas * self.gpu.device.bw_bytes_s / GB, 1),
                "gpu_kv_tokens_per_replica": self.kv_blocks(self.gpu) * 16, "cpu_kv_tokens_per_replica": self.kv_blocks(self.cpu) * 16,
                "cpu_slots_per_replica": self.cpu_slots(), "cpu_prefill_chunk": self.cpu_prefill_chunk(), "gpu_step_ms_batch1": round(1e3 * g.seconds(0, 1, 800), 2),
                "cpu_step_ms_batch1": round(1e3 * c.seconds(0, 1, 800), 2),
                "ttft_slo_s": self.ttft_slo_s, "tpot_slo_s": self.tpot_slo_s}


SCENARIOS = {
    "h200-host": Scenario(
        "h200-host", "(a) the H200 host measured so far: one H200 beside 16 Xeon cores", QWEN3_14B,
        Pool(H200, 1), Pool(H200_HOST_CPU, 1, reserve_bytes=16 * GB, max_num_seqs=64),
        handoff_bw_bytes_s=25e9, handoff_fixed_s=0.005, ttft_slo_s=2.0, tpot_slo_s=0.2),
    "l40s-2socket": Scenario(
        "l40s-2socket", "(b) one 48 GB L40S beside two Xeon sockets of 8 DDR5-4800 channels each", QWEN3_14B,
        Pool(L40S, 1), Pool(SPR_8CH, 2, reserve_bytes=16 * GB, max_num_seqs=64),
        handoff_bw_bytes_s=20e9, handoff_fixed_s=0.005, ttft_slo_s=2.0, tpot_slo_s=0.2),
    "cluster-70b": Scenario(
        "cluster-70b", "(c) cluster.yaml's shape serving a 70B model: 2 GPU nodes of one H200 each, "
        "4 CPU nodes of two 8-channel sockets", LLAMA3_70B,
        Pool(H200, 2, weight_bytes_per_param=1.0), Pool(SPR_8CH, 8, reserve_bytes=16 * GB, max_num_seqs=64),
        handoff_bw_bytes_s=10e9, handoff_fixed_s=0.01, ttft_slo_s=5.0, tpot_slo_s=1.0,
        notes="the GPU nodes hold the 70B in 8-bit weights (70.6 GB; the engine has 8-bit weights on CPU only "
              "today), the CPU sockets in bf16 (141 GB of a socket's 256 GB); hand-offs over a 100 Gb/s network "
              "at 80%"),
}
