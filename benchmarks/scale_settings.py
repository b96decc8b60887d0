"""The scale model's settings: the target machines (published numbers, and assumptions marked
as such) and the training jobs evaluated, kept apart from the model's terms
(benchmarks/scale_model.py) so that a new machine or job is one entry here.

Sources of every number: docs/scale.md, "Inputs".
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

GB = 1e9
GiB = 1 << 30


@dataclass(frozen=True)
class Machine:
    """The target machine. Sources in docs/scale.md, "Inputs"; (A) marks an assumption."""

    name: str
    gpus_per_node: int
    d2h_pinned_gbps: float  #: per GPU, pinned, PCIe Gen4 (HPDC'24 measured on Polaris)
    d2h_pageable_gbps: float  #: per GPU, into pageable memory (A: half the pinned rate)
    host_mem_bytes: float  #: per node
    host_mem_gbps: float  #: per node, DDR4, 8 channels
    nic_gbps: float  #: per node injection, 2 x Slingshot 11 (200 Gb/s each)
    fs_name: str
    fs_gbps: float  #: parallel file system, aggregate
    fs_osts: int  #: object storage targets; a file of stripe count 1 is on one
    fs_stat_s: float  #: one open/stat of a file, one client thread (A: MDtest figure)
    fs_create_per_s: float  #: file creates per second in one directory, all clients (A)
    net_rtt_s: float  #: TCP round trip between nodes (A)
    cpu_factor: float = 1.0  #: CPU time there / CPU time here (A: equal)

    @property
    def ost_gbps(self) -> float:
        return self.fs_gbps / self.fs_osts


POLARIS = Machine(
    name="Polaris (ALCF)",
    gpus_per_node=4,
    d2h_pinned_gbps=25.0,
    d2h_pageable_gbps=12.5,
    host_mem_bytes=512 * GiB,
    host_mem_gbps=204.8 * GiB / GB,
    nic_gbps=50.0,
    fs_name="Grand (Lustre, 160 OSTs)",
    fs_gbps=650.0,
    fs_osts=160,
    fs_stat_s=0.5e-3,
    fs_create_per_s=15e3,
    net_rtt_s=30e-6,
)
#: Polaris nodes in larger numbers (Polaris itself has 560 nodes, 2,240 GPUs) on a file system
#: of Perlmutter's scratch class: > 5 TB/s over 274 object servers (one OST each: A).
POLARIS_BIG_FS = dataclasses.replace(
    POLARIS,
    name="Polaris-like nodes",
    fs_name="Perlmutter-class scratch (Lustre, 274 OSS)",
    fs_gbps=5000.0,
    fs_osts=274,
)


@dataclass(frozen=True)
class Setting:
    """A training job: the model's size, its parallelism and how long an iteration takes."""

    name: str
    params: float
    tp: int
    pp: int
    dp: int
    tensors_per_rank: int
    fwd_bwd_s: float  #: the window a lazy snapshot may use (HPDC'24, Fig. 4)
    step_s: float  #: the optimizer step
    machine: Machine = POLARIS
    weight_bytes: int = 2  #: bf16 weights, replicated over dp (declared ``replicated``)
    optimizer_bytes: int = 12  #: fp32 master + Adam m + v, ZeRO-1: sharded over dp
    replica_check: bool = True  #: CheckpointConfig.replica_check (its default)

    @property
    def ranks(self) -> int:
        return self.tp * self.pp * self.dp

    @property
    def nodes(self) -> int:
        return math.ceil(self.ranks / self.machine.gpus_per_node)

    @property
    def iteration_s(self) -> float:
        return self.fwd_bwd_s + self.step_s

    @property
    def total_bytes(self) -> float:
        """Bytes of one checkpoint: weights once, optimizer state once (replicas deduplicated)."""
        return self.params * (self.weight_bytes + self.optimizer_bytes)

    @property
    def written_per_rank(self) -> float:
        return self.total_bytes / self.ranks

    @property
    def replicas_held_per_rank(self) -> float:
        """Declared-replicated bytes a rank holds (its weight shard), digested by every replica
        when the replica check is on."""
        if self.dp == 1 or not self.replica_check:
            return 0.0
        return self.params * self.weight_bytes / (self.tp * self.pp)


def _llama70b(dp: int, machine: Machine = POLARIS, name: str | None = None) -> Setting:
    # 80 layers / pp 16 = 5 layers of 9 weight matrices and norms per rank, each a tp shard:
    # 45 x (bf16 weight, fp32 master, 2 moments) = 180 tensors, plus embedding/head and small
    # per-rank state: ~200. fwd+bwd 23.5 s and step 0.12 s: the largest of HPDC'24 Fig. 4.
    return Setting(name or f"70B, {64 * dp} ranks", 70e9, 4, 16, dp, 200, 23.5, 0.12, machine)


SWEEP_DP = (4, 8, 16, 32, 48, 64, 96, 128)


def sweep(dps: tuple[int, ...] = SWEEP_DP) -> list[Setting]:
    """The 70B job from 256 to 8,192 ranks (data parallel 4 to 128, or ``dps``): Polaris as
    long as it has the GPUs (2,240), Polaris-like nodes on a larger file system beyond."""
    return [_llama70b(dp, POLARIS if 64 * dp <= 2240 else POLARIS_BIG_FS) for dp in dps]


SETTINGS = [
    _llama70b(4, name="70B, 256 A100 (the paper's setting)"),
    # HPDC'24's 1,201 GB/s: LLaMA-30B, TP 4, PP 8, DP 16 on 512 GPUs. 60 layers / 8 = 7.5 per
    # rank: ~68 shards x 4 + the rest ~ 280 tensors; fwd+bwd between the 13B and 70B ones.
    Setting("30B, 512 A100, DP 16 (HPDC'24)", 30e9, 4, 8, 16, 280, 12.0, 0.1),
    _llama70b(16),
    _llama70b(128, POLARIS_BIG_FS),
]


#: The machine of the 1-32-rank measurements: one 2-core VM, loopback store, local ext4.
DEV_VM = Machine(
    name="2-core development VM",
    gpus_per_node=32,
    d2h_pinned_gbps=10.6,
    d2h_pageable_gbps=3.5,
    host_mem_bytes=23.5 * GiB,
    host_mem_gbps=10.6,
    nic_gbps=1e9,
    fs_name="ext4 (virtio)",
    fs_gbps=1.68,
    fs_osts=1,
    fs_stat_s=20e-6,
    fs_create_per_s=1e5,
    net_rtt_s=0.0,
)
