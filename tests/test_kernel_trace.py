"""benchmarks/kernel_trace.py's reading of a CUPTI trace (ktrace.c's lines), on a made-up trace: the
figures the GPU notes quote (GPU active time, kernel groups, API sums) come from these functions."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from kernel_trace import ATTENTION, active_ns, kernel_group, read_records  # noqa: E402


def test_kernel_groups_are_mlx_names_and_custom_kernels_without_their_source_hash():
    assert kernel_group("_ZN3mlx4core2cu11gemv_singleI6__halfLi8ELi4EEEvPKT_S6_PS4_ii") == "gemv_single"
    mangled = "_ZN3mlx4core2cu42custom_kernel_kivi_decode_combine_c943a72fI6__halfEEvv"
    assert kernel_group(mangled) == "kivi_decode_combine"
    assert kernel_group("cudnn_generated_fort_native_sdpa_sm80_flash_fprop").startswith("cudnn_generated")
    assert ATTENTION.search("kivi_decode_combine") and ATTENTION.search("cudnn_generated_fort_native_sdpa_sm80")
    assert not ATTENTION.search("gemv_single")


def test_active_time_is_the_union_of_overlapping_kernels():
    # [0, 10) and [5, 12) overlap (one graph's concurrent nodes); [20, 25) after a gap holds [21, 22)
    intervals = sorted([(0, 10, "a"), (5, 12, "b"), (20, 25, "c"), (21, 22, "d")])
    assert active_ns(intervals) == 12 + 5
    assert active_ns([]) == 0


def test_records_split_into_gpu_intervals_and_api_calls(tmp_path):
    trace = tmp_path / "trace.tsv"
    trace.write_text(
        "kernel\t300\t400\t7\t8,1,1\t256,1,1\t0\t_ZN3mlx4core2cu11rope_singleI6__halfEEvv\n"
        "memcpy\t100\t150\t7\t\t\t64\tmemcpy kind 1\n"
        "runtime\t90\t95\t11\t\t\t\tcudaGraphLaunch_v10000\n"
        "driver\t96\t99\t11\t\t\t\tcuGraphAddKernelNode_v2\n"
    )
    gpu, api = read_records(str(trace))
    assert gpu == [(100, 150, "memcpy"), (300, 400, "rope_single")]  # sorted by start
    assert api == [(90, 95, "cudaGraphLaunch"), (96, 99, "cuGraphAddKernelNode")]
