"""Shared fixtures. The embedded model is loaded once per session; converted-model caches go to a temp dir."""

from __future__ import annotations

import contextlib
import gc
import os
import pathlib
import tempfile

import pytest

FIXTURES = pathlib.Path(__file__).parent / "fixtures"
TINY_FAMILIES = ("llama2", "llama3", "smollm2", "mistral", "qwen2", "qwen3")

# Before jphoton is imported anywhere: keep the test session's conversion cache out of the user's home.
os.environ.setdefault("JPHOTON_CACHE_DIR", tempfile.mkdtemp(prefix="jphoton-test-cache-"))
# Before jax is imported: the host platform shows 4 devices, for the tensor-parallel tests (one-device programs still
# run on device 0 alone).
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=4".strip()


# Small bucket sets keep compiles few on 2 CPU cores; every test engine shares them.
ENGINE_ARGS = dict(max_num_seqs=8, max_num_batched_tokens=128, decode_buckets=(1, 8),
                   prefill_buckets=((2, 64),))
_SHARED_LLMS = []  # engines of module- and session-scoped fixtures: checked after every test while they live
_TEST_LLMS = []  # engines made by the running test: checked after it, then dropped (each holds weights and a KV pool)


_EMBEDDED_MODEL = []  # the embedded model's JaxModel (float32, one device), once a test engine has loaded it
# options that change how the model is built (not only the engine around it): an engine given any of them loads its own
_MODEL_OPTIONS = {"dtype", "tensor_parallel_size", "unroll_layers", "matmul", "moe_backend", "cache_converted",
                  "tokenizer", "config", "max_loras"}  # (LoRA widens the weights in place)


def make_llm(model=None, **kwargs):
    """An LLM with the test bucket sets, checked for leaked KV pages after the test. freeze_gc is off unless a test asks:
    gc.freeze() would keep every later-dropped engine of the session alive. Warm-up is "full" (every shape before the
    test runs: deterministic); tests of the background warm-up ask for it. The embedded model (model=None) is loaded
    once per process and its JaxModel (weights read-only) shared by every engine of it: one 540 MB copy of the float32
    weights, not one per engine (the three pipeline depths' session engines, test engines beside them)."""
    from jphoton import LLM

    share = model is None and not _MODEL_OPTIONS & kwargs.keys()
    if share and _EMBEDDED_MODEL:
        model = _EMBEDDED_MODEL[0]
    llm = LLM(model, **{"dtype": "float32", "freeze_gc": False, "warmup": "full", **ENGINE_ARGS, **kwargs})
    if share and not _EMBEDDED_MODEL:
        _EMBEDDED_MODEL.append(llm.model)
    _TEST_LLMS.append(llm)
    return llm


@contextlib.contextmanager
def shared_llm(model=None, **kwargs):
    """make_llm for a module- or session-scoped fixture (`with shared_llm(...) as llm: yield llm`)."""
    llm = make_llm(model, **kwargs)
    _TEST_LLMS.remove(llm)
    _SHARED_LLMS.append(llm)
    try:
        yield llm
    finally:
        _SHARED_LLMS.remove(llm)


@pytest.fixture(autouse=True)
def no_leaked_pages():
    yield
    try:
        for llm in _SHARED_LLMS + _TEST_LLMS:
            stats = llm.stats()
            assert stats["kv_pages_free"] + stats["kv_pages_evictable"] == stats["kv_pages_total"], \
                f"KV pages leaked: {stats}"
            assert not llm.engine.sequences, "sequences still live after the test"
            assert not llm.has_unfinished_requests()
    finally:
        _TEST_LLMS.clear()
        if gc.get_freeze_count():  # a test that built LLM(freeze_gc=True): let its engine go with the test
            gc.unfreeze()
            gc.collect()


_STALE_LLMS = []  # session engines whose compiled programs a module's end dropped: warmed again before their next use
_SESSION_LLMS = {}  # fixture name -> the session-scoped engine it made


@pytest.fixture(autouse=True, scope="module")
def drop_compiled_programs(request):
    """Compiled programs stay in JAX's caches for the session: ~80 MB per Pallas kernel shape in interpret mode, 1.2 GB
    for test_moe alone. Dropped after each module; a session engine then compiles its shapes again (from the on-disk
    cache) before the next module that uses it starts, so that it still serves without compiling (modules that do not
    use it skip that warm-up)."""
    prefix = request.node.nodeid + "::"
    used = set().union(*(item.fixturenames for item in request.session.items if item.nodeid.startswith(prefix)))
    for name, llm in _SESSION_LLMS.items():
        if name in used:
            _rewarm(llm)
    yield
    import jax

    jax.clear_caches()
    _STALE_LLMS.extend(llm for llm in _SHARED_LLMS if llm not in _STALE_LLMS)
    return_freed_memory()


def return_freed_memory():
    """Hand the heap's free pages back to the OS (glibc keeps them otherwise: the process's RSS only grows, module
    after module, and the suite's peak is one worker's)."""
    gc.collect()
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


def _rewarm(llm):
    """Compile a session engine's programs again if a module's end dropped them."""
    if llm in _STALE_LLMS:
        _STALE_LLMS.remove(llm)
        if llm.engine_config.warmup != "off":
            llm.engine.runner.warmup()


@pytest.fixture
def drop_compiled_programs_after_each_test():
    """For the kernel test modules, which use no shared engine: their interpret-mode programs go after each test."""
    yield
    import jax

    jax.clear_caches()


@contextlib.contextmanager
def session_llm(name, **kwargs):
    """shared_llm for a session-scoped fixture `name`: warmed again before each module that uses it (see above)."""
    with shared_llm(**kwargs) as llm:
        _SESSION_LLMS[name] = llm
        try:
            yield llm
        finally:
            del _SESSION_LLMS[name]
            if llm in _STALE_LLMS:
                _STALE_LLMS.remove(llm)


@pytest.fixture(scope="session")
def embedded_llm():
    with session_llm("embedded_llm") as llm:  # the default loop: pipelined, depth 2
        yield llm


@pytest.fixture(scope="session")
def embedded_d1():
    with session_llm("embedded_d1", pipeline_depth=1) as llm:  # the blocking loop
        yield llm


@pytest.fixture(scope="module")
def embedded_d3():
    with shared_llm(pipeline_depth=3) as llm:  # three steps in flight (module scope: each shared engine is warmed
        yield llm                              # again after every module)


def llm_at_depth(request, depth: int):
    """The shared embedded engine of a pipeline depth, for tests parametrized over depths (warm: a fixture asked for
    here is not in the module's fixture list that drop_compiled_programs reads)."""
    llm = request.getfixturevalue({1: "embedded_d1", 2: "embedded_llm", 3: "embedded_d3"}[depth])
    _rewarm(llm)
    return llm


@pytest.fixture(scope="session")
def tiny_models():
    """family -> LoadedModel (float32), loaded lazily and kept for the session."""
    from jphoton.weights import load_model

    cache = {}

    def get(family):
        if family not in cache:
            cache[family] = load_model(FIXTURES / "tiny" / family, "float32")
        return cache[family]

    return get


def tiny_reference(family):
    import numpy as np

    ref = np.load(FIXTURES / "tiny" / family / "reference.npz")
    n = len([k for k in ref.files if k.startswith("prompt_")])
    return [(ref[f"prompt_{i}"], ref[f"tokens_{i}"], ref[f"logits_{i}"]) for i in range(n)]
