"""What a `choice` of N options x T tokens costs end to end on the embedded model (LLM(), default settings, or the
tests' engine), and what it does to a concurrent greedy stream's inter-token gap: the stream starts, the choice is added
after its 10th token. CPU box: `python lab/probes/choice_cost.py --engine test|default --grid 32x1,16x3`."""

from __future__ import annotations

import argparse
import statistics
import time

from jphoton import LLM, SamplingParams

TEST_ENGINE = dict(max_num_seqs=8, max_num_batched_tokens=128, decode_buckets=(1, 8), prefill_buckets=((2, 64),))


def single_token_words(llm, n):
    vocab = llm.tokenizer._tok.get_vocab()
    words = sorted(t for t in vocab if t.startswith("Ġ") and t[1:].isalpha() and len(t) > 3)
    out = []
    for t in words:
        w = " " + t[1:]
        if len(llm.tokenizer.encode(w, add_special_tokens=False)) == 1:
            out.append(w)
        if len(out) == n:
            break
    return out


def options(words, n, t):
    # n distinct options of t tokens each (mixed-radix over the word list)
    out = []
    for i in range(n):
        k, parts = i, []
        for _ in range(t):
            parts.append(words[k % len(words)])
            k //= len(words)
        out.append("".join(parts))
    return out


def run(llm, prompt, choice, stream_tokens=60):
    """(choice wall s, stream gaps alone (median s), stream gaps while the choice ran (median, max))."""
    greedy = SamplingParams(max_tokens=stream_tokens, temperature=0, ignore_eos=True)
    sid = llm.add_request("Once upon a time", greedy)
    times, cid, t_add, t_done = [], None, None, None
    while llm.has_unfinished_requests():
        for out in llm.step():
            now = time.perf_counter()
            if out.request_id == sid and out.delta.token_ids:
                times.append((now, cid is not None and t_done is None))
                if len(times) == 10 and cid is None:
                    t_add = time.perf_counter()
                    cid = llm.add_request(prompt, SamplingParams(temperature=0, choice=choice))
            if out.request_id == cid and out.finished:
                t_done = now
    gaps_alone = [b[0] - a[0] for a, b in zip(times, times[1:], strict=False) if not b[1]]
    gaps_with = [b[0] - a[0] for a, b in zip(times, times[1:], strict=False) if b[1]]
    return (t_done - t_add if t_done else float("nan"), statistics.median(gaps_alone[1:]),
            statistics.median(gaps_with) if gaps_with else float("nan"), max(gaps_with, default=float("nan")))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--engine", default="test", choices=("test", "default"))
    ap.add_argument("--grid", default="16x1,64x1,256x1,64x4,256x4,64x16,128x8,512x1,1024x1")
    ap.add_argument("--prompt-tokens", type=int, default=40)
    ap.add_argument("--stream-tokens", type=int, default=200)
    args = ap.parse_args()
    kw = dict(TEST_ENGINE) if args.engine == "test" else {}
    llm = LLM(warmup="full", progress=False, max_choices=4096, max_choice_tokens=65536, **kw)
    words = single_token_words(llm, 2000)
    prompt = {"prompt_token_ids": llm.tokenizer.encode("Pick one word. " * 20)[:args.prompt_tokens]}
    run(llm, prompt, options(words, 8, 1), 20)  # warm (limits raised: the probe measures past them)
    print(f"engine={args.engine} prompt={args.prompt_tokens} tokens")
    for cell in args.grid.split(","):
        n, t = map(int, cell.split("x"))
        opts = options(words, n, t)
        toks = sum(len(llm.tokenizer.encode(o, add_special_tokens=False)) + 1 for o in opts)
        wall, alone, with_, worst = run(llm, prompt, opts, stream_tokens=args.stream_tokens)
        print(f"N={n:5d} T={t:3d} sum(tokens+1)={toks:6d}  choice {wall:7.2f} s  stream gap alone {1e3 * alone:6.1f} ms"
              f"  during {1e3 * with_:6.1f} ms (x{with_ / alone:4.1f}, worst {1e3 * worst:6.1f} ms)", flush=True)


if __name__ == "__main__":
    main()
