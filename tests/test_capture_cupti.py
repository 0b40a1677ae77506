"""CUPTI adapter on recorded activity records.

There is no GPU here, so the records are fixtures built from the cupti-python documentation: one
object per record with the attribute names of its Python classes (ActivityKernel9, ActivityAPI,
ActivityMemcpy6, ActivityMemset4, ActivitySynchronization, ActivityExternalCorrelation) and the
CUpti_ActivityKind numbers of cupti_activity.h. The values follow what a PyTorch step launches:
a GEMM op launching one cuBLAS kernel, a copy op launching a memcpy, a fill op launching a memset.
"""

from __future__ import annotations

from types import SimpleNamespace as Rec

import pytest

from plasmient_trace.capture import cupti as cu
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
    t = cu.tables_from_activities(records(), OFFSET, api_name)
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
    t = cu.tables_from_activities([kernel(11, 0, 10, name=MANGLED[0]), kernel(12, 20, 30, name=GEMM),
                                   kernel(13, 40, 50, name=MANGLED[0])], OFFSET, api_name)
    assert t["kernels"].column("name").to_pylist() == [expected[0], GEMM, expected[0]]


def test_names_that_are_not_valid_mangled_symbols_stay_as_they_are():
    for name in (GEMM, "_Z_not_a_symbol", "_Z", "", "Memcpy HtoD"):
        assert cu.demangle(name) == name


def test_nccl_kernels_are_collectives():
    t = cu.tables_from_activities([kernel(1, 0, 10, name="ncclDevKernel_AllReduce_Sum_f32_RING_LL(ncclDevComm*, unsigned long, ncclWork*)")])
    assert t["kernels"].column("kind").to_pylist() == ["collective"]


def test_unknown_kinds_are_ignored_and_empty_input_gives_empty_tables():
    t = cu.tables_from_activities([Rec(kind=17, overhead_kind=1)])
    assert all(table.num_rows == 0 for table in t.values())


def test_buffer_take_resets_and_counts_synchronization():
    buf = cu.ActivityBuffer()
    buf.add(records())
    taken = buf.take()
    assert taken.sync_count == 1 and taken.sync_ns == 20_000
    assert len(taken.gpu["start"]) == 3 and not buf.gpu["start"]


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
    t = cu.tables_from_activities(records(), OFFSET, api_name)
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
    t = cu.tables_from_activities(records(), OFFSET, api_name)
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
