"""CUPTI adapter on activity buffers laid out as libcupti lays them out.

There is no GPU here, so each record is written into a buffer with cupti-python's numpy dtype for
its struct (ActivityKernel10, ActivityAPI, ActivityMemcpy6, ActivityMemset4, ActivitySynchronization2,
ActivityExternalCorrelation; ``cupti_buffers.pack``), with the CUpti_ActivityKind numbers of
cupti_activity.h; the H200 recordings in tests/fixtures/gpu are checked in test_gpu_fixtures. The values follow what a PyTorch step launches:
a GEMM op launching one cuBLAS kernel, a copy op launching a memcpy, a fill op launching a memset.
"""

from __future__ import annotations

from types import SimpleNamespace as Rec

import numpy as np
import pytest

from cupti_buffers import pack, tables_of

from plasmient_trace.capture import cupti as cu
from plasmient_trace.capture import cupti_records as cr
from plasmient_trace.pipeline import IngestOptions, stitch_records
from plasmient_trace.records import RecordSet, table_from_columns

T0 = 1_000_000_000  # CUPTI clock, ns
OFFSET = 1_700_000_000_000_000_000 - T0  # CUPTI clock -> epoch
PID, TID = 4242, 4243
GEMM = "sm90_xmma_gemm_f32f32_tf32f32_f32_nn_n_tilesize128x128x32_warpgroupsize1x1x1_execute_segment_k_off_kernel__5x_cublas"


def kernel(corr: int, start: int, end: int, name: str = GEMM, stream: int = 7) -> Rec:
    return Rec(kind=cu.KIND_CONCURRENT_KERNEL, name=name, device_id=0, stream_id=stream, start=T0 + start, end=T0 + end,
               correlation_id=corr, grid_x=132, grid_y=1, grid_z=1, block_x=384, block_y=1, block_z=1,
               registers_per_thread=168, static_shared_memory=0, dynamic_shared_memory=213_000, graph_id=0)


def runtime(corr: int, start: int, end: int, cbid: int = 211) -> Rec:
    return Rec(kind=cu.KIND_RUNTIME, cbid=cbid, process_id=PID, thread_id=TID, start=T0 + start, end=T0 + end,
               correlation_id=corr, return_value=0)


def records() -> list[Rec]:
    return [
        runtime(11, 1_000, 4_000),                    # cudaLaunchKernel inside op 1 (aten::mm)
        kernel(11, 5_000, 105_000),
        runtime(12, 201_000, 203_000, cbid=51),       # cudaMemcpyAsync inside op 2 (aten::copy_)
        Rec(kind=cu.KIND_MEMCPY, copy_kind=1, src_kind=1, dst_kind=3, bytes=4 << 20, device_id=0, stream_id=7,
            start=T0 + 205_000, end=T0 + 305_000, correlation_id=12, graph_id=0, runtime_correlation_id=0, context_id=1),
        runtime(13, 401_000, 402_000, cbid=45),       # cudaMemsetAsync inside op 3 (aten::fill_)
        Rec(kind=cu.KIND_MEMSET, bytes=1 << 20, value=0, device_id=0, stream_id=7, start=T0 + 403_000,
            end=T0 + 410_000, correlation_id=13, graph_id=0, context_id=1, memory_kind=3),
        Rec(kind=cu.KIND_SYNCHRONIZATION, type=3, start=T0 + 500_000, end=T0 + 520_000, correlation_id=14,
            stream_id=7, context_id=1, cuda_event_id=0),
        Rec(kind=cu.KIND_EXTERNAL_CORRELATION, external_kind=cu.EXTERNAL_KIND_CUSTOM0, external_id=1, correlation_id=11),
        Rec(kind=cu.KIND_EXTERNAL_CORRELATION, external_kind=cu.EXTERNAL_KIND_CUSTOM0, external_id=2, correlation_id=12),
        Rec(kind=cu.KIND_EXTERNAL_CORRELATION, external_kind=cu.EXTERNAL_KIND_CUSTOM0, external_id=3, correlation_id=13),
        # Another tool's external ids (Kineto uses CUSTOM1 too) must not be taken for ours.
        Rec(kind=cu.KIND_EXTERNAL_CORRELATION, external_kind=cu.EXTERNAL_KIND_CUSTOM0 + 1, external_id=99, correlation_id=11),
    ]


API_NAMES = {(cu.KIND_RUNTIME, 211): "cudaLaunchKernel", (cu.KIND_RUNTIME, 51): "cudaMemcpyAsync",
             (cu.KIND_RUNTIME, 45): "cudaMemsetAsync"}


def api_name(kind: int, cbid: int) -> str:
    return API_NAMES[(kind, cbid)]


def test_activity_records_become_kernel_launch_and_correlation_tables():
    t = tables_of(records(), OFFSET, api_name)
    k = t["kernels"]
    assert k.column("kind").to_pylist() == ["kernel", "memcpy", "memset"]
    # named as Kineto names them (the shared H100 traces: "Memcpy HtoD (Pageable -> Device)")
    assert k.column("name").to_pylist() == [GEMM, "Memcpy HtoD (Pageable -> Device)", "Memset (Device)"]
    assert k.column("start_ns").to_pylist()[0] == T0 + 5_000 + OFFSET
    assert k.column("grid").to_pylist()[0] == [132, 1, 1] and k.column("block").to_pylist()[0] == [384, 1, 1]
    assert k.column("shared_memory").to_pylist()[0] == 213_000
    assert k.column("bytes").to_pylist() == [None, 4 << 20, 1 << 20]
    assert k.column("graph_id").to_pylist() == [None, None, None]  # 0 = not from a graph
    assert k.column("external_id").to_pylist() == [1, 2, 3]
    la = t["launches"]
    assert la.column("name").to_pylist() == ["cudaLaunchKernel", "cudaMemcpyAsync", "cudaMemsetAsync"]
    assert la.column("tid").to_pylist() == [TID] * 3 and la.column("pid").to_pylist() == [PID] * 3
    assert la.column("external_id").to_pylist() == [1, 2, 3]
    ec = t["external_correlation"]
    assert sorted(zip(ec.column("correlation_id").to_pylist(), ec.column("external_id").to_pylist())) == [(11, 1), (12, 2), (13, 3)]
    for name, table in t.items():
        assert table.schema.equals(RecordSet().tables()[name].schema)


# Mangled symbols as CUPTI reports them for kernels torch launches on an H100/H200.
MANGLED = [
    "_ZN2at6native29vectorized_elementwise_kernelILi4ENS0_11FillFunctorIfEENS_6detail5ArrayIPcLi1EEEEEviT0_T1_",
    "_ZN2at6native13reduce_kernelILi512ELi1ENS0_8ReduceOpIfNS0_14func_wrapper_tIfZNS0_11sum_functorIfffEclERNS_14TensorIteratorEEUlffE_EEjfLi4ELi4EEEEEvT1_",
    "_ZN2at6native12_GLOBAL__N_127vectorized_layer_norm_kernelIffEEviT0_PKT_S6_S6_PS3_S7_PS4_",
]


def test_kernel_names_are_demangled_as_kineto_writes_them():
    """Oracle: binutils' c++filt, which uses the same Itanium demangler Kineto calls."""
    import shutil
    import subprocess

    if shutil.which("c++filt") is None:
        pytest.skip("c++filt (binutils) is not installed")
    expected = subprocess.run(["c++filt"], input="\n".join(MANGLED), capture_output=True, text=True,
                              check=True).stdout.splitlines()
    assert [cu.demangle(m) for m in MANGLED] == expected
    assert expected[0].startswith("void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float>")
    t = tables_of([kernel(11, 0, 10, name=MANGLED[0]), kernel(12, 20, 30, name=GEMM),
                                   kernel(13, 40, 50, name=MANGLED[0])], OFFSET, api_name)
    assert t["kernels"].column("name").to_pylist() == [expected[0], GEMM, expected[0]]


def test_names_that_are_not_valid_mangled_symbols_stay_as_they_are():
    for name in (GEMM, "_Z_not_a_symbol", "_Z", "", "Memcpy HtoD"):
        assert cu.demangle(name) == name


def test_kernels_that_move_data_between_gpus_are_collectives():
    """NCCL's kernels, torch's symmetric-memory all-reduce (as b200/eager's trace names it) and vLLM's custom
    all-reduce are collectives; an Inductor copy named after the all-gather it feeds is not."""
    names = {"ncclDevKernel_AllReduce_Sum_f32_RING_LL(ncclDevComm*, unsigned long, ncclWork*)": "collective",
             "void (anonymous namespace)::multimem_all_reduce_kernel<c10::BFloat16, 16>(c10::BFloat16*, unsigned long, "
             "unsigned int**, unsigned long, unsigned long)": "collective",
             "void (anonymous namespace)::two_shot_all_reduce_kernel_inplace<float, 16, 8>(float**, unsigned long)": "collective",
             "void vllm::cross_device_reduce_2stage<__nv_bfloat16, 8>(vllm::RankData*, vllm::RankSignals)": "collective",
             "triton_poi_fused_all_gather_copy_in_0": "kernel", GEMM: "kernel"}
    t = tables_of([kernel(i + 1, 20 * i, 20 * i + 10, name=n) for i, n in enumerate(names)])
    assert t["kernels"].column("kind").to_pylist() == list(names.values())


def test_a_buffer_that_does_not_fit_the_record_sizes_is_skipped_and_counted_never_misread():
    raw = pack(records())
    data = raw.buffers[0]
    sizes = {**raw.sizes, cu.KIND_CONCURRENT_KERNEL: 208}  # CUDA 12's Kernel9, 8 bytes shorter
    at = [o for o in _walk_one_by_one(data, raw.sizes) if data[o] == cu.KIND_CONCURRENT_KERNEL][0]
    kernel9 = np.concatenate([data[:at + 208], data[at + 216:]])  # the same records, the kernel as a Kernel9
    assert cr.parse(cr.RawActivity(buffers=[kernel9], sizes=sizes, names=raw.names)).gpu["name"].tolist() == \
        cr.parse(raw).gpu["name"].tolist()
    cols = cr.parse(cr.RawActivity(buffers=[kernel9], sizes=raw.sizes, names=raw.names))  # read as Kernel10s: it does not fit
    assert cols.skipped_buffers == 1 and not cols.gpu and len(cols.api["start"]) == 0
    unknown = np.zeros(8, np.int32)
    unknown[0] = 17  # CUPTI_ACTIVITY_KIND_OVERHEAD: never enabled, so no size is known for it
    assert cr.parse(cr.RawActivity(buffers=[unknown.view(np.uint8)])).skipped_buffers == 1
    assert all(t.num_rows == 0 for t in cu.tables(cr.RawActivity(), OFFSET, api_name).values())


def test_a_lent_buffer_comes_back_as_exactly_its_valid_bytes_and_is_lent_again():
    """The collector's side of CUPTI's buffer protocol, called as libcupti calls it."""
    import ctypes

    collector = cu.CuptiCollector()
    collector.BUFFER_BYTES = 1 << 16
    address, size, most = ctypes.c_void_p(), ctypes.c_size_t(), ctypes.c_size_t(7)
    collector._buffer_requested(ctypes.pointer(address), ctypes.pointer(size), ctypes.pointer(most))
    assert size.value == 1 << 16 and most.value == 0 and address.value % 8 == 0
    packed = pack(records())
    valid = len(packed.buffers[0])
    ctypes.memmove(address.value, packed.buffers[0].ctypes.data, valid)
    collector._buffer_completed(None, 0, address.value, size.value, valid)
    collector._buffer_completed(None, 0, 12345, 64, 64)  # a buffer it never lent: ignored, no exception

    class Lib:  # libcupti's flush and dropped-record count, as ctypes would call them
        def cuptiActivityFlushAll(self, flag):
            return 0

        def cuptiActivityGetNumDroppedRecords(self, context, stream, out):
            ctypes.cast(out, ctypes.POINTER(ctypes.c_size_t))[0] = 3
            return 0

    collector._lib = Lib()
    raw = collector.flush()
    assert collector.dropped() == 3 and [len(b) for b in raw.buffers] == [valid]
    assert raw.buffers[0].tobytes() == packed.buffers[0].tobytes()
    again = ctypes.c_void_p()
    collector._buffer_requested(ctypes.pointer(again), ctypes.pointer(size), ctypes.pointer(most))
    assert again.value == address.value  # the spare buffer, not a new allocation
    assert collector.flush().buffers == []


def test_a_kernel_name_pointer_outside_readable_memory_gives_an_unnamed_kernel_not_a_crash():
    import ctypes

    text = ctypes.create_string_buffer(MANGLED[0].encode())
    templated = "void at::native::elementwise_kernel<" + "at::detail::Array<char*, 3>, " * 200 + ">(int)"  # ~6 KB
    long_text = ctypes.create_string_buffer(templated.encode())
    live = cr.RawActivity()
    assert live.name_of(ctypes.addressof(text)) == MANGLED[0]
    assert live.name_of(ctypes.addressof(long_text)) == templated
    assert live.name_of(8) == live.name_of(0) == live.name_of(2**63) == "<unnamed kernel>"


def test_synchronization_records_are_counted_with_their_time():
    cols = cr.parse(pack(records()))
    assert cols.sync_count == 1 and cols.sync_ns == 20_000 and len(cols.gpu["start"]) == 3


def _walk_one_by_one(data: np.ndarray, sizes: dict) -> list[int]:
    """Reference: what cuptiActivityGetNextRecord does, a record at a time."""
    out, off = [], 0
    while off < len(data):
        out.append(off)
        off += sizes[int(data[off:off + 4].view(np.int32)[0])]
    assert off == len(data)  # the last record ends exactly where the valid bytes do
    return out


def test_the_vectorised_walk_finds_exactly_the_records_a_record_at_a_time_walk_finds():
    rng = np.random.default_rng(7)
    pool = records() + [kernel(30 + i, 0, 10) for i in range(5)]
    for n in (1, 2, 3, 17, 400):
        raw = pack([pool[i] for i in rng.integers(0, len(pool), n)])
        offsets, kinds = cr.walk(raw.buffers[0], raw.sizes)
        assert offsets.tolist() == _walk_one_by_one(raw.buffers[0], raw.sizes)
        assert len(kinds) == n
    torn = pack(records()).buffers[0][:-8]  # the last record cut short
    with pytest.raises(cr.LayoutError):
        cr.walk(torn, pack(records()).sizes)


def test_field_offsets_read_are_those_of_the_cupti_structs():
    """Oracle: cupti-python's numpy dtypes, generated by NVIDIA from cupti_activity.h."""
    from cupti_buffers import dtypes

    renamed = {"device": "device_id", "stream": "stream_id", "pid": "process_id", "tid": "thread_id",
               "static_shared": "static_shared_memory", "dynamic_shared": "dynamic_shared_memory",
               "grid": "grid_x", "block": "block_x"}
    types = dtypes()
    for kind, layout in ((cu.KIND_CONCURRENT_KERNEL, cr._KERNEL), (cu.KIND_MEMCPY, cr._MEMCPY), (cu.KIND_MEMSET, cr._MEMSET),
                         (cu.KIND_RUNTIME, cr._API), (cu.KIND_EXTERNAL_CORRELATION, cr._EXTERNAL),
                         (cu.KIND_SYNCHRONIZATION, cr._SYNC)):
        fields = types[kind].fields
        for name, _fmt, offset in layout:
            assert fields[renamed.get(name, name)][1] == offset, (kind, name)
    assert {k: t.itemsize for k, t in types.items()} == cr.CUDA13_SIZES


def test_api_name_falls_back_to_the_callback_id_without_libcupti():
    name = cu.default_api_name(cu.KIND_RUNTIME, 211)
    assert name == "cudaLaunchKernel" or name == "runtime:211"


def _ops() -> RecordSet:
    # The torch hooks' ops: epoch times, external ids 1..3 pushed around each op, shapes for the FLOP model.
    e = OFFSET + T0
    return table_from_columns("ops", {
        "pid": [PID] * 3, "tid": [TID] * 3,
        "start_ns": [e + 0, e + 200_000, e + 400_000], "end_ns": [e + 6_000, e + 204_000, e + 403_000],
        "name": ["aten::mm", "aten::copy_", "aten::fill_"], "category": ["cpu_op"] * 3,
        "external_id": [1, 2, 3], "sequence_number": [0, None, None], "fwd_thread_id": [0, 0, 0],
        "input_dims": ["[[4096, 4096], [4096, 4096]]", "[[1048576], [1048576], []]", "[[262144], []]"],
        "input_types": ['["float", "float"]', '["float", "float", "Scalar"]', '["float", "Scalar"]'],
        "concrete_inputs": ['["", ""]', '["", "", "False"]', '["", "0"]'],
    })


def test_stitched_kernels_join_their_ops_exactly_through_external_correlation():
    t = tables_of(records(), OFFSET, api_name)
    e = OFFSET + T0
    rs = RecordSet(kernels=t["kernels"], launches=t["launches"], external_correlation=t["external_correlation"],
                   ops=_ops(), source="live:cupti", resource={"plasmient.rank": 0, "host.name": "h"},
                   steps=table_from_columns("steps", {"step": [0], "start_ns": [e - 1_000], "end_ns": [e + 600_000], "name": ["optimizer.step#0"]}))
    rs.counters["cupti.dropped_records"] = 5
    from plasmient_trace.records import DeviceInfo

    rs.devices = [DeviceInfo(ordinal=0, name="NVIDIA H100 80GB HBM3", properties={"name": "NVIDIA H100 80GB HBM3", "totalGlobalMem": 85_000_000_000})]
    batch = stitch_records([rs], IngestOptions(job_id="fixture")).batch
    rows = batch.table.to_pylist()
    by_id = {r["span_id"]: r for r in rows}
    kernels = [r for r in rows if r["plasmient.level"] == "kernel"]
    assert sorted(k["name"] for k in kernels) == sorted([GEMM, "Memcpy HtoD (Pageable -> Device)", "Memset (Device)"])
    parent_op = {k["name"]: by_id[k["parent_span_id"]]["name"] for k in kernels}
    assert parent_op == {GEMM: "aten::mm", "Memcpy HtoD (Pageable -> Device)": "aten::copy_", "Memset (Device)": "aten::fill_"}
    step = next(r for r in rows if r["plasmient.level"] == "step")
    assert step["plasmient.cupti.dropped_records"] == 5
    assert step["plasmient.device.type"] == "gpu" and step["plasmient.unjoined_kernels"] == 0
    gemm = next(k for k in kernels if k["name"] == GEMM)
    assert gemm["plasmient.flops"] == pytest.approx(2 * 4096 ** 3)
    assert gemm["plasmient.mfu"] is not None


def test_step_level_gpu_step_keeps_measured_busy_time_but_drops_flops():
    t = tables_of(records(), OFFSET, api_name)
    e = OFFSET + T0
    rs = RecordSet(kernels=t["kernels"], launches=t["launches"], source="live:cupti",
                   steps=table_from_columns("steps", {"step": [0], "start_ns": [e - 1_000], "end_ns": [e + 600_000], "name": ["s"]}))
    batch = stitch_records([rs], IngestOptions(job_id="fixture", full_depth_steps=set(), gpu_model="NVIDIA H100 80GB HBM3")).batch
    table = batch.table  # the stitcher itself leaves what step depth did not measure absent
    step = next(r for r in table.to_pylist() if r["plasmient.level"] == "step")
    assert step["plasmient.busy_s"] == pytest.approx((100_000 + 100_000 + 7_000) / 1e9)
    assert step["plasmient.flops"] is None and step["plasmient.mfu"] is None
    assert step["plasmient.flops.source"] == "unknown" and step["plasmient.util.resident"] is not None
    assert {r["plasmient.level"] for r in table.to_pylist()} == {"fleet", "node", "rank", "step"}


def _has_gpu() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:
        return False


@pytest.mark.skipif(_has_gpu(), reason="a GPU is present: CUPTI may start")
def test_live_collector_fails_soft_without_a_driver():
    collector = cu.CuptiCollector()
    with pytest.raises(cu.CuptiUnavailable) as err:
        collector.start()
    assert "CUPTI" in str(err.value) or "cupti" in str(err.value)
    assert not collector.available
    collector.stop()  # harmless when never started
