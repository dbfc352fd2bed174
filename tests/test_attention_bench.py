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


def test_the_grid_covers_every_axis_the_goal_names() -> None:
    shapes = ab.grid_shapes()
    assert len(shapes) >= 40
    assert len({s["name"] for s in shapes}) == len(shapes)
    assert {s["h"] for s in shapes} == {64, 80, 96, 128, 256}
    assert {s["dtype"] for s in shapes} == {"float16", "bfloat16"}
    assert {bool(s.get("causal")) for s in shapes} == {False, True}
    kv = {s.get("n_kv", s["n"]) / s["n"] for s in shapes}
    assert 1.0 in kv and any(r < 1 for r in kv) and any(s.get("n_kv") == 1 for s in shapes)
    assert len({(s["b"], s["s"]) for s in shapes}) >= 10
    # every head dim meets both masks and both dtypes
    cells = {(s["h"], bool(s.get("causal")), s["dtype"]) for s in shapes}
    assert len(cells) == 5 * 2 * 2
    for s in shapes:
        assert s["n"] % s.get("n_kv", s["n"]) == 0


def test_the_grid_table_reads_the_goal() -> None:
    fast = _row(ours=1.0e-3, sdpa=1.2e-3, cudnn=1.1e-3, ours_sw=0, sdpa_sw=0)
    slow = _row(ours=1.0e-3, sdpa=0.95e-3, cudnn=0.9e-3, ours_sw=0, sdpa_sw=0)
    for r, dims in ((fast, {"n": 16, "h": 80, "dtype": "bfloat16"}), (slow, {"n": 8, "h": 64})):
        r |= {"dims": dims, "variants": ["overlap_128x128"], "flops": 1e9}
        r["stackfuse"]["max_abs_err_vs_sdpa"] = 1e-3
    broken = {"shape": "b1", "dims": {}, "stackfuse": {"error": "RuntimeError: x"}, "sdpa": {}}
    rows = [fast, slow, broken]
    doc = {"device": "H100", "date": "d", "command": "python -m b grid x", "rows": rows}
    md = ab.grid_markdown(doc)
    assert "| 1.100x |" in md and "| 0.900x |" in md
    assert "(cudnn)" in md and "| bfloat16 | no | 16/16 | 80 | overlap_128x128 |" in md
    assert "RuntimeError: x" in md
    geo = (1.1 * 0.9) ** 0.5
    assert f"Geometric mean {geo:.3f}x over 2 shapes" in md and "1 of 2 shapes >= 1.0x" in md
    assert "Changed since" not in md
    md = ab.grid_markdown(doc | {"changed_since": "b1 takes ping-pong."})
    assert "\nChanged since this run: b1 takes ping-pong.\n" in md


def test_window_rows_count_the_band_and_get_their_own_table() -> None:
    w = next(s for s in ab.grid_shapes() if s.get("window") == 256)
    b, s, n, h = w["b"], w["s"], w["n"], w["h"]
    pairs = sum(min(i + 1, 256) for i in range(s))
    assert ab.flops(w) == pytest.approx(4.0 * b * n * h * pairs)
    assert ab.flops({"b": 1, "s": 8, "n": 1, "h": 1, "causal": "BottomRight"}) == 4.0 * 32
    row = _row(ours=1.0e-3, sdpa=3e-3, cudnn=2e-3, ours_sw=0, sdpa_sw=0)
    row |= {"dims": w, "variants": ["pingpongk_128x128"], "flops": 1e9}
    row["stackfuse"]["max_abs_err_vs_sdpa"] = 1e-3
    md = ab.grid_markdown({"device": "H100", "date": "d", "command": "c grid", "rows": [row]})
    assert "## Sliding windows" in md and "| window 256 |" in md and "| 2.000x |" in md


def test_ragged_rows_count_each_sequences_own_pairs() -> None:
    r = next(s for s in ab.grid_shapes() if "lengths" in s)
    assert r["b"] == 1 and r["s"] == sum(r["lengths"])
    one = {"b": 1, "n": r["n"], "h": r["h"], "causal": "BottomRight"}
    per = [ab.flops(one | {"s": n}) for n in r["lengths"]]
    assert ab.flops(r) == pytest.approx(sum(per))
    assert ab.flops(r) < ab.flops({k: v for k, v in r.items() if k != "lengths"})
