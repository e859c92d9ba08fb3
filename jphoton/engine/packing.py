"""Packing a planned step into its one host input (plain numpy on the host; the runner transfers it). Every step's input is one
int32 buffer of the largest layout's length, whatever its shape (engine/step.py `StepLayout`)."""

from __future__ import annotations

import dataclasses
import itertools

import numpy as np

from jphoton.engine.plan import DecodeRows, StepPlan, StepShape
from jphoton.engine.sampling import seed_key_data
from jphoton.engine.slots import StepInput
from jphoton.engine.step import AUTOMATON_ADVANCE, AUTOMATON_CARRIED, AUTOMATON_GIVEN, StepLayout, StepStatic


class StepPacker:
    def __init__(self, static: StepStatic, packed_size: int, lora_enabled: bool):
        self.static, self.packed_size, self.lora_enabled = static, packed_size, lora_enabled
        self._layouts: dict[StepShape, StepLayout] = {}
        self._steady: _SteadyPack | None = None  # the last decode-only pack (`pack`)
        self._empties: dict[StepLayout, dict[str, np.ndarray]] = {}
        self._rings: dict[StepLayout, list] = {}  # steady packs' buffers (views) by layout, reused in turn (`_next_buffer`)
        self.steady_packs = 0  # packs that started from the previous one (telemetry; tests check it)

    def layout(self, shape: StepShape) -> StepLayout:
        if shape not in self._layouts:
            self._layouts[shape] = StepLayout(shape, self.static, self.packed_size)
        return self._layouts[shape]

    def pack(self, plan: StepPlan, automata: bool = False) -> StepInput:
        """The step's one packed host input. A decode-only step of the previous pack's shape whose rows are mostly
        that pack's sequences starts from a copy of its buffer (`_SteadyPack`): rows that moved are copied, new ones
        written, and then only the per-step columns and the pages added since. At 64 rows on the CI box: 40 us with
        the same rows, 105 us with one finished and one new (every row after it moved), 150 us from scratch
        (the block tables are most of the buffer)."""
        inp = self._pack(plan)
        layout = self.layout(plan.shape)
        if automata:
            self._pack_automata(plan, layout.views(inp.packed))
        else:  # the free state for every row (a steady pack starts from the last buffer)
            o, _ = layout.fields["g_state"]
            inp.packed[o:o + 2 * plan.shape.rows] = 0  # g_state, then g_mode (AUTOMATON_GIVEN)
        return inp

    def _pack(self, plan: StepPlan) -> StepInput:
        prev, self._steady = self._steady, None
        d = plan.decode
        if d and not plan.prefill:
            if prev is not None and prev.shape == plan.shape:
                ok, src = self._start_from(prev, d)
                if ok:
                    return self._pack_steady(plan, prev, src)
            inp = self._pack_full(plan)
            tables = [s.block_table for s in d.seqs]
            self._steady = _SteadyPack(plan.shape, list(d.seqs), tables, list(map(len, tables)),
                                       self.layout(plan.shape).views(inp.packed))
            return inp
        # A step with prefill rows: its decode rows are packed as a decode-only step would be (from the last decode
        # pack, which the next decode step then starts from: under staggered arrivals every few steps carry a
        # newcomer's prefill, and a full pack after each of them made the planning of most decode steps ~0.19 ms
        # slower than a static batch's at 64 rows on the H200), then copied beside the prefill rows.
        if d and prev is not None and prev.shape.decode_rows == plan.shape.decode_rows:
            ok, src = self._start_from(prev, d)
            if ok:
                self._pack_steady(StepPlan(plan.step_id, d, [], prev.shape), prev, src)
                return self._pack_mixed(plan, self._steady.views)
        self._steady = prev
        return self._pack_full(plan)

    @staticmethod
    def _start_from(prev: _SteadyPack, d: DecodeRows) -> tuple[bool, list[int] | None]:
        """Whether decode rows `d` start from the previous pack, and how: None, the same rows in the same order; else
        each row's row there (-1: new). Not when most rows are new (a full pack is as cheap). Under churn (requests
        finishing and arriving every few steps) most decode steps change their rows by one or two: this keeps them
        off the full pack, ~4x the steady one at 64 rows."""
        if prev.seqs == d.seqs:  # (Sequence has no __eq__: identity, element by element in C)
            return True, None
        where = {id(s): j for j, s in enumerate(prev.seqs)}
        src = [where.get(id(s), -1) for s in d.seqs]
        return 4 * src.count(-1) <= len(d), src

    @staticmethod
    def _pack_automata(plan: StepPlan, v: dict[str, np.ndarray]) -> None:
        """Each automaton row's state for a step that samples them on the device (engine/step.py AUTOMATON_*): the host
        knows it when the row's input token is committed; else the carried token was drawn on the device either under
        the automaton (its state output is read there) or at a finalize (every token before it is committed: the host's
        state is the one before it). Other rows: the free state."""
        state, mode = v["g_state"], v["g_mode"]
        state[:] = 0
        mode[:] = AUTOMATON_GIVEN
        for row in plan.rows:
            c = row.seq.constraint
            device = c.device if c is not None else None
            if device is None or not row.samples:
                continue
            state[row.out_row] = device.global_state
            if row.carry_from >= 0:
                mode[row.out_row] = AUTOMATON_CARRIED if row.seq.automaton_on_device else AUTOMATON_ADVANCE

    def _pack_steady(self, plan: StepPlan, prev: _SteadyPack, src: list[int] | None) -> StepInput:
        """Start from the previous decode-only pack of the same shape. src: each row's row there (-1: a new sequence),
        None: the same rows in the same order. Moved rows copy their per-sequence fields (table, sampling parameters,
        LoRA slot) from the old row, new rows are written, rows no longer used go back to padding; then only the
        per-step columns and the pages added since are written."""
        self.steady_packs += 1
        layout = self.layout(plan.shape)
        v = self._next_buffer(layout)
        np.copyto(v["_buffer"], prev.views["_buffer"])
        d = plan.decode
        n = len(d)
        table = v["d_table"]
        if src is not None:
            old = prev.views
            for a, b, shift in _runs(src):  # moved rows, as slices (one finish moves every row after it up one)
                for f in _ROW_FIELDS:
                    v[f][a:b] = old[f][a + shift:b + shift]
            if len(prev.seqs) > n:  # rows that held sequences now pad
                empty = self._empty(layout)
                for f in _DECODE_FIELDS:
                    v[f][n:len(prev.seqs)] = empty[f][n:len(prev.seqs)]
            new = [i for i, j in enumerate(src) if j < 0]
            if new:
                self._write_sampling(v, new, [d.seqs[i] for i in new])
                if self.lora_enabled:
                    v["d_lora"][new] = [d.seqs[i].lora_slot for i in new]
            tables = [prev.tables[j] if j >= 0 else None for j in src]
            lengths = [prev.lengths[j] if j >= 0 else 0 for j in src]
            prev = _SteadyPack(plan.shape, list(d.seqs), tables, lengths, prev.views)
        v["d_tokens"][:n] = d.tokens
        v["d_carry"][:n] = d.carry
        v["d_pos"][:n] = d.start
        v["sample_index"][:n] = d.sample_index
        for i, s in enumerate(d.seqs):  # tables only grow in place (a new list object means a new table)
            t = s.block_table
            if t is not prev.tables[i]:
                table[i] = self.static.trash_page
                table[i, :len(t)] = t
                prev.tables[i] = t
            elif len(t) != prev.lengths[i]:
                table[i, prev.lengths[i]:len(t)] = t[prev.lengths[i]:]
            prev.lengths[i] = len(t)
        prev.views = v
        self._steady = prev
        return StepInput(plan.shape, v["_buffer"])

    def _next_buffer(self, layout: StepLayout) -> dict[str, np.ndarray]:
        """The views of the layout's next steady-pack buffer. RING buffers are reused in turn: when one comes round
        again, the step that read it is committed (at most three steps are in flight when a step is planned), so its
        input has reached the device long before. Fixed buffers and their views, not a new copy each step: the
        views alone cost ~8 us to build (CPU box)."""
        ring = self._rings.get(layout)
        if ring is None:
            ring = self._rings[layout] = [layout.views(np.empty(layout.buffer_size, np.int32)) for _ in range(RING)]
        ring.append(ring.pop(0))
        return ring[-1]

    def _empty(self, layout: StepLayout) -> dict[str, np.ndarray]:
        """The layout's padding values (cached; read only)."""
        if layout not in self._empties:
            self._empties[layout] = layout.empty(self.static.trash_page)
        return self._empties[layout]

    @staticmethod
    def _write_sampling(v: dict[str, np.ndarray], out: list[int] | slice, seqs: list) -> None:
        """Each sequence's sampling parameters at its output row (`out`; sample_index is per step: written by the
        callers)."""
        v["temperature"].view(np.float32)[out] = [s.params.temperature for s in seqs]
        v["key"][out] = seed_key_data(np.array([s.seed for s in seqs], np.uint64)).view(np.int32)
        v["top_k"][out] = [s.params.top_k for s in seqs]
        v["top_p"].view(np.float32)[out] = [s.params.top_p for s in seqs]
        v["spatial"][out] = [s.spatial_mode for s in seqs]

    def _pack_mixed(self, plan: StepPlan, decode: dict[str, np.ndarray]) -> StepInput:
        """A step with prefill rows whose decode rows are packed already, in `decode` (a decode-only layout's views
        with as many decode rows): copied over, then the prefill rows written. Half a full pack's time at 64 decode
        rows (their block tables are most of it)."""
        v = self.layout(plan.shape).empty(self.static.trash_page)
        for f in _DECODE_ONLY_FIELDS:
            v[f][:] = decode[f]
        bd = plan.shape.decode_rows
        for f in _SAMPLING_FIELDS:
            v[f][:bd] = decode[f][:bd]
        self._pack_prefill(v, plan.prefill)
        return StepInput(plan.shape, v["_buffer"])

    def _pack_prefill(self, v: dict[str, np.ndarray], prefill: list) -> None:
        for j, row in enumerate(prefill):
            v["p_lora"][j] = row.seq.lora_slot
            v["p_tokens"][j, :row.num_tokens] = row.tokens
            v["p_start"][j] = row.start
            v["p_len"][j] = row.num_tokens
            table = row.seq.block_table
            v["p_table"][j, :len(table)] = table
        if prefill:
            out = [row.out_row for row in prefill]
            self._write_sampling(v, out, [row.seq for row in prefill])
            v["sample_index"][out] = [row.sample_index for row in prefill]

    def _pack_full(self, plan: StepPlan) -> StepInput:
        shape = plan.shape
        v = self.layout(shape).empty(self.static.trash_page)
        # Column-wise fills (one numpy call per field, not per row): packing is on the host's critical path.
        if d := plan.decode:
            n = len(d)
            v["d_tokens"][:n] = d.tokens
            v["d_carry"][:n] = d.carry
            v["d_pos"][:n] = d.start
            _fill_ragged(v["d_table"], [s.block_table for s in d.seqs])
            if self.lora_enabled:
                v["d_lora"][:n] = [s.lora_slot for s in d.seqs]
            self._write_sampling(v, slice(0, n), d.seqs)
            v["sample_index"][:n] = d.sample_index
        self._pack_prefill(v, plan.prefill)
        return StepInput(shape, v["_buffer"])


RING = 4  # steady-pack buffers per layout (`StepPacker._next_buffer`): one is rewritten 4 steady packs after its step

# a decode-only step's per-sequence fields by row (copied when a row moves), and every field of a decode row
_ROW_FIELDS = ("d_table", "d_lora", "temperature", "key", "top_k", "top_p", "spatial")
_DECODE_FIELDS = _ROW_FIELDS + ("d_tokens", "d_carry", "d_pos", "sample_index", "g_state", "g_mode")
# (`_pack_mixed`) the fields of decode rows only, and the per-output-row fields a decode pack fills (automaton fields:
# written by `pack` afterwards)
_DECODE_ONLY_FIELDS = ("d_tokens", "d_carry", "d_pos", "d_table", "d_lora")
_SAMPLING_FIELDS = ("temperature", "key", "top_k", "top_p", "sample_index", "spatial")


def _runs(src: list[int]) -> list[tuple[int, int, int]]:
    """Rows that moved (src[i] = their old row, -1: new), as runs [a, b) whose old rows are [a + shift, b + shift)."""
    runs: list[list[int]] = []
    for i, j in enumerate(src):
        if j < 0 or j == i:
            continue
        if runs and runs[-1][1] == i and runs[-1][2] == j - i:
            runs[-1][1] = i + 1
        else:
            runs.append([i, i + 1, j - i])
    return [tuple(r) for r in runs]


@dataclasses.dataclass
class _SteadyPack:
    """The last decode-only pack, for the next one to start from: its sequences (rows in order), each one's block table
    object and how many of its pages were packed, and the views of its buffer."""

    shape: StepShape
    seqs: list
    tables: list[list[int]]
    lengths: list[int]
    views: dict[str, np.ndarray]


def _fill_ragged(out: np.ndarray, rows: list[list[int]]) -> None:
    """out[i, :len(rows[i])] = rows[i] for every i, as one masked assignment: a numpy assignment per row cost ~1.3 us
    each, most of the ~190 us that packing 128 decode rows took on the CPU here (benchmarks/host_overhead.py)."""
    if len(rows) <= 8:  # the masked assignment's fixed cost (~10 us of numpy calls) is more than a few rows' loop
        for i, row in enumerate(rows):
            out[i, :len(row)] = row
        return
    lengths = np.fromiter(map(len, rows), np.int64, len(rows))
    total = int(lengths.sum())
    if total:
        filled = np.arange(out.shape[1])[None, :] < lengths[:, None]  # row-major, like the flattened tables
        out[:len(rows)][filled] = np.fromiter(itertools.chain.from_iterable(rows), np.int32, total)
