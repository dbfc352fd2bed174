"""The issue benchmark's bookkeeping (benchmarks/attention_bench.py), without a GPU: which calls
of a profiled stream are timed, and how the results table reads them."""

from __future__ import annotations

import pytest

from benchmarks import attention_bench as ab


def test_first_and_last_time_the_two_ends_of_one_stream() -> None:
    # 30 calls of two kernels each (a copy of 1 us, then the kernel): the kernel slows from
    # 10 us to 20 us over the stream, and the events arrive out of order
    events = []
    for i in range(30):
        events += [(i * 100.0 + 50, 10.0 + i * 10 / 29), (i * 100.0, 1.0)]
    events.reverse()
    first, last = ab.first_and_last(events, total_calls=30, calls=5)
    assert first == pytest.approx(sum(1 + 10 + i * 10 / 29 for i in range(5)) / 5 / 1e6)
    assert last == pytest.approx(sum(1 + 10 + i * 10 / 29 for i in range(25, 30)) / 5 / 1e6)
    with pytest.raises(ValueError):
        ab.first_and_last([], total_calls=30, calls=5)


def test_preroll_is_about_its_time_in_calls_within_bounds() -> None:
    assert ab.preroll_calls(2e-3) == round(ab.PREROLL_S / 2e-3)  # a long shape: ~100 calls
    assert ab.preroll_calls(1e-5) == ab.PREROLL_MAX_CALLS  # a short one: capped
    assert ab.preroll_calls(1.0) == ab.CALLS  # never fewer than it times


def _row(ours: float, sdpa: float, cudnn: float, ours_sw: float, sdpa_sw: float) -> dict:
    def way(k: float, sw: float | None) -> dict:
        d = {"kernel_s": k, "call_s": k * 1.1, "kernel_tflops": 1.0 / k / 1e12}
        return d | ({"kernel_s_after_switch": sw} if sw else {})

    return {
        "shape": "b4_s4096_n32_h128",
        "rounds": 9,
        "calls": 20,
        "preroll_s": 0.2,
        "stackfuse": way(ours, ours_sw),
        "sdpa": way(sdpa, sdpa_sw),
        "sdpa_best": {"backend": "CUDNN_ATTENTION", **way(cudnn, None)},
    }


def test_ratios_use_sdpas_fastest_path_in_each_timing() -> None:
    row = _row(ours=1.9e-3, sdpa=2.0e-3, cudnn=1.95e-3, ours_sw=1.77e-3, sdpa_sw=1.72e-3)
    ab.add_ratios(row)
    assert row["stackfuse"]["kernel_ratio_vs_sdpa_best"] == pytest.approx(1.95 / 1.9)
    assert row["stackfuse"]["kernel_ratio_after_switch_vs_sdpa_best"] == pytest.approx(1.72 / 1.77)
    md = ab.to_markdown({"device": "H200", "date": "d", "command": "c", "rows": [row]})
    assert "| 1.03x | 0.97x |" in md  # steady, then right after a switch
    assert "1 of 1 shapes >= 1.0x" in md and "0 of 1 shapes >= 1.0x" in md
    assert "~200 ms untimed" in md


def test_old_results_without_a_steady_timing_still_render() -> None:
    row = _row(ours=1.77e-3, sdpa=1.72e-3, cudnn=1.74e-3, ours_sw=0, sdpa_sw=0)
    del row["preroll_s"]
    md = ab.to_markdown({"device": "H200", "date": "d", "command": "c", "rows": [row]})
    assert "| 0.97x | - |" in md and "rounds of 20 calls" in md


def test_bin_medians_groups_points_by_time() -> None:
    pts = [(1.0, 10.0), (2.0, 30.0), (6.0, 5.0), (700.0, 7.0)]
    assert ab.bin_medians(pts) == {"0-5 ms": 20.0, "5-20 ms": 5.0, "500-1000 ms": 7.0}
