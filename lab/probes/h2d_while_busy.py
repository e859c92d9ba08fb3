"""Does handing a host array to a jitted call block the host while the GPU is busy? By argument size, and with the
array staged through pinned host memory first. (Probe for the 1 ms seen in the masked sampler's dispatch.) Controls:
the same jitted call on an array already on the device (is it the dispatch, not the transfer?), a device_put started
from a second thread (does the main thread still pay?), and device_put(donate=True) where this jax has it.

    python lab/probes/h2d_while_busy.py
"""

import concurrent.futures
import time

import jax
import jax.numpy as jnp
import numpy as np

dev = jax.devices()[0]
big = jax.device_put(jnp.ones((8192, 8192), jnp.bfloat16), dev)


@jax.jit
def busy(x):  # ~2-3 ms of matmuls
    for _ in range(8):
        x = (x @ x) * 1e-3
    return x


@jax.jit
def consume(a):
    return a[0] + 1


def timed(fn):
    out = busy(big)
    jax.block_until_ready(out)
    out = busy(big)  # the device is now busy for a few ms
    t0 = time.perf_counter()
    r = fn()
    t = time.perf_counter() - t0
    jax.block_until_ready((out, r))
    return 1e3 * t


try:
    pinned = dev.memory("pinned_host")
    pinned_sharding = jax.sharding.SingleDeviceSharding(dev, memory_kind="pinned_host")
    device_sharding = jax.sharding.SingleDeviceSharding(dev, memory_kind="device")
except Exception as e:  # noqa: BLE001
    print("no pinned_host memory:", e)
    pinned_sharding = None
t0 = time.perf_counter()
jax.block_until_ready(busy(big))
print(f"busy() alone: {1e3 * (time.perf_counter() - t0):.2f} ms (incl. first compile)")
t0 = time.perf_counter()
jax.block_until_ready(busy(big))
print(f"busy() alone: {1e3 * (time.perf_counter() - t0):.2f} ms")
for kib in (4, 16, 48, 64, 65, 128, 256, 1024):
    x = np.ones(kib * 256, np.int32)
    consume(x).block_until_ready()
    with jax.transfer_guard("allow"):
        a = [timed(lambda x=x: consume(x)) for _ in range(5)]
        b = [timed(lambda x=x: jax.device_put(x, dev)) for _ in range(5)]
        c = []
        if pinned_sharding is not None:
            def staged(x=x):
                h = jax.device_put(x, pinned_sharding)
                return consume(jax.device_put(h, device_sharding))
            staged()
            c = [timed(staged) for _ in range(5)]
        on_dev = jax.device_put(x, dev)
        d = [timed(lambda on_dev=on_dev: consume(on_dev)) for _ in range(5)]
        pool = concurrent.futures.ThreadPoolExecutor(1)

        def threaded(x=x, pool=pool):
            fut = pool.submit(jax.device_put, x, dev)
            t0 = time.perf_counter()
            time.sleep(0.002)  # the main thread's own work while the transfer runs
            t_main = time.perf_counter() - t0
            return consume(fut.result()), t_main
        e = []
        for _ in range(5):
            out = busy(big)
            t0 = time.perf_counter()
            r, t_main = threaded()
            e.append(1e3 * (time.perf_counter() - t0 - t_main))
            jax.block_until_ready((out, r))
        try:
            f = [timed(lambda x=x: jax.device_put(x.copy(), dev, donate=True)) for _ in range(5)]
        except TypeError:
            f = []
    print(f"{kib:5d} KiB: jit(numpy) {np.median(a):.3f} ms, device_put {np.median(b):.3f} ms, "
          f"via pinned_host {np.median(c) if c else float('nan'):.3f} ms, jit(device array) {np.median(d):.3f} ms, "
          f"device_put on a 2nd thread (main thread waits) {np.median(e):.3f} ms, device_put(donate) "
          f"{np.median(f) if f else float('nan'):.3f} ms (host time while the GPU is busy)")
