"""Top-k / top-p sampling without sorting the vocabulary: a threshold search with early exit, over Gumbel-max noise.
On the GPU, XLA reductions over the batch first (`prephase`: settles most top-p rows), then one Pallas (Triton) kernel
in which several programs share each row; elsewhere, row-vectorised `lax.while_loop`s; both run `_select_row`.

Invariants: the kept set is the sort-based reference's (jphoton/engine/sampling.py `_filter_top_k_top_p`) up to float
summation order and exact ties at the top-k boundary; the noise is the caller's, so a seed draws the reference's token
whenever the kept sets agree; no row takes more than 32 sweeps. A row's programs meet at a spin barrier, so all must be
resident: at most one per SM (`programs_per_row`), on one stream; where other work holds SMs (MPS), pass `programs=1`.
Algorithm: docs/kernels.md, "Filtered sampling"; numbers: docs/decisions.md, "Top-k / top-p sampling without a sort".
"""

from __future__ import annotations

import functools
import logging
import warnings

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.common import log_once, use_interpret

log = logging.getLogger("jphoton.kernels")

KEY_NEG_INF = -2139095041  # float_keys(-inf)
PROBES = 8  # top-k bisection probes a sweep (a power of two for Triton): the bracket shrinks 9x a sweep


def float_keys(x: jax.Array) -> jax.Array:
    """float32 -> int32 in the same order (-inf lowest; no NaN)."""
    b = jax.lax.bitcast_convert_type(x, jnp.int32)
    return b ^ ((b >> 31) & 0x7FFFFFFF)


def key_value(k: jax.Array) -> jax.Array:
    """The float32 that an order key stands for (float_keys's inverse)."""
    return jax.lax.bitcast_convert_type(k ^ ((k >> 31) & 0x7FFFFFFF), jnp.float32)


def _split(lo, hi, j, n: int):
    """Probes j / (n + 1) of the way through (lo, hi] (int32; j: uint32 in 1..n): lo + ceil(j * (hi - lo) / (n + 1)),
    in a form that stays inside 32 bits (the span can reach 2^32 - 1)."""
    span = jax.lax.bitcast_convert_type(hi - lo, jnp.uint32)  # hi >= lo: the difference fits an unsigned word
    step = span // jnp.uint32(n + 1)
    rem = span - step * jnp.uint32(n + 1)
    off = step * j + (rem * j + jnp.uint32(n)) // jnp.uint32(n + 1)
    return lo + jax.lax.bitcast_convert_type(off, jnp.int32)


def _mid(lo, hi):
    """ceil((lo + hi) / 2) in int32 without overflow."""
    return (lo & hi) + ((lo ^ hi) >> 1) + ((lo ^ hi) & 1)


def _select_row(sweep_count, sweep_mass, key_at, top_k, top_p, V: int, m, m_low, start, aux):
    """One row's sample index. m, m_low: the row's largest and smallest finite scaled value; start: the top-p
    search's state after the rejection steps done for the whole batch (`prephase`), used when the row has no top-k.
    The sweeps read the row (see the callers): sweep_count(t [PROBES], lo, c_lo, aux) -> (counts of keys >= t, aux),
    where lo is the search's lower bound and c_lo the count of keys >= lo; sweep_mass(ta, tb, aux) -> (mass of keys
    >= ta, mass of keys >= tb, argmax noisy over keys >= ta, same over >= tb), mass = sum exp(scaled - m); key_at(i)
    -> the order key of scaled[i]. aux: the caller's state, carried from sweep to sweep (the kernel's compacted
    candidate set; every later threshold is >= the lo it was built at)."""
    key_m = float_keys(m)
    use_k = (top_k > 0) & (top_k < V)

    def k_body(st):
        # Two probes evenly spaced in order keys (the bracket shrinks 3x a sweep whatever the values: no row takes
        # more than ~20 sweeps), six in value around where the k-th value should be if log(count) fell linearly across
        # the bracket, as a logit tail roughly does: 3-5 sweeps for k <= 1000 on normal, Gumbel, log-normal and
        # peaked rows of 128256 (6e55017:lab/probes/topp_cost.py), where key probes alone took 8-12.
        lo, hi, c_lo, c_up, aux = st  # count(keys >= lo) = c_lo >= k > c_up = count(keys > hi)
        probe = jnp.arange(PROBES, dtype=jnp.int32)
        v_lo = jnp.maximum(key_value(lo), m_low)
        v_hi = key_value(hi)
        log_c_lo = jnp.log(c_lo.astype(jnp.float32))
        est = (log_c_lo - jnp.log(top_k - 0.5)) / (log_c_lo - jnp.log(c_up + 0.5))
        spread = jnp.where(probe < 5, -1.0, 1.0) * jnp.where((probe == 2) | (probe == 7), 0.2,
                                                              jnp.where((probe == 3) | (probe == 6), 0.05, 0.01))
        by_value = float_keys(v_lo + (v_hi - v_lo) * jnp.clip(est + spread, 0.0, 1.0))
        t = jnp.where(probe < 2, _split(lo, hi, (probe + 1).astype(jnp.uint32), 2), jnp.clip(by_value, lo + 1, hi))
        c, aux = sweep_count(t, lo, c_lo, aux)
        ge = c >= top_k
        exact = jnp.max((c == top_k).astype(jnp.int32)) > 0
        best = jnp.max(jnp.where(ge, t, lo))
        c_best = jnp.min(jnp.where(ge, c, c_lo))
        hi2 = jnp.min(jnp.where(ge, hi, t - 1))
        c_up2 = jnp.max(jnp.where(ge, c_up, c))
        return best, jnp.where(exact, best, jnp.maximum(hi2, best)), c_best, c_up2, aux

    lo0 = jnp.int32(KEY_NEG_INF)  # every entry counts, masked (-inf) ones included
    kth, _, _, _, aux = jax.lax.while_loop(lambda st: st[0] < st[1], k_body,
                                           (lo0, jnp.where(use_k, key_m, lo0), jnp.int32(V), jnp.int32(0), aux))

    def top_k_start():
        zk, _, i0, _ = sweep_mass(kth, kth, aux)
        return kth, key_m, i0, (top_p >= 1.0) | (kth >= key_m), top_p * zk, aux

    def p_body(st):
        lo, hi, ic, _, target, aux = st
        kc1 = key_at(ic) + 1
        t = _mid(lo, hi)
        a, b, ia, ib = sweep_mass(kc1, t, aux)
        accept = a < target
        b_ok = b >= target
        lo2 = jnp.where(b_ok, jnp.maximum(kc1, t), kc1)
        hi2 = jnp.where(b_ok, hi, t - 1)
        nxt = jnp.where(b_ok & (t > kc1), ib, ia)
        return lo2, hi2, jnp.where(accept, ic, nxt), accept | (lo2 >= hi2), target, aux

    state = jax.lax.cond(use_k, top_k_start, lambda: (*start, aux))
    return jax.lax.while_loop(lambda st: ~st[3], p_body, state)[2]


def prephase(scaled: jax.Array, noisy: jax.Array, top_p: jax.Array):
    """The first step of every row's search over the whole batch at once, as XLA reductions that use the whole GPU:
    the row's max and min, its mass, and the first top-p candidate (the unfiltered sample). The rejection tests are the
    kernel's: a row with a top-k starts from its top-k set and never uses them, and testing two candidates here (two
    more passes over [R, V]) made top_k 50 over [32, 128256] 125 us against 108 for top_p 0.9 unchanged (65-66 us;
    H100, 6e55017:lab/probes/prephase_variants.py, docs/decisions.md). -> (m, m_low, start) for `_select_row`, each [R]."""
    m = jnp.max(scaled, axis=1)
    m_low = jnp.min(jnp.where(scaled > -jnp.inf, scaled, jnp.inf), axis=1)
    z = jnp.sum(jnp.exp(scaled - m[:, None]), axis=1)
    c1 = jnp.argmax(noisy, axis=1).astype(jnp.int32)
    lo, hi = jnp.full(m.shape, KEY_NEG_INF, jnp.int32), float_keys(m)
    return m, m_low, (lo, hi, c1, (top_p >= 1.0) | (lo >= hi), top_p * z)


# ------------------------------------------------------------------------------------------------ plain JAX (CPU)

def filtered_sample_xla(scaled: jax.Array, noisy: jax.Array, top_k: jax.Array, top_p: jax.Array) -> jax.Array:
    """The kernel's algorithm over whole rows (vmapped while loops): the path off the GPU, where loops are cheap.
    scaled, noisy [R, V] float32 (noisy: scaled + Gumbel noise); top_k [R] int32 (0 = off); top_p [R] float32 (1 =
    off). -> int32 [R]."""
    V = scaled.shape[-1]

    def row(s, y, k, p, m, m_low, start):
        keys = float_keys(s)

        def sweep_count(t, lo, c_lo, aux):
            return jnp.sum(keys[None, :] >= t[:, None], axis=1, dtype=jnp.int32), aux

        def sweep_mass(ta, tb, aux):
            e = jnp.exp(s - m)
            in_a, in_b = keys >= ta, keys >= tb
            return (jnp.sum(jnp.where(in_a, e, 0.0)), jnp.sum(jnp.where(in_b, e, 0.0)),
                    jnp.argmax(jnp.where(in_a, y, -jnp.inf)).astype(jnp.int32),
                    jnp.argmax(jnp.where(in_b, y, -jnp.inf)).astype(jnp.int32))

        return _select_row(sweep_count, sweep_mass, lambda i: keys[i], k, p, V, m, m_low, start, jnp.int32(0))

    return jax.vmap(row)(scaled, noisy, top_k, top_p, *prephase(scaled, noisy, top_p))


# ------------------------------------------------------------------------------------------------ Pallas (GPU)

def _kernel(k_ref, p_ref, m_ref, low_ref, lo_ref, hi_ref, cand_ref, done_ref, target_ref, s_ref, y_ref, parts_in,
            sync_in, out_ref, parts_ref, sync_ref, cs_ref, cy_ref, ci_ref, *, V, block, count_block, programs, unroll,
            cap, interpret):
    # Program (r, g) is the g-th of `programs` that share row r: each sweeps its own slice of the row, then the row's
    # programs exchange their partial sums through `parts_ref` behind a spin barrier on `sync_ref` (one per sweep), and
    # all of them take the same next step from the same totals. One program per row streamed a row at one SM's ~30-45
    # GB/s: a top-k count sweep took ~30 us.
    # Within a program, each sweep keeps running sums and argmaxes lane by lane (vectors of `block`) and reduces across
    # lanes once at its end: a reduction per block (shuffles and shared memory) made a sweep ~3x slower.
    # Top-k: once the row's count at the search's lower bound lo is <= cap, the next count sweep first copies each
    # program's entries >= lo (scaled, noisy, index; in index order) to its part of cs/cy/ci_ref, and every later sweep
    # of the row (counts, masses, argmaxes: all their thresholds are > lo) reads those few entries instead of the row.
    del parts_in, sync_in  # the same buffers as parts_ref / sync_ref (aliased): zeros on entry
    r, g = pl.program_id(0), pl.program_id(1)
    col = jnp.arange(block, dtype=jnp.int32)
    ninf = jnp.full((block,), -jnp.inf, jnp.float32)
    slot = jnp.arange(8, dtype=jnp.int32)
    dump = -(-cap // block) * block  # compaction writes of unselected lanes land past the compacted entries
    m = m_ref[r]

    def load(ref, b, n=block, fill=-jnp.inf, end=None, mask=None):
        """Block b of n entries of this row, as (values, their indices); entries past V read `fill` (rows are not
        padded: a padded copy of a [32, 128256] batch cost ~35 us of the sampler on the H100), and so does the whole
        block if b >= end, and any entry where `mask` is False. On the GPU a masked load at b * n (aligned: vector
        loads); interpret mode clamps an overrunning slice, so there the last block ends at V and masks what overlaps
        the block before it."""
        if interpret:
            start = jnp.minimum(b * n, V - n)
            idx = start + jnp.arange(n, dtype=jnp.int32)
            keep = idx >= b * n if end is None else (idx >= b * n) & (b < end)
            keep = keep if mask is None else keep & mask
            return jnp.where(keep, plgpu.load(ref.at[r, pl.ds(start, n)]), fill), idx
        idx = b * n + jnp.arange(n, dtype=jnp.int32)
        keep = idx < V if end is None else (idx < V) & (b < end)
        keep = keep if mask is None else keep & mask
        # (a block past the row, unrolled sweeps' last group: the address stays in the row, every lane masked)
        return plgpu.load(ref.at[r, pl.ds(jnp.minimum(b, -(-V // n) - 1) * n, n)] if end is not None
                          else ref.at[r, pl.ds(b * n, n)], mask=keep, other=fill), idx

    def my_blocks(n):
        """This program's blocks of n entries: [first, last)."""
        blocks = -(-V // n)
        per = -(-blocks // programs)
        first = g * per
        return first, jnp.minimum(first + per, blocks)

    def compact_blocks(n, size):
        """Blocks of `size` entries that hold this program's n compacted entries (none while n < 0: not compacted)."""
        return jnp.maximum(n + size - 1, 0) // size

    def load_compact(ref, b, size, n, fill):
        """Block b of `size` of this program's compacted entries; `fill` from the n-th on (all of it if n < 0)."""
        keep = b * size + jnp.arange(size, dtype=jnp.int32) < n
        at = jnp.minimum(b, (ref.shape[-1] - size) // size) * size  # (unrolled groups' last blocks: all masked)
        if interpret:
            return jnp.where(keep, plgpu.load(ref.at[r, g, pl.ds(at, size)]), fill)
        return plgpu.load(ref.at[r, g, pl.ds(at, size)], mask=keep, other=fill)

    def sweep_blocks(n, refs, body, init, run):
        """fori_loop over this program's blocks of n entries if `run`, `unroll` blocks an iteration: their loads are
        issued together, so that more bytes are in flight (one 16 KB load at a time streamed ~15-20 GB/s an SM).
        body(blocks, carry, last): blocks = one (block number, [values per ref], indices) per block."""
        first, last = my_blocks(n)
        last = jnp.where(run, last, first)

        def block_at(b, end):
            loaded = [load(f, b, n, end=end) for f in refs]
            return b, [v for v, _ in loaded], loaded[0][1]

        if unroll == 1:
            return jax.lax.fori_loop(first, last, lambda b, c: body([block_at(b, None)], c, None), init)

        def step(j, c):
            return body([block_at(first + j * unroll + u, last) for u in range(unroll)], c, last)

        return jax.lax.fori_loop(0, -(-(last - first) // unroll), step, init)

    def exchange(part):
        """part [8] float32 of this program -> [programs, 8]: every program's of this row, after all have stored."""
        if programs == 1:
            return part[None, :]
        seq = sync_ref[r, g]  # this program's sweeps so far (each program owns its count)
        parity = seq % 2  # two buffers: a program one sweep ahead never overwrites what another still reads
        plgpu.store(parts_ref.at[parity, r, g, pl.ds(0, 8)], part)
        plgpu.debug_barrier()  # every thread's store before this program's arrival
        plgpu.atomic_add(sync_ref, (r, programs), jnp.int32(1))
        want = (seq + 1) * programs
        jax.lax.while_loop(lambda seen: seen < want,
                           lambda _: plgpu.atomic_add(sync_ref, (r, programs), jnp.int32(0)), jnp.int32(0))
        plgpu.debug_barrier()
        sync_ref[r, g] = seq + 1
        return plgpu.load(parts_ref.at[parity, r, pl.ds(0, programs), pl.ds(0, 8)])

    def column(x, j):
        return jnp.sum(jnp.where(slot[None, :] == j, x, 0.0), axis=1)

    def first_argmax(best, idx):
        """The lowest index holding the largest value (lanes hold their first best): the argmax's tie rule."""
        top = jnp.max(best)
        return top, jnp.min(jnp.where(best == top, idx, V)).astype(jnp.int32)

    def sweep_count(t, lo, c_lo, n):
        # one accumulator vector per probe: a [count_block, PROBES] accumulator ran ~4x slower
        ts = [jnp.max(jnp.where(slot == j, t, KEY_NEG_INF)) for j in range(PROBES)]

        def count(keys, cs):
            return tuple(c + (keys >= tj).astype(jnp.int32) for c, tj in zip(cs, ts, strict=True))

        def body(blocks, cs, last):
            for _, (s,), _ in blocks:
                cs = count(float_keys(s), cs)
            return cs

        def body_compact(blocks, nn, last):
            for b, (s,), i in blocks:
                sel = float_keys(s) >= lo  # (lo > KEY_NEG_INF: never a lane past the row)
                y, _ = load(y_ref, b, count_block, end=last, mask=sel)
                pos = jnp.where(sel, nn + jnp.cumsum(sel.astype(jnp.int32)) - 1,
                                dump + jnp.arange(count_block, dtype=jnp.int32))
                for ref, v in ((cs_ref, s), (cy_ref, y), (ci_ref, i)):
                    plgpu.store(ref.at[r, g, pos], v, mask=sel)
                nn = nn + jnp.sum(sel.astype(jnp.int32))
            return nn

        # the compacting sweep copies, then counts the copy (no count accumulators live while it copies)
        compacting = (n < 0) & (c_lo <= cap) & (lo > KEY_NEG_INF)
        n = jnp.where(compacting, sweep_blocks(count_block, (s_ref,), body_compact, jnp.int32(0), compacting), n)
        if not interpret:
            plgpu.debug_barrier()  # the copy's stores (any thread) before its loads (any other) below
        zero = jnp.zeros((count_block,), jnp.int32)
        cs = sweep_blocks(count_block, (s_ref,), body, (zero,) * PROBES, n < 0)
        # (the same accumulators: a second set, reduced apart, made every sweep slower)
        cs = jax.lax.fori_loop(0, compact_blocks(n, count_block),
                               lambda b, c: count(float_keys(load_compact(cs_ref, b, count_block, n, -jnp.inf)), c),
                               cs)
        part = jnp.zeros((8,), jnp.float32)
        for j, c in enumerate(cs):
            part = jnp.where(slot == j, jnp.sum(c).astype(jnp.float32), part)
        return jnp.sum(exchange(part), axis=0).astype(jnp.int32), n  # counts < 2^24: exact in float32

    def sweep_mass(ta, tb, n):
        def accumulate(st, s, y, i):
            za, zb, va, ia, vb, ib = st
            keys = float_keys(s)
            e = jnp.exp(s - m)
            in_a, in_b = keys >= ta, keys >= tb
            take_a, take_b = in_a & (y > va), in_b & (y > vb)
            return (za + jnp.where(in_a, e, 0.0), zb + jnp.where(in_b, e, 0.0), jnp.where(take_a, y, va),
                    jnp.where(take_a, i, ia), jnp.where(take_b, y, vb), jnp.where(take_b, i, ib))

        def body(blocks, st, last):
            for _, (s, y), i in blocks:  # (blocks in order: a later block's equal value never wins, as in argmax;
                st = accumulate(st, s, y, i)  # compacted entries are in index order too)
            return st

        def lanes(st):
            za, zb, va, ia, vb, ib = st
            (ya, ja), (yb, jb) = first_argmax(va, ia), first_argmax(vb, ib)
            return jnp.sum(za), jnp.sum(zb), ya, ja, yb, jb

        zero = jnp.zeros((block,), jnp.float32)
        st = sweep_blocks(block, (s_ref, y_ref), body, (zero, zero, ninf, col, ninf, col), n < 0)
        st = jax.lax.fori_loop(
            0, compact_blocks(n, block),
            lambda b, st: accumulate(st, *(load_compact(f, b, block, n, fill) for f, fill in
                                           ((cs_ref, -jnp.inf), (cy_ref, -jnp.inf), (ci_ref, V)))), st)
        part = jnp.zeros((8,), jnp.float32)
        for j, v in enumerate(lanes(st)):
            part = jnp.where(slot == j, v.astype(jnp.float32), part)
        every = exchange(part)
        out = [jnp.sum(column(every, 0)), jnp.sum(column(every, 1))]
        for j in (2, 4):  # the largest noisy value over the programs, at its lowest index (indices < 2^24: exact)
            v, i = column(every, j), column(every, j + 1)
            out.append(jnp.min(jnp.where(v == jnp.max(v), i, float(V))).astype(jnp.int32))
        return tuple(out)

    def key_at(i):
        blk, idx = load(s_ref, i // block)
        return float_keys(jnp.max(jnp.where(idx == i, blk, -jnp.inf)))

    start = (lo_ref[r], hi_ref[r], cand_ref[r], done_ref[r] != 0, target_ref[r])
    i = _select_row(sweep_count, sweep_mass, key_at, k_ref[r], p_ref[r], V, m, low_ref[r], start, jnp.int32(-1))

    @pl.when(g == 0)
    def _():
        plgpu.store(out_ref.at[pl.ds(r, 1)], jnp.full((1,), i, jnp.int32))


MIN_SHARE = 1024  # entries a program sweeps at least


def programs_per_row(rows: int, vocab: int) -> int:
    """How many programs share a row: the rows together fill the GPU's SMs once (a spin barrier needs every program of
    a row resident at once: one program per SM at most, whatever else the GPU runs), a power of two, each with at
    least MIN_SHARE entries to sweep."""
    try:
        sms = int(getattr(jax.devices()[0], "core_count", 0)) or 100
    except RuntimeError:
        sms = 100
    per = max(1, min(sms // max(rows, 1), vocab // MIN_SHARE))
    return 1 << (per.bit_length() - 1)


def filtered_sample(scaled: jax.Array, noisy: jax.Array, top_k: jax.Array, top_p: jax.Array, *, block: int = 2048,
                    count_block: int = 2048, num_warps: int = 16, num_stages: int = 1, programs: int | None = None,
                    unroll: int | None = None, compact_cap: int = 16384,
                    interpret: bool | None = None) -> jax.Array:
    """As `filtered_sample_xla`: `prephase` over the batch, then `programs` programs per row for what is left (a row
    the prephase settled only stores its answer; None: `programs_per_row`, 1 in interpret mode, which runs programs
    one after another and so cannot wait at a barrier). unroll: blocks whose loads a sweep issues together (None: 2
    where a program sweeps at least 4 count blocks, as at 32 rows; 1 below, where it only cost time). compact_cap:
    a top-k row's search reads only its entries >= its lower bound once they are at most this many. block: sweeps of
    8192 spilled registers (ptxas) and made the compacted search slower than the whole-row one; at 2048, top_k 50 over
    [32, 128256] took 124 us on the H100 against 149 (docs/decisions.md, top-k section)."""
    if scaled.ndim != 2 or noisy.shape != scaled.shape:
        raise ValueError(f"scaled and noisy must be the same [R, V]; got {scaled.shape}, {noisy.shape}")
    R, V = scaled.shape
    if compact_cap < 1:
        raise ValueError(f"compact_cap must be >= 1, got {compact_cap}")
    interp = use_interpret(interpret)
    if programs is None:
        programs = 1 if interp else programs_per_row(R, V)
    if (interp and programs != 1) or programs & (programs - 1):
        raise ValueError(f"programs must be a power of two (1 in interpret mode), got {programs}")
    # blocks of at most a program's share (a power of two <= V: interpret mode's last block overlaps)
    share = -(-V // programs)
    block = max(256, min(block, 1 << (V.bit_length() - 1), 1 << max(share - 1, 1).bit_length()))
    count_block = min(count_block, block)
    if unroll is None:
        # H100, [32, 128256] (4 programs a row, blocks of 8192), top_k 50: 173 -> 151 us with 2, 155 with 4; [1, 128256]:
        # 43 -> 45.5
        unroll = 2 if share >= 4 * count_block else 1
    log_once(log, ("filtered_sample", interp, R, V, programs), "filtered_sample [%d, %d], %d programs a row, %d blocks "
             "a load: %s", R, V, programs, unroll, "Pallas interpret mode (no GPU)" if interp else "Pallas Triton on GPU")
    top_p = top_p.astype(jnp.float32)
    m, m_low, (lo, hi, cand, done, target) = prephase(scaled, noisy, top_p)
    cap = min(compact_cap, V)  # (a row never holds more: the same search, a smaller buffer for a small vocabulary)
    kernel = functools.partial(_kernel, V=V, block=block, count_block=count_block, programs=programs,
                               unroll=unroll, cap=cap, interpret=interp)
    parts = jnp.zeros((2, R, programs, 8), jnp.float32)
    # each program's compacted entries, then count_block slots that unselected lanes' (masked) writes point at
    compact = (R, programs, -(-cap // block) * block + count_block)
    sync = jnp.zeros((R, programs + 1), jnp.int32)  # per row: each program's sweep count, then the arrivals
    with warnings.catch_warnings():  # jax 0.11 warns that the Triton backend is deprecated, once per trace
        warnings.filterwarnings("ignore", message=".*Triton backend is deprecated.*")
        out, *_ = pl.pallas_call(
            kernel,
            grid=(R, programs),
            out_shape=(jax.ShapeDtypeStruct((R,), jnp.int32), jax.ShapeDtypeStruct(parts.shape, parts.dtype),
                       jax.ShapeDtypeStruct(sync.shape, sync.dtype), jax.ShapeDtypeStruct(compact, jnp.float32),
                       jax.ShapeDtypeStruct(compact, jnp.float32), jax.ShapeDtypeStruct(compact, jnp.int32)),
            input_output_aliases={11: 1, 12: 2},
            interpret=interp,
            compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
            name=f"filtered_sample_R{R}",
        )(top_k.astype(jnp.int32), top_p, m, m_low, lo, hi, cand, done.astype(jnp.int32), target,
          scaled.astype(jnp.float32), noisy.astype(jnp.float32), parts, sync)
    return out
