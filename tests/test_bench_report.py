"""pi-bench's report (bench/bench_report.py): the goals and the markdown table."""

import pytest

from bench import bench_report as report


def test_goals_and_table():
    res = {"systems": {"hybrid": {"decode_tokens_per_s": 80.0, "ffn_sparsity": 0.9, "gpu_activation_share": 0.7,
                                  "dram_around_bytes_per_s": {"before": 1.2e11, "after": 1.4e11,
                                                              "per_rep": [1.25e11, 1.31e11]}},
                       "all-gpu": {"decode_tokens_per_s": 110.0},
                       "powerinfer": {"decode_tokens_per_s": 40.0},
                       "llama.cpp -ngl 3": {"decode_tokens_per_s": 3.2, "n_gpu_layers": 3,
                                            "dram_around_bytes_per_s": {"before": 1.5e11, "after": 1.5e11}},
                       "accelerate offload": {"decode_tokens_per_s": 1.0}},
           "floor": {"tokens_per_s": 100.0},
           "kernel": {"rows": [{"density": 0.05, "bytes_per_s": 1, "share_of_dram_bw": 0.7},
                               {"density": 0.2, "bytes_per_s": 1, "share_of_dram_bw": 0.9}]},
           "predictor_time": {"ms_per_token": 0.5}, "floor_per_rep": {"median_share": 0.65},
           "floor_bound": {"kernel_density": 0.05, "kernel_bytes_per_s": 1.1e11, "kernel_share_of_dram": 0.85,
                           "serial_tokens_per_s": 66.0, "share_of_floor": 0.66, "kernel_share_needed": 0.93}}
    g = report.goals(res)
    assert g["bound_floor_share_at_kernel_rate"]["value"] == 0.66 and not g["bound_floor_share_at_kernel_rate"]["met"]
    assert g["hybrid_share_of_floor_dram_around_each_rep"]["met"] is False
    assert g["hybrid_vs_llamacpp_layer_split"]["value"] == 25 and g["hybrid_vs_llamacpp_layer_split"]["met"]
    assert g["hybrid_vs_powerinfer"]["value"] == 2 and g["hybrid_vs_powerinfer"]["met"]
    assert g["hybrid_share_of_our_all_gpu"]["value"] == pytest.approx(80 / 110)
    assert g["hybrid_share_of_our_all_gpu"]["met"] is False
    assert g["hybrid_vs_accelerate_offload"]["met"] is False
    assert g["hybrid_share_of_floor"]["value"] == pytest.approx(0.8) and g["hybrid_share_of_floor"]["met"]
    assert g["cpu_kernel_share_of_dram_bw"]["value"] == 0.7 and g["cpu_kernel_share_of_dram_bw"]["met"] is False
    assert g["predictor_share_of_decode"]["value"] == pytest.approx(0.04) and g["predictor_share_of_decode"]["met"]
    md = report.markdown({**res, "goals": g})
    assert "| hybrid | 80.00 | 25.00 | 0.80 |" in md and "NOT met" in md
    assert "| powerinfer | 40.00 | 12.50 | 0.40 | GPU share of activations" in md
    assert ("| serial floor, the cold rows at the cold kernel's own rate at 5% density (110.0 GB/s), the rest at its "
            "floor | 66.00 | 20.62 | 0.66 | 0.7 of the floor needs the cold rows at 0.93 of the DRAM ceiling") in md
    assert "DRAM around it 125-131 GB/s" in md and "3 layers on the GPU, DRAM around it 150 GB/s" in md
