"""MegatronSource: a megatron-core GPTModel sharded with tensor (TP) and pipeline (PP) parallelism as the
source, sent under Hugging Face checkpoint names (Llama / Qwen2 layout, refit.megatron_layout).

Every rank of the model-parallel group (TP x PP ranks of one data-parallel replica) builds the source;
the first rank of that group (TP rank 0 of the first stage) also holds the Sender. The specs come from
the config (names and global shapes) and one small table all ranks agree on per refit (which stage
owns each parameter, in which dtype), so nothing is gathered to know them. Each bucket is gathered
on its own: the owning stage all-gathers each Megatron parameter over its TP group, its TP rank 0
sends the result to the leader, and the leader converts it (q/k/v, gate/up) into the bucket's
tensors. The leader announces each bucket to the others with a 3-integer broadcast (go, first,
count), as `FsdpSource` does, so no rank needs the manifest. A parameter whose checkpoint tensors
straddle a bucket boundary is kept until its last one is packed; nothing else outlives its bucket.
megatron-core is imported only where a process group is looked up.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Hashable, Iterator, Mapping, Sequence

import torch
import torch.distributed as dist
from torch import nn

from refit.log import get_logger
from refit.manifest import Manifest
from refit.megatron_layout import GptLayout
from refit.source import Source, WireDtypes
from refit.spec import TensorSpec

log = get_logger("megatron")

_CODES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]
"""Training dtypes a parameter may have, by code (the per-refit table carries codes, not pickles)."""


def _parallel_state():  # type: ignore[no-untyped-def]
    try:
        from megatron.core import parallel_state
    except ImportError:
        raise ValueError("MegatronSource needs megatron-core: pip install -e '.[megatron]'") from None
    return parallel_state


def unwrap(model: nn.Module) -> nn.Module:
    """The GPTModel inside Megatron's wrappers (DistributedDataParallel, Float16Module: `.module`)."""
    while not hasattr(model, "decoder") and hasattr(model, "module"):
        model = model.module
    return model


class MegatronSource(WireDtypes, Source):
    """Specs from the config; tensors gathered bucket by bucket over TP, sent across PP to the leader."""

    stable_tensors = False

    def __init__(
        self,
        model: nn.Module,
        *,
        vocab_size: int | None = None,
        wire_dtype: torch.dtype | None = None,
        overrides: Mapping[str, torch.dtype] | None = None,
    ) -> None:
        """Collective: every model-parallel rank builds it together. `vocab_size`: the rows of the
        embedding (default: the model's padded vocabulary); `wire_dtype` casts every tensor (e.g. fp32
        master weights sent as bf16); `overrides` set single checkpoint names' wire dtypes."""
        ps = _parallel_state()
        self.model = unwrap(model)
        config = self.model.config
        vocab = vocab_size or self.model.vocab_size
        tied = bool(getattr(self.model, "share_embeddings_and_output_weights", False))
        self.layout = GptLayout.from_megatron(config, vocab_size=vocab, tied_embeddings=tied)
        self.group = ps.get_model_parallel_group()
        self.tp_group = ps.get_tensor_model_parallel_group()
        self.tp_rank = ps.get_tensor_model_parallel_rank()
        self.stage = ps.get_pipeline_model_parallel_rank()
        self.stage_ranks = dist.get_process_group_ranks(ps.get_pipeline_model_parallel_group())
        self.rank = dist.get_rank(self.group)
        self.device = next(self.model.parameters()).device
        """Where gathers land and control tensors live (NCCL groups need CUDA tensors)."""
        if self.rank == 0 and (self.tp_rank or self.stage):
            raise ValueError("the model-parallel group's first rank must be TP rank 0 of the first stage "
                             "(megatron-core's default rank order); initialise parallel_state with it")  # fmt: skip
        self._shapes = self.layout.hf_shapes()
        self._order = list(self._shapes)
        self._tensors = self._shapes  # type: ignore[assignment]  # WireDtypes checks override names against it
        self._slot_of = {n: s.key for s in self.layout.slots.values() for n in s.hf_names}
        self._pos = {n: i for i, n in enumerate(self._order)}
        self._last = {k: max(self._pos[n] for n in s.hf_names) for k, s in self.layout.slots.items()}
        self._kept: dict[str, torch.Tensor | None] = {}
        self._leading = False
        self.peak_gathered_bytes = 0
        """Most bytes of gathered Megatron parameters alive at once on this rank."""
        self.gather_counts: Counter[str] = Counter()
        """How many times each slot was gathered (tests: once per refit)."""
        self._init_wire(wire_dtype, overrides)
        self.sync()

    # -- what is sent ------------------------------------------------------------------------------

    def specs(self) -> list[TensorSpec]:
        """Checkpoint names in name order; wire dtype: the override, else `wire_dtype`, else the training
        dtype (`set_wire_dtype(name, dtype)` matters on the leader only: it plans the buckets)."""
        out = []
        for name in self._order:
            held = _CODES[self._table[self._slot_of[name]][1]]
            dtype = self._overrides.get(name) or self.wire_dtype or held
            aliases = tuple(a for a, n in self.layout.aliases().items() if n == name)
            out.append(TensorSpec(name, self._shapes[name], dtype, aliases))
        return out

    def signature(self) -> Hashable:
        return tuple(self._table.values()), tuple(sorted(self._overrides.items(), key=str))

    # -- the per-refit table -----------------------------------------------------------------------

    def _local(self) -> dict[str, torch.Tensor]:
        """This rank's live Megatron parameters by slot (re-read each pass: replaced tensors count)."""
        layers = getattr(self.model.decoder, "layers", [])
        offset = layers[0].layer_number - 1 if len(layers) else 0
        out = {}
        for name, p in self.model.named_parameters():
            key = self.layout.slot_of(name, offset)
            if key is not None and key in self.layout.slots:
                out[key] = p
        return out

    def sync(self) -> None:
        """Collective: agree on each slot's owning stage and dtype (one all-reduce of a small int table).
        Every rank raises the same ValueError after it, so a bad parameter on one rank hangs no other."""
        self._params = self._local()
        keys = list(self.layout.slots)
        rows = [[0, 0, 0] for _ in keys]
        for row, k in zip(rows, keys):
            if k in self._params:
                dt = self._params[k].dtype
                row[:] = [self.stage + 1, _CODES.index(dt) + 1, 0] if dt in _CODES else [self.stage + 1, 1, 1]
        table = torch.tensor(rows, dtype=torch.int64).to(self.device)
        dist.all_reduce(table, op=dist.ReduceOp.MAX, group=self.group)
        rows = table.tolist()
        bad = [k for k, row in zip(keys, rows) if row[2]]
        if bad:
            raise ValueError(f"parameters {bad[:5]} are not {_CODES}: cast them (FP8 weights are not supported yet)")
        missing = [k for k, row in zip(keys, rows) if row[0] == 0]
        if missing:
            raise ValueError(f"no stage holds {missing[:5]}: the model does not match the Llama/Qwen2 layout")
        self._table = {k: (row[0] - 1, row[1] - 1) for k, row in zip(keys, rows)}

    def owner(self, key: str) -> int:
        """The pipeline stage holding slot `key` (as of the last sync)."""
        return self._table[key][0]

    def held_dtype(self, key: str) -> torch.dtype:
        """The training dtype of slot `key` (as of the last sync)."""
        return _CODES[self._table[key][1]]

    def local(self, key: str) -> torch.Tensor:
        """This rank's live shard of slot `key` (KeyError when another stage owns it)."""
        return self._params[key]

    # -- gathering ---------------------------------------------------------------------------------

    def tensors(self, names: Sequence[str]) -> list[torch.Tensor]:
        """The checkpoint tensors for a run of consecutive names (the leader; announced to the others)."""
        if not names:
            return []
        first = self._pos[names[0]]
        if list(names) != self._order[first : first + len(names)]:
            raise ValueError("MegatronSource serves contiguous runs of names in name order (as the planner lays them)")
        if self._leading:
            self._control(1, first, len(names))
        elif dist.get_world_size(self.group) > 1:
            raise ValueError("MegatronSource.tensors runs inside megatron_refit on every rank; call that instead")
        full = self._gather(first, first + len(names) - 1)
        out: dict[str, torch.Tensor] = {}
        for key, t in full.items():
            out.update(zip(self.layout.slots[key].hf_names, self.layout.to_hf(key, t)))
        return [out[n] for n in names]

    def _gather(self, first: int, last: int) -> dict[str, torch.Tensor]:
        """Every rank: the slots behind names[first..last], gathered over TP and sent to the leader
        (only the leader gets tensors back). Slots with names after `last` are kept, even through a
        run that skips them (q/k/v around o_proj), so each slot is gathered once per refit."""
        keys = list(dict.fromkeys(self._slot_of[n] for n in self._order[first : last + 1]))
        todo = [k for k in keys if k not in self._kept]
        got = self._over_tp(todo)
        got.update(self._to_leader(todo, got))
        if self.rank != 0:
            got = {}
        held = {**got, **{k: t for k, t in self._kept.items() if t is not None}}
        nbytes = sum(t.numel() * t.element_size() for t in held.values())
        self.peak_gathered_bytes = max(self.peak_gathered_bytes, nbytes)
        self.gather_counts.update(todo)
        later = [k for k in [*self._kept, *todo] if self._last[k] > last]
        self._kept = {k: held.get(k) for k in later}
        return {k: held[k] for k in keys if k in held}

    def _over_tp(self, keys: list[str]) -> dict[str, torch.Tensor]:
        """The slots this rank's stage owns, each all-gathered over the TP group (all in flight at once)."""
        pending = []
        with torch.no_grad():
            for k in keys:
                if k not in self._params:
                    continue
                local = self._params[k].detach()
                if self.layout.slots[k].partition_dim is None or self.layout.tp == 1:
                    pending.append((k, local.unsqueeze(0), None))
                    continue
                local = local.contiguous()
                flat = local.new_empty(self.layout.tp * local.numel())  # gloo gathers flat tensors only
                work = dist.all_gather_into_tensor(flat, local.view(-1), group=self.tp_group, async_op=True)
                pending.append((k, flat.view(self.layout.tp, *local.shape), work))
        got = {}
        for k, out, work in pending:
            if work is not None:
                work.wait()
            if self.tp_rank == 0:
                got[k] = self.layout.merge_shards(k, out)
        return got

    def _to_leader(self, keys: list[str], got: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Slots owned by later stages, sent by their TP rank 0 to the leader (point to point)."""
        if self.tp_rank != 0:
            return {}
        works, received = [], {}
        for k in keys:
            owner, code = self._table[k]
            if owner == 0:
                continue
            if self.rank == 0:
                received[k] = torch.empty(self.layout.slots[k].shape, dtype=_CODES[code], device=self.device)
                works.append(dist.irecv(received[k], src=self.stage_ranks[owner]))
            elif owner == self.stage:
                works.append(dist.isend(got[k].contiguous(), dst=self.stage_ranks[0]))
        for w in works:
            w.wait()
        return received

    # -- driving -----------------------------------------------------------------------------------

    def _control(self, go: int, first: int = 0, count: int = 0) -> tuple[int, int, int]:
        msg = torch.tensor([go, first, count], dtype=torch.int64).to(self.device)
        dist.broadcast(msg, src=dist.get_global_rank(self.group, 0), group=self.group)
        go, first, count = (int(v) for v in msg.tolist())
        return go, first, count

    @contextlib.contextmanager
    def leading(self) -> Iterator[None]:
        """The leader: wrap each Sender.refit so the other ranks are released however it ends."""
        self.sync()
        self._kept, self._leading = {}, True
        try:
            yield
        finally:
            self._leading, self._kept = False, {}
            self._control(0)

    def follow(self) -> None:
        """Every other rank: take part in one refit's gathers until the leader says it ended."""
        self.sync()
        self._kept = {}
        while True:
            go, first, count = self._control(0)
            if not go:
                self._kept = {}
                return
            self._gather(first, first + count - 1)

    def predicted_gather_bytes(self, manifest: Manifest) -> int:
        """The leader's peak bytes of gathered Megatron parameters for this manifest's buckets."""
        peak, kept = 0, set()
        for segs in manifest.segments:
            names = [manifest.entries[s.entry].name for s in segs]
            keys = {self._slot_of[n] for n in names}
            peak = max(peak, sum(self._slot_bytes(k) for k in keys | kept))
            if names:
                kept = {k for k in keys | kept if self._last[k] > self._pos[names[-1]]}
        return peak

    def _slot_bytes(self, key: str) -> int:
        shape = self.layout.slots[key].shape
        return int(torch.Size(shape).numel()) * _CODES[self._table[key][1]].itemsize


def megatron_refit(source: MegatronSource, sender, version: int):  # type: ignore[no-untyped-def]
    """Call on every model-parallel rank: the leader (which holds `sender`) refits, the others follow."""
    if source.rank == 0:
        if sender is None:
            raise ValueError("the model-parallel group's first rank must pass its Sender to megatron_refit")
        with source.leading():
            return sender.refit(version)
    source.follow()
    return None
