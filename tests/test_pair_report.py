"""benchmarks/pair.py's report: the share of the one-token roofline beside the plain rows only, and results
written before the roofline was measured still render."""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

from pair import render  # noqa: E402


def _row(config, tok_s):
    return {"config": config, "median_decode_tok_s": tok_s, "ratio_vs_ours_alone": tok_s / 3.0,
            "ratio_vs_stock": tok_s / 2.4, "worst_ratio_vs_ours_alone": tok_s / 3.0, "median_ttft_s": 2.0,
            "identical_to_ours_alone": True}


def _result(**run_fields):
    run = {"target_dtype": "float32", "draft_dtype": "bfloat16", "k": 4, "export_s": 30.0, "rss_ours_gb": 9.0,
           "peak_rss_gb": 15.0, "acceptance_rate": 0.75, "target_weight_gb": 6.62,
           "rows": [_row("stock alone", 2.4), _row("ours alone", 3.0), _row("ours + draft, k=4", 7.5)], **run_fields}
    return {"command": "python benchmarks/pair.py", "date": "2026-12-04", "threads": 1, "new_tokens": 128,
            "prompt_count": 2, "rounds": 2, "torch": "2.8.0", "transformers": "4.51.3", "ipex": "2.8.0",
            "runs": [run]}


def _table_row(report, config):
    return next(line for line in report.splitlines() if f"| {config} |" in line).split(" | ")


def test_plain_rows_show_their_share_of_the_roofline_and_drafted_rows_do_not():
    report = render(_result(bandwidth_gbs=28.4, bandwidth_gbs_by_round=[28.0, 28.8], roofline_tok_s=4.0))
    assert _table_row(report, "stock alone")[6] == "60%"
    assert _table_row(report, "ours alone")[6] == "75%"
    assert _table_row(report, "ours + draft, k=4")[6] == "-"  # speculation reads the weights once for several tokens
    assert "read bandwidth 28.4 GB/s (median of 28.0, 28.8, one per round)" in report
    assert "one-token roofline 4.00 tok/s" in report


def test_a_result_without_the_roofline_renders_a_dash():
    report = render(_result())
    assert _table_row(report, "ours alone")[6] == "-"
    assert "read bandwidth" not in report
