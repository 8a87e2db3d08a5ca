"""Stats: per-refit timings and sizes, returned by Sender.refit and Receiver.receive."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass(slots=True)
class RefitStats:
    """One refit as one side saw it."""

    version: int
    epoch: int
    handshake: bool = False
    """True when this refit started with a (re-)handshake."""
    num_buckets: int = 0
    nbytes: int = 0
    """Tensor bytes moved (without padding)."""
    control_bytes: int = 0
    """Control-channel bytes sent and received for the refit itself (handshake excluded)."""
    unverified: int = 0
    """Fingerprint mode: names an engine could not read back, so not compared (0 when every name was)."""
    unverified_names: list[str] = field(default_factory=list)
    """Fingerprint mode: those names (sorted), so a caller can tell which tensors went unchecked."""
    model_bytes: int = 0
    """M:N: bytes of the whole model on the wire (what one worker of a broadcast receives)."""
    worker_bytes: list[int] = field(default_factory=list)
    """M:N: tensor bytes each engine worker received (a trainer rank: from it; a worker: [its own])."""
    receivers: list[int] = field(default_factory=list)
    """Sender: the ranks of the receivers that committed this version."""
    departed: list[dict] = field(default_factory=list)
    """Sender, elastic: `{"receiver": rank, "reason": why}` for each receiver dropped since the last refit's
    stats (it said LEAVE with that reason, closed, died or stopped answering); the refit went on without it."""
    staged_bytes: int = 0
    """Staged refit (receiver): staging memory the staged tensors take; they arrived while the engine generated."""
    direct_bytes: int = 0
    """Partial staged refit (receiver): wire bytes of the tensors staging could not hold, received straight into
    the live engine during the pause (0: the pause covered only the final copy)."""
    wire_bytes: int = 0
    """Bucket bytes moved on the data plane (a delta refit: its payloads; else every bucket's bytes)."""
    full_bytes: int = 0
    """Bucket bytes a full refit of this epoch moves (padding included), for comparison with `wire_bytes`."""
    delta: bool = False
    """The refit was sent as a delta against the version every receiver committed (`SenderOptions.delta`)."""
    buckets: dict[str, int] = field(default_factory=dict)
    """Sender, per stage's say (refit.stages): this refit's buckets per way they went. Delta: 'delta', 'full-link'
    (the link moves the bytes faster than the scan for changed values would pay for), 'full-dense-sample' and
    'full-dense-scan' (over the threshold, found by the sample or by the whole compare), 'full-unkept' (found
    dense lately: not in the images), 'full-reprime' (kept again after that), 'full-base' (a full refit)."""
    num_delta_buckets: int = 0
    """Sender: buckets that moved as delta payloads."""
    num_full_by_choice: int = 0
    """Sender, delta: buckets sent full, uncompared, because the link was measured faster than the scan."""
    num_full_dense: int = 0
    """Sender, delta: buckets sent full because too many of their values changed (found now, or lately)."""
    root: str = ""
    """Fingerprint mode: the Merkle root of this version over the per-tensor fingerprints in manifest order
    (refit.checks.root). Sender: the root every receiver holds when all hold the same tensors (else "", see
    `roots`); receiver: the root of what its engine was proven to hold (an engine's `root()` reads it again)."""
    roots: dict[int, str] = field(default_factory=dict)
    """Sender, fingerprint mode: the root each receiver (by rank) must hold; they differ where receivers hold
    different shards."""
    repaired: list[str] = field(default_factory=list)
    """Fingerprint mode: the tensors a receiver's check named wrong and that were fetched again and proven within
    this refit (refit.topology.repair); sender: every receiver's, together."""
    repair_bytes: int = 0
    """The bytes those repairs moved (sender: REPAIR messages whole; receiver: the tensors' bytes)."""
    seconds: dict[str, float] = field(default_factory=dict)
    """Seconds per stage; 'total' is the refit's wall time. Sender: handshake, pack, send, wait, verify (its
    digests sent), commit (COMMIT sent until every DONE: the receivers' fingerprint check and engine commit),
    one after another in its thread, so they add up to 'total' less bookkeeping (and a vote across trainer
    ranks, after commit, where there is one); 'connect' (waiting for receivers, first refit) came before
    'total' began. Receiver: recv, load, verify (checksums and the fingerprint check), commit; its loads
    overlap the sender's stages. M:N (MeshRefit): 'total' only."""

    def add(self, stage: str, dt: float) -> None:
        self.seconds[stage] = self.seconds.get(stage, 0.0) + dt

    def count_buckets(self, counts: dict[str, int]) -> None:
        """Add a stage's `counts` of buckets per way they went (`buckets`), and the totals of the num_ fields."""
        for way, n in counts.items():
            self.buckets[way] = self.buckets.get(way, 0) + n
            if way == "delta":
                self.num_delta_buckets += n
            elif way == "full-link":
                self.num_full_by_choice += n
            elif way.startswith("full-dense") or way == "full-unkept":
                self.num_full_dense += n

    @property
    def total_s(self) -> float:
        return self.seconds.get("total", 0.0)

    @property
    def gbps(self) -> float:
        return self.nbytes / self.total_s / 1e9 if self.total_s > 0 else 0.0

    def to_json(self) -> dict:
        return asdict(self)
