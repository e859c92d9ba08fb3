"""Prefix caching (engine/pages.py): the pool's cache on its own, then greedy and seeded tokens with the cache on ==
off for mixes of shared prefixes (page-aligned and not) with preemption and aborts in flight, no page leaked, and a
watch on every planned step that fails if a cached or shared page is written."""

from __future__ import annotations

import numpy as np
import pytest

from jphoton import SamplingParams
from jphoton.engine.pages import PagePool, page_keys
from jphoton.engine.scheduler import Scheduler

from conftest import FIXTURES, make_llm

TINY = FIXTURES / "tiny" / "llama3"
PS = 8  # page size of the engine tests


def test_the_pool_caches_shares_and_evicts_least_recently_released_first():
    pool = PagePool(6, 4, prefix_caching=True)
    tokens = list(range(100, 116))
    keys = page_keys(tokens, 4, 4, [])
    a = pool.allocate(4)
    pool.register(a, keys)
    assert pool.lookup(keys[:2]) == a[:2] and [pool.refs(p) for p in a] == [2, 2, 1, 1]
    pool.release(a[:2])
    pool.release(a)  # the owner finishes: all four cached, unreferenced
    assert (pool.num_free, pool.num_evictable, pool.num_available) == (2, 4, 6)
    other = page_keys([1] + tokens[1:], 4, 4, [])
    assert pool.lookup(other) == []  # the first page differs: nothing after it matches either
    assert pool.lookup(page_keys(tokens[:8] + [0] * 8, 4, 4, [])) == a[:2]  # a shorter shared prefix
    pool.release(a[:2])
    b = pool.allocate(3)  # two free pages, then the least recently released cached one (a[2])
    assert a[2] in b and not pool.is_cached(a[2]) and pool.lookup(keys) == a[:2]
    pool.release(a[:2])
    pool.release(b)
    assert pool.num_free + pool.num_evictable == 6
    assert pool.reset_cache() == 3 and pool.num_free == 6 and pool.lookup(keys) == []
    with pytest.raises(AssertionError, match="released twice"):
        pool.release([b[0]])


def test_a_key_names_the_whole_prefix_and_the_extra_part():
    k1 = page_keys(list(range(8)), 4, 2, [])
    k2 = page_keys([9, 1, 2, 3, 4, 5, 6, 7], 4, 2, [])
    assert k1[1][1] == k2[1][1] and k1[1] != k2[1]  # same tokens, different prefix
    assert page_keys(list(range(8)), 4, 2, [], extra="adapter-a") != k1
    pool = PagePool(4, 4)  # caching off: nothing is registered
    p = pool.allocate(2)
    pool.register(p, k1)
    pool.release(p)
    assert pool.num_free == 4 and pool.lookup(k1) == []


class WriteWatch:
    """Wraps Scheduler.plan: no row of a planned step may write a page that was cached before the plan, nor a shared
    page that is not cached (a choice branch's view of its leader's). A page the step itself fills may be cached and
    mapped by a later row of the same step: each layer writes the step's keys/values before any row attends. Records
    the violations."""

    def __init__(self, monkeypatch):
        self.violations: list[tuple] = []
        self.steps = 0
        real = Scheduler.plan
        watch = self

        def plan(sched):
            pool = sched.pages
            cached_before = dict(pool._key_of)  # page -> key
            out = real(sched)
            if out is not None:
                watch.steps += 1
                for row in out.rows:
                    table = row.seq.block_table
                    for pos in range(row.start, row.start + row.num_tokens):
                        page = table[pos // pool.page_size]
                        # (a page evicted by this plan and cached again under what it now holds is another page)
                        cached = pool.is_cached(page)
                        same = cached and cached_before.get(page) == pool._key_of[page]
                        if same or (pool.refs(page) != 1 and not cached):
                            watch.violations.append((row.seq.request_id, pos, page, pool.refs(page)))
            return out

        monkeypatch.setattr(Scheduler, "plan", plan)


def mix(vocab: int = 256):
    """Prompts sharing prefixes of several lengths (page-aligned and not), greedy and seeded."""
    rng = np.random.default_rng(3)
    system = rng.integers(3, vocab, 40).tolist()  # 5 pages
    other = rng.integers(3, vocab, 13).tolist()
    prompts, params = [], []
    for i, (head, tail) in enumerate([(system, 7), (system, 0), (system[:24], 9), (system[:21], 5), (other, 11),
                                      (system, 30), (system[:8], 3), (other + system, 4)]):
        prompts.append({"prompt_token_ids": head + rng.integers(3, vocab, tail).tolist()})
        params.append(SamplingParams(max_tokens=14 + i % 5, temperature=0.0 if i % 2 else 0.9, seed=i, ignore_eos=True))
    return prompts, params


@pytest.mark.parametrize("depth", [1, 2])
def test_tokens_equal_with_the_cache_on_and_off_under_preemption_and_aborts(monkeypatch, depth):
    prompts, params = mix()
    # warm-up off (CI time): only the shapes the run takes compile, the two pools being of different sizes
    llm_off = make_llm(TINY, prefix_caching=False, page_size=PS, pipeline_depth=depth, max_model_len=128, warmup=False)
    ref = llm_off.generate(prompts, params)
    watch = WriteWatch(monkeypatch)
    # a pool too small for the batch: sequences are preempted and recomputed, cached pages evicted and reused
    llm = make_llm(TINY, page_size=PS, pipeline_depth=depth, max_model_len=128, num_kv_pages=24, warmup=False)
    first = llm.generate(prompts[:2], params[:2])  # the system prompt is cached before the batch arrives
    assert [o.token_ids for o in first] == [o.token_ids for o in ref[:2]]
    # aborts in flight: two requests of the batch end after a few tokens; the rest must not notice
    seqs = [llm.prepare_request(p, sp) for p, sp in zip(prompts, params, strict=True)]
    for s in seqs:
        llm.add_request(s)
    while llm.has_unfinished_requests():
        llm.step()
        for victim in (seqs[1], seqs[6]):
            if len(victim.output_ids) >= 3 and not victim.finalized:
                llm.abort(victim.request_id)
    for i, (s, r) in enumerate(zip(seqs, ref, strict=True)):
        if i in (1, 6):
            assert s.finish_reason == "abort" and s.output_ids == r.token_ids[:len(s.output_ids)]
        else:
            assert s.output_ids == r.token_ids, i
    stats = llm.stats()
    assert stats["preemptions"] > 0 and stats["prefix_hit_tokens"] >= 2 * 40
    assert stats["kv_pages_free"] + stats["kv_pages_evictable"] == stats["kv_pages_total"]
    assert stats["kv_pages_evictable"] > 0 and watch.steps > 20 and not watch.violations, watch.violations[:5]
    assert llm.reset_prefix_cache() == stats["kv_pages_evictable"]
    assert llm.stats()["kv_pages_free"] == stats["kv_pages_total"]
    again = llm.generate(prompts[:2], params[:2])  # a cold cache gives the same tokens
    assert [o.token_ids for o in again] == [o.token_ids for o in ref[:2]]


def test_the_write_watch_catches_a_cached_page_written(monkeypatch):
    """The watch above can fail: map one cached page too many (the sequence then recomputes into it)."""
    prompts, params = mix()
    real = Scheduler._map_cached_prefix

    def off_by_one_page(sched, s):
        real(sched, s)
        if s.block_table:
            s.num_computed -= PS  # the last mapped page is written again, while cached
    monkeypatch.setattr(Scheduler, "_map_cached_prefix", off_by_one_page)
    watch = WriteWatch(monkeypatch)
    llm = make_llm(TINY, page_size=PS, max_model_len=128, warmup=False)
    llm.generate(prompts[:1], params[:1])
    llm.generate(prompts[:2], params[:2])
    assert watch.violations


def test_the_cache_can_be_turned_off_and_counts_nothing():
    prompts, params = mix()
    llm = make_llm(TINY, prefix_caching=False, page_size=PS, max_model_len=128, warmup=False)
    llm.generate(prompts[:3], params[:3])
    llm.generate(prompts[:3], params[:3])
    s = llm.stats()
    assert s["prefix_hit_tokens"] == s["prefix_query_tokens"] == s["kv_pages_evictable"] == 0
    assert s["kv_pages_free"] == s["kv_pages_total"]


def test_a_constrained_request_on_a_cached_prefix_gives_the_same_output(embedded_llm):
    llm = embedded_llm
    prompt = {"prompt_token_ids": llm.encode_chat([{"role": "system", "content": "You answer in JSON. " * 6},
                                                  {"role": "user", "content": "Describe a cat."}])}
    params = SamplingParams(max_tokens=40, temperature=0.8, seed=5, json_schema={
        "type": "object", "properties": {"name": {"type": "string", "maxLength": 12}}, "required": ["name"]})
    llm.reset_prefix_cache()
    cold = llm.generate(prompt, params)[0]
    hits = llm.stats()["prefix_hit_tokens"]
    warm = llm.generate(prompt, params)[0]
    assert llm.stats()["prefix_hit_tokens"] - hits >= len(prompt["prompt_token_ids"]) - 16
    assert (warm.text, warm.token_ids, warm.finish_reason) == (cold.text, cold.token_ids, cold.finish_reason)
