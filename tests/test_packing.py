"""StepPacker (engine/packing.py) without an engine: a decode-only pack that starts from the previous one (same rows,
or rows that finished, arrived or moved up), and a mixed step's pack built on it, are byte-equal to packing from
scratch, under random churn."""

from __future__ import annotations

import random
from types import SimpleNamespace

import numpy as np
import pytest

from jphoton.engine.packing import StepPacker
from jphoton.engine.plan import DecodeRows, Row, StepPlan
from jphoton.engine.step import StepShape, StepStatic

STATIC = StepStatic(pages_per_seq=16, page_size=4, pages_per_block=4, trash_page=999, max_rows=8, sliding_window=None,
                    lora_slots=2, lora_rank=4)


def _seq(rng: random.Random, n: int):
    params = SimpleNamespace(temperature=rng.choice([0.0, 0.7, 1.0]), top_k=rng.choice([0, 50]),
                             top_p=rng.choice([1.0, 0.9]))
    return SimpleNamespace(block_table=[rng.randrange(900) for _ in range(rng.randint(1, 4))], params=params,
                           seed=rng.randrange(2**40), lora_slot=rng.choice([-1, 0, 1]), spatial_mode=rng.choice([0, 0, 1, 2]),
                           name=n)


@pytest.mark.parametrize("lora", [False, True])
def test_decode_packs_under_churn_equal_full_packs(lora):
    rng = random.Random(7 if lora else 8)
    packer, fresh = StepPacker(STATIC, 0, lora), StepPacker(STATIC, 0, lora)
    running = [_seq(rng, i) for i in range(5)]
    made, incremental = 5, 0
    after_mixed, after_mixed_steady, mixed_from_decode = False, 0, 0
    for step in range(300):
        event = rng.random()
        if event < 0.2 and len(running) > 1:  # a request finishes (any row)
            running.pop(rng.randrange(len(running)))
        elif event < 0.4 and len(running) < 8:  # one arrives (it decodes after its prefill: appended)
            running.append(_seq(rng, made))
            made += 1
        elif event < 0.45:  # a sequence's table is rebuilt (a new list: preemption and readmission)
            s = rng.choice(running)
            s.block_table = list(s.block_table)
        for s in running:  # pages fill up: tables grow in place
            if rng.random() < 0.2 and len(s.block_table) < STATIC.pages_per_seq:
                s.block_table.append(rng.randrange(900))
        rows = DecodeRows.of([Row(s, step + i, 1, [rng.randrange(100)] if rng.random() < 0.5 else [],
                                  rng.choice([-1, i]), True, step, i) for i, s in enumerate(running)])
        bucket = 4 if len(rows) <= 4 else 8
        if rng.random() < 0.25:  # a newcomer's prefill rides beside the decode rows: a mixed step, packed whole
            newcomer = _seq(rng, -1)
            prefill = [Row(newcomer, 0, 8, list(range(8)), -1, True, 0, bucket)]
            plan = StepPlan(step, rows, prefill, StepShape(bucket, 1, 8, 4))
            before = packer.steady_packs
            np.testing.assert_array_equal(packer.pack(plan).packed, fresh._pack_full(plan).packed)
            mixed_from_decode += packer.steady_packs > before  # its decode rows packed as a decode step's
            after_mixed = True
            continue
        plan = StepPlan(step, rows, [], StepShape(bucket, 0, 0, 0))
        before = packer.steady_packs
        got = packer.pack(plan).packed
        incremental += packer.steady_packs - before
        after_mixed_steady += after_mixed and packer.steady_packs > before
        after_mixed = False
        np.testing.assert_array_equal(got, fresh._pack_full(plan).packed, err_msg=f"step {step}")
    assert incremental > 120  # most packs started from the previous one
    assert after_mixed_steady > 20  # ... also the decode step after a mixed one (its start: the last decode pack)
    assert mixed_from_decode > 20  # ... and a mixed step's decode rows (`StepPacker._pack_mixed`)
