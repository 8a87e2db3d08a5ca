"""MegatronSource: a megatron-core GPTModel sharded with tensor (TP) and pipeline (PP) parallelism as the
source, sent under Hugging Face checkpoint names (Llama, Qwen2 and Qwen3-MoE layouts, refit.sources.megatron_layout).

Every rank of the model-parallel group (TP x PP ranks of one data-parallel replica) builds the source;
the first rank of that group (TP rank 0 of the first stage) also holds the Sender. The specs come from
the config (names and global shapes) and one small table all ranks agree on per refit (which stage
owns each parameter, in which dtype), so nothing is gathered to know them. Each bucket is gathered
on its own, one checkpoint tensor at a time: every TP rank of the owning stage converts its shard
into its shard of that tensor (a Megatron shard holds whole query groups and its own [gate; up]), the
pieces are all-gathered over the TP group, and TP rank 0 sends the result to the leader. So the
leader holds one bucket's tensors (plus one split across the bucket boundary, kept for the next
run), never a fused parameter whole. The leader announces each bucket to the others with a
3-integer broadcast (go, first, count), as `FsdpSource` does, so no rank needs the manifest.
megatron-core is imported only where a process group is looked up.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Hashable, Iterator, Mapping, Sequence

import torch
import torch.distributed as dist
from torch import nn

from refit.layout.manifest import Manifest
from refit.layout.spec import Slice, TensorSpec
from refit.log import get_logger
from refit.sources.base import Source, WireDtypes
from refit.sources.megatron_layout import GptLayout, merge

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
        """Collective: every model-parallel rank builds it together. `vocab_size`: the checkpoint's
        vocabulary, the rows of the embedding and lm_head the engine expects (default: the model's rows,
        which Megatron pads to a multiple of `make_vocab_size_divisible_by` x TP; the padded rows are
        gathered and cut off, never sent); `wire_dtype` casts every tensor (e.g. fp32 master weights sent
        as bf16); `overrides` set single checkpoint names' wire dtypes."""
        ps = _parallel_state()
        self.model = unwrap(model)
        config = self.model.config
        rows = int(self.model.vocab_size)
        tied = bool(getattr(self.model, "share_embeddings_and_output_weights", False))
        self.layout = GptLayout.from_megatron(
            config, vocab_size=vocab_size or rows, padded_vocab_size=rows, tied_embeddings=tied
        )
        self.group = ps.get_model_parallel_group()
        self.tp_group = ps.get_tensor_model_parallel_group()
        self.tp_rank = ps.get_tensor_model_parallel_rank()
        self.stage = ps.get_pipeline_model_parallel_rank()
        self.stage_ranks = dist.get_process_group_ranks(ps.get_pipeline_model_parallel_group())
        self.rank = dist.get_rank(self.group)
        self.device = next(self.model.parameters()).device
        """Where gathers land and control tensors live (NCCL groups need CUDA tensors)."""
        if self.rank == 0 and (self.tp_rank or self.stage):
            raise ValueError(
                "the model-parallel group's first rank must be TP rank 0 of the first stage "
                "(megatron-core's default rank order); initialise parallel_state with it"
            )
        self._shapes = self.layout.hf_shapes()
        self._gathered = self.layout.hf_shapes(padded=True)
        """Each name's global shape as its TP shards concatenate (the vocabulary padded), before `trim`."""
        self._order = list(self._shapes)
        self._tensors = self._shapes  # type: ignore[assignment]  # WireDtypes checks override names against it
        self._slot_of = {n: s.key for s in self.layout.slots.values() for n in s.hf_names}
        self._pos = {n: i for i, n in enumerate(self._order)}
        self._dim = {n: s.partition_dim for s in self.layout.slots.values() for n in s.hf_names}
        self._piece = {n: i for s in self.layout.slots.values() for i, n in enumerate(s.hf_names)}
        self._kept: tuple[str, torch.Tensor | None] | None = None
        """The last name of the previous run and its tensor (the leader's; None elsewhere): a tensor split
        across buckets is asked for again at the start of the next run."""
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

    # -- M:N: this rank's shards, converted locally, never gathered -------------------------------

    def prepare_refit(self) -> None:
        self.sync()

    def holdings(self) -> dict[str, Slice | None]:
        """Per checkpoint name this rank's stage owns: its TP shard (rows or columns), or None for a tensor
        every TP rank holds whole (norms, the router); the vocabulary padding is never part of a slice."""
        out: dict[str, Slice | None] = {}
        for name in self._order:
            if self._slot_of[name] not in self._params:
                continue
            d = self._dim[name]
            if d is None or self.layout.tp == 1:
                out[name] = None
                continue
            size = self._gathered[name][d] // self.layout.tp
            start = self.tp_rank * size
            out[name] = Slice(d, min(start, self._shapes[name][d]), max(0, min(size, self._shapes[name][d] - start)))
        return out

    def local_tensors(self, names: Sequence[str]) -> list[torch.Tensor]:
        """This rank's part of each checkpoint tensor, as `holdings` states it: a view of its live shard, or
        a local copy where the checkpoint layout interleaves it (the query groups of a fused qkv)."""
        held = self.holdings()
        out = []
        with torch.no_grad():
            for n in names:
                key = self._slot_of[n]
                t = self.layout.to_hf(key, self._params[key].detach(), ranks=1)[self._piece[n]]
                h = held[n]
                out.append(t if h is None else t.narrow(h.dim, 0, h.length))
        return out

    # -- gathering ---------------------------------------------------------------------------------

    def tensors(self, names: Sequence[str]) -> list[torch.Tensor]:
        """The checkpoint tensors for a run of consecutive names (the leader; announced to the others)."""
        if not names:
            return []
        first = self._pos[names[0]]
        if list(names) != self._order[first : first + len(names)]:
            raise ValueError("MegatronSource serves contiguous runs of names in name order (as the planner lays them)")
        if not self._leading:  # also with one rank: megatron_refit re-reads the live parameters first
            raise ValueError(
                "MegatronSource.tensors runs inside megatron_refit on every rank; call "
                "megatron_refit(source, sender, version) instead of sender.refit(version)"
            )
        self._control(1, first, len(names))
        return self._gather(first, first + len(names) - 1)

    def _gather(self, first: int, last: int) -> list[torch.Tensor]:
        """Every rank: the checkpoint tensors names[first..last], each converted on its TP shards, gathered
        over TP and sent to the leader (only the leader gets them back). The run's last tensor is kept
        until the next run, which starts with it when it is split across buckets."""
        names = self._order[first : last + 1]
        kept = self._kept if self._kept is not None and self._kept[0] == names[0] else None
        self._kept = None
        todo = names[1:] if kept else names
        got = self._over_tp(todo)
        got.update(self._to_leader(todo, got))
        if kept is not None and kept[1] is not None:
            got[names[0]] = kept[1]
        if self.rank != 0:
            got = {}
        nbytes = sum(t.numel() * t.element_size() for t in got.values())
        self.peak_gathered_bytes = max(self.peak_gathered_bytes, nbytes)
        self.gather_counts.update(todo)
        self._kept = (names[-1], got.get(names[-1]))
        return [got[n] for n in names] if self.rank == 0 else []

    def _over_tp(self, names: list[str]) -> dict[str, torch.Tensor]:
        """The tensors this rank's stage owns: each rank converts its shard into its shard of the checkpoint
        tensor, then the pieces are all-gathered over the TP group (all in flight at once)."""
        pending = []
        with torch.no_grad():
            for n in names:
                key = self._slot_of[n]
                if key not in self._params:
                    continue
                piece = self.layout.to_hf(key, self._params[key].detach(), ranks=1)[self._piece[n]]
                if self._dim[n] is None or self.layout.tp == 1:
                    pending.append((n, piece.unsqueeze(0), None))
                    continue
                piece = piece.contiguous()
                flat = piece.new_empty(self.layout.tp * piece.numel())  # gloo gathers flat tensors only
                work = dist.all_gather_into_tensor(flat, piece.view(-1), group=self.tp_group, async_op=True)
                pending.append((n, flat.view(self.layout.tp, *piece.shape), work))
        got = {}
        for n, out, work in pending:
            if work is not None:
                work.wait()
            if self.tp_rank == 0:
                got[n] = self.layout.trim(self._slot_of[n], merge(out, self._dim[n], self._gathered[n]))
        return got

    def _to_leader(self, names: list[str], got: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Tensors owned by later stages, sent by their TP rank 0 to the leader (point to point)."""
        if self.tp_rank != 0:
            return {}
        works, received = [], {}
        for n in names:
            owner, code = self._table[self._slot_of[n]]
            if owner == 0:
                continue
            if self.rank == 0:
                received[n] = torch.empty(self._shapes[n], dtype=_CODES[code], device=self.device)
                works.append(dist.irecv(received[n], src=self.stage_ranks[owner]))
            elif owner == self.stage:
                works.append(dist.isend(got[n].contiguous(), dst=self.stage_ranks[0]))
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
        self._kept, self._leading = None, True
        try:
            yield
        finally:
            self._leading, self._kept = False, None
            self._control(0)

    def follow(self) -> None:
        """Every other rank: take part in one refit's gathers until the leader says it ended."""
        self.sync()
        self._kept = None
        while True:
            go, first, count = self._control(0)
            if not go:
                self._kept = None
                return
            self._gather(first, first + count - 1)

    def predicted_gather_bytes(self, manifest: Manifest) -> int:
        """The leader's peak bytes of gathered tensors for this manifest: its largest bucket's tensors, whole
        and in the training dtype (a tensor split across buckets counts in each)."""
        peak = 0
        for segs in manifest.segments:
            names = {manifest.entries[s.entry].name for s in segs}
            peak = max(peak, sum(self._nbytes(n) for n in names))
        return peak

    def _nbytes(self, name: str) -> int:
        return int(torch.Size(self._shapes[name]).numel()) * _CODES[self._table[self._slot_of[name]][1]].itemsize
