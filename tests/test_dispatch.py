"""The dispatcher thread (engine/dispatch.py): jobs run in submission order, under the transfer guards of the thread
that submitted them, and a job's error reaches whoever waits for it."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jphoton.engine.dispatch import Dispatcher


@pytest.mark.parametrize("threaded", [True, False])
def test_jobs_run_in_order_and_errors_reach_the_waiter(threaded):
    d = Dispatcher(threaded)
    seen = []
    jobs = [d.submit(lambda i=i: seen.append(i)) for i in range(50)]
    d.drain()
    assert seen == list(range(50))
    assert all(j is None for j in jobs) != threaded  # inline jobs have nothing to wait for

    def boom():
        raise RuntimeError("device call failed")

    with pytest.raises(RuntimeError, match="device call failed"):
        d.wait(d.submit(boom))


def test_a_job_runs_under_the_submitters_transfer_guard():
    d = Dispatcher(True)
    host = np.ones(4, np.float32)
    implicit = jax.jit(lambda x: x + 1)
    with jax.transfer_guard_host_to_device("disallow"):
        job = d.submit(lambda: implicit(host))  # a numpy argument: an implicit host->device transfer
    with pytest.raises(Exception, match="host-to-device transfer"):
        d.wait(job)
    d.wait(d.submit(lambda: implicit(host)))  # submitted outside the guard: allowed
    on_device = jnp.ones(4)
    with jax.transfer_guard_host_to_device("disallow"):
        d.wait(d.submit(lambda: implicit(on_device)))  # a device argument: fine under the guard
