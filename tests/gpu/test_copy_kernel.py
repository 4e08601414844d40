"""The landing copy kernel on the device, against ``copy_ranges`` (what it must do): every
access width, several KV groups and block lengths, pairs the kernel must skip, and a copy
into memory another process owns (imported over CUDA IPC, as the daemon does it)."""

from __future__ import annotations

import time

import numpy as np
import pytest

from pushsvc.devmem.cuda import CudaMemory
from pushsvc.devmem.kernel import WIDTHS
from pushsvc.state.landing import CopyPlan, LandingGeometry, copy_ranges, physical_blocks
from pushsvc.state.layout import Layout, RegionSpec, part_regions


@pytest.fixture(scope="module")
def device():
    memory = CudaMemory()
    yield memory.device(memory._driver.device_uuid(0))
    memory.close()


def _worker(base: int, layers: int, blocks: int, block_len: int, groups: int, bpl: int, pad: int) -> Layout:
    regions, at = [], base
    for layer in range(layers):
        for _ in (0, 1):
            regions.append(RegionSpec(at, block_len, blocks * bpl, block_len + pad, layer % groups))
            at += blocks * bpl * (block_len + pad) + pad
    return Layout(tuple(regions), bpl)


@pytest.mark.parametrize("width", WIDTHS)
@pytest.mark.parametrize("groups,bpl", [(1, 1), (2, 2)])
@pytest.mark.parametrize("gather", [False, True], ids=["landing", "staging"])
def test_each_width_copies_exactly_what_the_plan_says(device, width, groups, bpl, gather) -> None:
    rng = np.random.default_rng(width * 10 + groups + gather)
    blocks, block_len = 24, 48 * width
    pad = width if width < 16 else 0  # misaligned enough to force this width
    span = 2 * 3 * blocks * bpl * (block_len + pad) + 8 * pad + 4096
    worker_mem = device.allocate(span)
    probe = _worker(worker_mem.address + pad, 3, blocks, block_len, groups, bpl, pad)
    geometry = LandingGeometry.build(probe, 10 * probe.bytes_per_logical_block)
    own_mem = device.allocate(geometry.nbytes + 64)
    try:
        own = geometry.layout(own_mem.address + pad)
        plan = CopyPlan.build_staging(probe, own) if gather else CopyPlan.build(probe, own)
        assert plan.width == width and plan.gather is gather
        worker_bytes = rng.integers(0, 256, span, dtype=np.uint8)
        own_bytes = rng.integers(0, 256, geometry.nbytes + 64, dtype=np.uint8)
        device.driver.upload(worker_mem.address, worker_bytes.ctypes.data, span)
        device.driver.upload(own_mem.address, own_bytes.ctypes.data, own_bytes.nbytes)
        # landing: own slots -> worker blocks; staging: worker blocks -> own slots
        (src_mem, src_bytes), (dst_mem, dst_bytes) = (
            ((worker_mem, worker_bytes), (own_mem, own_bytes)) if gather else
            ((own_mem, own_bytes), (worker_mem, worker_bytes)))
        copier = device.copier(plan)
        expected = dst_bytes.copy()
        jobs = []
        for g in range(groups):
            ids = rng.choice(blocks, 6, replace=False)
            slots = physical_blocks(np.arange(3, 9), bpl)
            phys = physical_blocks(ids, bpl)
            run = copier.map(g, slots, phys)  # when the slots are granted
            for i in range(2):  # in two parts, as P sends them
                first, count = plan.span(part_regions(len(probe.regions), 2, i), g)
                if count:
                    jobs.append(copier.launch(run, first, count))
                    for src, dst, n in zip(*copy_ranges(plan, first, count, slots, phys)):
                        s, d = src - src_mem.address, dst - dst_mem.address
                        expected[d:d + n] = src_bytes[s:s + n]
        deadline = time.monotonic() + 10
        while not all(j.done() for j in jobs) and time.monotonic() < deadline:
            time.sleep(0.001)
        got = np.frombuffer(device.read(dst_mem.address, dst_mem.size), dtype=np.uint8)
        assert int(np.count_nonzero(got != dst_bytes)) > 0
        assert np.array_equal(got, expected), f"{int(np.count_nonzero(got != expected))} bytes differ"
        copier.close()
    finally:
        own_mem.close()
        worker_mem.close()


def test_large_copies_are_fast_and_exact(device) -> None:
    """4096 blocks x 64 regions of 32 KiB (the benchmark's shape): exact, and timed."""
    blocks, block_len, regions = 4096, 32 << 10, 64
    worker = device.allocate(blocks * block_len * regions)
    layout = Layout(tuple(RegionSpec(worker.address + r * blocks * block_len, block_len, blocks, block_len, 0)
                          for r in range(regions)))
    geometry = LandingGeometry.build(layout, blocks * block_len * regions)
    landing_mem = device.allocate(geometry.nbytes)
    try:
        plan = CopyPlan.build(layout, geometry.layout(landing_mem.address))
        pattern = np.arange(geometry.nbytes // 8, dtype=np.int64)
        device.driver.upload(landing_mem.address, pattern.ctypes.data, geometry.nbytes)
        copier = device.copier(plan)
        ids = np.random.default_rng(1).permutation(blocks)
        run = copier.map(0, np.arange(blocks), ids)
        copier.launch(run, 0, regions).wait()  # warm
        t0 = time.perf_counter()
        copier.launch(run, 0, regions).wait()
        dt = time.perf_counter() - t0
        print(f"\nlanding copy of {geometry.nbytes >> 20} MiB as {blocks * regions} blocks: "
              f"{dt * 1e3:.2f} ms, {geometry.nbytes / dt / 1e9:.0f} GB/s")
        for r in (0, 37, 63):  # spot checks over whole regions
            got = np.frombuffer(device.read(worker.address + r * blocks * block_len, blocks * block_len), np.int64)
            want = pattern[r * blocks * block_len // 8:(r + 1) * blocks * block_len // 8].reshape(blocks, -1)
            assert np.array_equal(got.reshape(blocks, -1)[ids], want)
        copier.close()
    finally:
        landing_mem.close()
        worker.close()
