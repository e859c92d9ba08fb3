"""`jphoton` command line: generate, query, caption, point and detect (an image model), convert, serve. Text goes to
stdout as it is produced; logs and progress to stderr."""

from __future__ import annotations

import argparse
import json
import logging
import os
import pathlib
import sys
import threading
import time


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("jphoton")
    except PackageNotFoundError:  # run from a source tree that is not installed
        from jphoton import __version__

        return __version__


def _setup_logging(verbose: bool) -> None:
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("jphoton").setLevel(logging.INFO if verbose else logging.WARNING)
    try:  # orbax logs every checkpoint step through absl at INFO
        import absl.logging

        absl.logging.set_verbosity(absl.logging.WARNING)
    except ImportError:
        pass


def _int_in(lo: int, hi: int | None = None):
    """An argparse type: an integer in [lo, hi] (a bad value is a one-line usage error, exit 2)."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
        if value < lo or (hi is not None and value > hi):
            raise argparse.ArgumentTypeError(f"must be in [{lo}, {hi if hi is not None else 'inf'}], got {value}")
        return value
    return parse


# `jphoton serve` flags for EngineConfig.limits: what one request may ask for (INVALID_ARGUMENT beyond).
_LIMIT_FLAGS = {
    "max_prompt_bytes": "largest text prompt (UTF-8 bytes; a chat: its messages together)",
    "max_stop_strings": "most stop strings per request",
    "max_stop_bytes": "longest stop string (UTF-8 bytes)",
    "max_constraint_bytes": "largest json_schema / regex / grammar (bytes; choice: all options together)",
    "max_schema_properties": "most properties of a json_schema (all objects together)",
    "max_choices": "most options of a choice (each is scored as a sequence)",
    "max_choice_tokens": "most tokens of a choice's options together (each option's tokens + 1)",
    "max_stop_token_ids": "most stop_token_ids per request",
    "max_image_pixels": "most pixels of an image (read from its header, before it is decoded)",
    "max_image_bytes": "largest encoded image (bytes)",
}


def _non_negative(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


def _directory(text: str) -> str:
    if not pathlib.Path(text).is_dir():
        raise argparse.ArgumentTypeError(f"{text!r} is not a directory")
    return text


def _lora_flag(text: str) -> tuple[str, str]:
    """--lora NAME=PATH -> (name, path); the path must be a directory (checked before the model loads)."""
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"expected NAME=PATH, got {text!r}")
    if not pathlib.Path(path).is_dir():
        raise argparse.ArgumentTypeError(f"{path!r} is not a directory (a HF PEFT adapter: adapter_config.json + "
                                         "adapter_model.safetensors)")
    return name, path


def _add_lora_args(p: argparse.ArgumentParser, serve: bool) -> None:
    p.add_argument("--lora", action="append", type=_lora_flag, default=[], metavar="NAME=PATH",
                   help="load this HF PEFT LoRA adapter as NAME" + (" (repeat for several; requests pick one by name, "
                        "LoadLora adds more)" if serve else "; the prompt runs with it"))
    if serve:
        p.add_argument("--max-loras", type=_int_in(0), default=None,
                       help="LoRA adapter slots (default: the number of --lora flags; 0 = LoRA off)")
        p.add_argument("--lora-dir", dest="lora_dirs", action="append", type=_directory, default=[], metavar="DIR",
                       help="LoadLora may load adapters from directories inside DIR (repeat for several; a relative "
                            "path is taken under the first; symlinks are resolved). None: LoadLora is refused")
    p.add_argument("--max-lora-rank", type=_int_in(1), default=16, help="largest adapter rank the slots hold")
    p.add_argument("--tensor-parallel-size", type=_int_in(1), default=1, metavar="N",
                   help="shard the model over N local devices (docs/tensor-parallel.md)")


def build_llm(model, loras: tuple[tuple[str, str], ...] = (), **options):
    """LLM(model, **options) with the `--lora` adapters loaded (module level: the server's engine process pickles it)."""
    from jphoton.api import LLM

    llm = LLM(model, **options)
    for name, path in loras:
        llm.load_lora(name, path)
    return llm


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None,
                   help="HF dir, .gguf file, jphoton store, random:NAME or embedded (default: the embedded "
                   "SmolLM2-135M-Instruct)")
    p.add_argument("--dtype", default=None, help="float32 | bfloat16 | float16 (None: float32 on CPU, bf16 on GPU)")
    p.add_argument("-v", "--verbose", action="store_true", help="log loading and decoding details to stderr")


def _constraint(args) -> dict:
    """The one constraint the flags ask for, as SamplingParams keywords (files read here: a bad path is a clear error)."""
    if args.json_schema is not None:
        text = _read(args.json_schema, "--json-schema")
        try:
            return {"json_schema": json.loads(text)}
        except json.JSONDecodeError as e:
            raise ValueError(f"--json-schema {args.json_schema}: not JSON ({e})") from None
    if args.grammar is not None:
        return {"grammar": _read(args.grammar, "--grammar")}
    if args.regex is not None:
        return {"regex": args.regex}
    if args.choice is not None:
        return {"choice": tuple(args.choice)}
    return {}


def _read(path: str, flag: str) -> str:
    try:
        return pathlib.Path(path).read_text()
    except OSError as e:
        raise ValueError(f"{flag}: cannot read {path}: {e.strerror}") from None


def _cmd_generate(args) -> int:
    from jphoton.params import SamplingParams

    if len(args.lora) > 1:
        raise ValueError("generate takes one --lora (the prompt runs with it)")
    lora = args.lora[0][0] if args.lora else None
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, seed=args.seed, stop=tuple(args.stop), logprobs=args.logprobs,
                            lora=lora, **_constraint(args))  # bad values fail here, before the model loads
    # One request: the default engine, each shape compiled when the request first needs it (one prefill shape per
    # chunk size, one decode shape) rather than a warm-up of shapes it would never use.
    lora_options = dict(max_loras=1, max_lora_rank=args.max_lora_rank) if lora else {}
    llm = build_llm(args.model, tuple(args.lora), dtype=args.dtype, progress=True, warmup="off",
                    pipeline_depth=args.pipeline_depth, moe_backend=args.moe_backend,
                    tensor_parallel_size=args.tensor_parallel_size, **lora_options)
    if llm.tokenizer is None:
        raise ValueError("this model has no tokenizer, so it cannot take a text prompt")
    if args.raw:
        prompt = args.prompt
    else:
        prompt = {"prompt_token_ids": llm.encode_chat([{"role": "user", "content": args.prompt}])}
    t0 = time.perf_counter()
    first: list[float] = []

    def show(delta):
        if delta.token_ids and not first:
            first.append(time.perf_counter())
        sys.stdout.write(delta.text)
        sys.stdout.flush()

    result = llm.stream_one(prompt, params, on_delta=show)
    elapsed = time.perf_counter() - t0
    sys.stdout.write("\n")
    sys.stdout.flush()
    if result.logprobs:
        for token, logprob, top in result.logprobs:
            alts = "  ".join(f"{llm.tokenizer.decode([i])!r} {v:.3f}" for i, v in top.items())
            print(f"{llm.tokenizer.decode([token])!r}\t{logprob:.3f}" + (f"\ttop: {alts}" if alts else ""),
                  file=sys.stderr)
    if result.choice_scores is not None:
        print("choice scores (total logprob, end included): " + "  ".join(
            f"{o!r} {v:.3f}" for o, v in zip(params.choice, result.choice_scores, strict=True)), file=sys.stderr)
    n = len(result.token_ids)
    decode_s = elapsed - (first[0] - t0) if first else 0.0
    rate = f", {(n - 1) / decode_s:.1f} tok/s after it" if n > 1 and decode_s > 0 else ""
    print(f"jphoton: {n} tokens in {elapsed:.2f} s (first after {(first[0] - t0) if first else elapsed:.2f} s{rate}); "
          f"finish_reason={result.finish_reason}", file=sys.stderr)
    return 0


def _cmd_skill(args) -> int:
    """`jphoton query IMAGE QUESTION` / `jphoton caption IMAGE`: one answer about an image, streamed."""
    from jphoton.params import SamplingParams

    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, seed=args.seed, stop=tuple(args.stop))  # bad values fail before loading
    from jphoton.engine.config import Limits
    from jphoton.image import load_image

    try:
        image = pathlib.Path(args.image).read_bytes()  # (the LLM decodes, checks and crops the file's bytes)
    except OSError as e:
        raise ValueError(f"cannot read {args.image}: {e.strerror}") from None
    load_image(image, max_image_pixels=Limits().max_image_pixels)  # a bad image fails now, not after the model loads
    llm = build_llm(args.model, dtype=args.dtype, progress=True, warmup="off")
    text = args.question if args.command == "query" else args.length
    t0 = time.perf_counter()
    n, reason = 0, None
    with getattr(llm, args.command)(image, text, params, stream=True) as stream:
        for delta in stream:
            sys.stdout.write(delta.text)
            sys.stdout.flush()
            n, reason = n + len(delta.token_ids), delta.finish_reason or reason
    sys.stdout.write("\n")
    print(f"jphoton: {n} tokens in {time.perf_counter() - t0:.2f} s; finish_reason={reason}", file=sys.stderr)
    return 0


def _cmd_spatial(args) -> int:
    """`jphoton point IMAGE OBJECT` / `jphoton detect IMAGE OBJECT`: one line per object found, normalized to [0, 1]:
    `x y` (point) or `x_min y_min x_max y_max` (detect)."""
    from jphoton.engine.config import Limits
    from jphoton.image import load_image

    if not args.object.strip():
        raise ValueError(f"{args.command}: the object is empty")
    if not 1 <= args.max_objects <= 1000:
        raise ValueError(f"{args.command}: --max-objects must be in [1, 1000], got {args.max_objects}")
    try:
        image = pathlib.Path(args.image).read_bytes()
    except OSError as e:
        raise ValueError(f"cannot read {args.image}: {e.strerror}") from None
    load_image(image, max_image_pixels=Limits().max_image_pixels)  # a bad image fails now, not after the model loads
    llm = build_llm(args.model, dtype=args.dtype, progress=True, warmup="off")
    t0 = time.perf_counter()
    found = getattr(llm, args.command)(image, args.object, max_objects=args.max_objects)
    for obj in found:
        print(" ".join(f"{v:.4f}" for v in obj))
    print(f"jphoton: {len(found)} {'points' if args.command == 'point' else 'boxes'} in "
          f"{time.perf_counter() - t0:.2f} s", file=sys.stderr)
    return 0


def _cmd_convert(args) -> int:
    from jphoton.weights import load_model
    from jphoton.weights.store import check_store_dest, save_store

    check_store_dest(pathlib.Path(args.dest))  # before minutes of loading
    m = load_model(args.src, args.dtype, cache=False, progress=True)
    save_store(pathlib.Path(args.dest), m.config, m.params, m.tokenizer)
    print(f"wrote {args.dest} ({m.config.name or m.source}, {m.dtype.name})", file=sys.stderr)
    return 0


def _cmd_serve(args) -> int:
    import asyncio
    import functools
    import shutil
    import tempfile

    from jphoton.server.engine_process import default_frontends

    frontends = args.frontends or default_frontends()
    metrics_dir = None
    if frontends > 1 and args.metrics_port is not None and not os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        # the frontends' request metrics are summed through files (jphoton/server/metrics.py): set before the import
        metrics_dir = tempfile.mkdtemp(prefix="jphoton-metrics-")
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = metrics_dir
    from jphoton.server.app import ENGINE_FAILED_EXIT, LOADER_THREAD, run_until_signal
    from jphoton.server.engine_process import EngineDied, Spawn

    # The default warm-up: health turns SERVING once a first request's shapes are compiled; the rest compile in the
    # background and the scheduler uses each as it becomes ready (jphoton/engine/warmup.py).
    limits = {name: getattr(args, name) for name in _LIMIT_FLAGS}
    max_loras = len(args.lora) if args.max_loras is None else args.max_loras
    if len(args.lora) > max_loras:
        raise ValueError(f"{len(args.lora)} --lora adapters but --max-loras {max_loras}")
    build = functools.partial(build_llm, args.model, tuple(args.lora), dtype=args.dtype,
                              pipeline_depth=args.pipeline_depth, max_num_seqs=args.max_num_seqs,
                              max_choice_rows=args.max_choice_rows, max_model_len=args.max_model_len,
                              prefix_caching=args.prefix_caching,
                              max_loras=max_loras, max_lora_rank=args.max_lora_rank,
                              tensor_parallel_size=args.tensor_parallel_size, **limits)
    try:  # the engine in a process of its own (jphoton/server/engine_process.py)
        asyncio.run(run_until_signal(Spawn(build), host=args.host, port=args.port, max_queue=args.max_queue,
                                     metrics_port=args.metrics_port, max_message_bytes=args.max_message_mb * 2**20,
                                     grace=args.grace, frontends=frontends,
                                     max_message_rate=args.max_message_rate, tick_timeout=args.tick_timeout,
                                     lora_dirs=tuple(args.lora_dirs)))
    except EngineDied as e:  # died or stalled (serving, or while it loaded): for a supervisor to restart us
        print(f"jphoton: error: {e}", file=sys.stderr)
        died = True
    except OSError as e:  # the port is taken or the address is not ours
        print(f"jphoton: error: {e}", file=sys.stderr)
        return 2
    else:
        died = False
    finally:
        if metrics_dir is not None:
            shutil.rmtree(metrics_dir, ignore_errors=True)
    if died:  # not a normal exit: a loader or reader thread may still be in a wait
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(ENGINE_FAILED_EXIT)
    if any(t.name == LOADER_THREAD and t.is_alive() for t in threading.enumerate()):
        # Stopped while the model was still loading: leave without finalizing the interpreter, which would unwind the
        # loader thread inside XLA and abort the process ("terminate called ...", exit -6).
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    return 0


def build_parser() -> argparse.ArgumentParser:
    from jphoton.engine.config import Limits  # plain Python: no jax import for --help

    parser = argparse.ArgumentParser(prog="jphoton", description="JAX/Pallas LLM inference engine")
    parser.add_argument("--version", action="version", version=f"jphoton {_version()}")
    sub = parser.add_subparsers(dest="command", required=True)
    show_defaults = {"formatter_class": argparse.ArgumentDefaultsHelpFormatter}

    g = sub.add_parser("generate", help="generate text for one prompt, streamed to stdout", **show_defaults)
    g.add_argument("prompt")
    _add_model_args(g)
    g.add_argument("--max-tokens", type=int, default=256)
    g.add_argument("--temperature", type=float, default=1.0, help="0 = greedy")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0, help="0 = off")
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--raw", action="store_true", help="do not apply the chat template")
    g.add_argument("--stop", action="append", default=[], metavar="TEXT",
                   help="stop before this text (repeat the flag for several)")
    g.add_argument("--logprobs", type=int, default=None, metavar="K",
                   help="print each token's logprob and the top K to stderr")
    constraint = g.add_mutually_exclusive_group()
    constraint.add_argument("--json-schema", metavar="FILE", help="the output is JSON matching this schema file")
    constraint.add_argument("--regex", help="the whole output matches this regular expression")
    constraint.add_argument("--choice", action="append", metavar="TEXT",
                            help="the output is one of these strings (repeat the flag for each)")
    constraint.add_argument("--grammar", metavar="FILE", help="the output follows this Lark or GBNF grammar file")
    g.add_argument("--pipeline-depth", type=int, default=2, choices=(1, 2, 3),
                   help="1 = blocking loop, 2 = pipelined, 3 = two steps ahead")
    g.add_argument("--moe-backend", default="auto", choices=("auto", "warp_decode", "expert_centric"),
                   help="MoE models: warp-decode Pallas kernels, grouped-GEMM expert-centric, or auto by step size")
    _add_lora_args(g, serve=False)
    g.set_defaults(func=_cmd_generate)

    from jphoton.image.skills import CAPTION_LENGTHS
    from jphoton.image.skills import DEFAULTS as SKILL_DEFAULTS

    for name, help_text in (("query", "answer a question about an image (a Moondream checkpoint), streamed to stdout"),
                            ("caption", "describe an image (a Moondream checkpoint), streamed to stdout")):
        q = sub.add_parser(name, help=help_text, **show_defaults)
        q.add_argument("image", help="an image file: JPEG, PNG, WebP or GIF")
        if name == "query":
            q.add_argument("question")
        else:
            q.add_argument("--length", default="normal", choices=CAPTION_LENGTHS)
        _add_model_args(q)
        q.add_argument("--max-tokens", type=int, default=SKILL_DEFAULTS.max_tokens)
        q.add_argument("--temperature", type=float, default=SKILL_DEFAULTS.temperature, help="0 = greedy")
        q.add_argument("--top-p", type=float, default=SKILL_DEFAULTS.top_p)
        q.add_argument("--top-k", type=int, default=SKILL_DEFAULTS.top_k, help="0 = off")
        q.add_argument("--seed", type=int, default=None)
        q.add_argument("--stop", action="append", default=[], metavar="TEXT",
                       help="stop before this text (repeat the flag for several)")
        q.set_defaults(func=_cmd_skill)

    for name, help_text in (("point", "points at an object in an image (a Moondream checkpoint): x y per line"),
                            ("detect", "boxes around an object in an image (a Moondream checkpoint): "
                                       "x_min y_min x_max y_max per line")):
        q = sub.add_parser(name, help=help_text, **show_defaults)
        q.add_argument("image", help="an image file: JPEG, PNG, WebP or GIF")
        q.add_argument("object", help="what to find")
        _add_model_args(q)
        q.add_argument("--max-objects", type=int, default=50)
        q.set_defaults(func=_cmd_spatial)

    c = sub.add_parser("convert", help="convert a model source to a jphoton store (orbax) for fast loading",
                       **show_defaults)
    c.add_argument("src", help="HF dir, .gguf file, random:NAME or embedded")
    c.add_argument("dest")
    _add_model_args(c)
    c.set_defaults(func=_cmd_convert)

    s = sub.add_parser("serve", help="serve the model over gRPC (jphoton.v1.Engine, health, reflection; server/)",
                       **show_defaults)
    _add_model_args(s)
    s.add_argument("--host", default="127.0.0.1", help="address to bind (loopback only unless changed)")
    s.add_argument("--port", type=_int_in(0, 65535), default=50051, help="0 picks a free port")
    s.add_argument("--pipeline-depth", type=int, default=2, choices=(1, 2, 3),
                   help="1 = blocking loop, 2 = pipelined, 3 = two steps ahead")
    s.add_argument("--max-queue", type=_int_in(1), default=512,
                   help="most unfinished requests the server holds; beyond it Generate answers RESOURCE_EXHAUSTED")
    s.add_argument("--metrics-port", type=_int_in(0, 65535), default=None, help="serve Prometheus /metrics on this port")
    s.add_argument("--frontends", type=_int_in(1, 64), default=None,
                   help="gRPC processes, each with its own event loop, sharing the port and the one engine process "
                        "(default: 2 on a host with 8 or more CPUs, else 1; one loop at 64 streams doubles TTFT; 1 "
                        "suits a tiny model whose engine is host-bound: docs/serving.md)")
    s.add_argument("--max-num-seqs", type=_int_in(1), default=64, help="requests decoding at once")
    s.add_argument("--max-choice-rows", type=_int_in(1), default=7,
                   help="decode rows one choice request's options take at once (beside other streams; raise on a GPU)")
    s.add_argument("--max-model-len", type=_int_in(1), default=None, help="context length (None: min(model's, 8192))")
    s.add_argument("--no-prefix-caching", dest="prefix_caching", action="store_false",
                   help="prefill every prompt in full (by default full KV pages of shared prompt prefixes are reused)")
    s.add_argument("--max-message-mb", type=_int_in(1, 2047), default=16, help="gRPC message size limit, MiB")
    s.add_argument("--max-message-rate", type=_non_negative, default=30_000,  # server.engine_process's
                   help="tokens a second per frontend past which a stream's tokens go out every 2-4 steps, in one "
                        "message each (keeps the event loop, and so TTFT, ahead under load); 0: every step")
    s.add_argument("--grace", type=_non_negative, default=30.0,
                   help="on SIGINT/SIGTERM, seconds to let in-flight streams finish before cancelling them")
    s.add_argument("--tick-timeout", type=_non_negative, default=60.0,  # server.engine_process.DEFAULT_TICK_TIMEOUT
                   help="seconds without a sign of life from the engine process (it sends one every 0.5 s, idle or "
                        "not) after which it counts as stuck: killed, every call UNAVAILABLE, and the server exits "
                        "with status 3, as when the engine process dies (0: never)")
    _add_lora_args(s, serve=True)
    limits = Limits()
    for name, help_text in _LIMIT_FLAGS.items():  # per request, checked at submission (EngineConfig.limits)
        s.add_argument("--" + name.replace("_", "-"), type=_int_in(1),
                       default=getattr(limits, name), help=help_text)
    s.set_defaults(func=_cmd_serve)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    _setup_logging(args.verbose)
    try:
        return args.func(args)
    except ValueError as e:
        print(f"jphoton: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
