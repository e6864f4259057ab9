"""`brigade sim run` and `brigade plan` from the command line: result files `brigade bench`
reads, a recommendation that meets its SLO, and bad flags answered in one line."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from cluster.cli import main
from loadtest import report

FLEET = ["--model", "tiny", "--device", "cpu-2core", "--num-blocks", "512"]
WORK = ["--workload", "shared-prefix", "--workload-args",
        "num_groups=2,prompts_per_group=3,system_prompt_len=64,question_len=8,output_len=4", "--request-rate", "10"]


def test_sim_run_writes_a_bench_result(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    assert main(["sim", "run", *FLEET, "--prefill", "2", "--decode", "1", *WORK, "--slo", "ttft=1s",
                 "--output-dir", str(tmp_path)]) == 0
    result = report.load(tmp_path / "result.json")  # what `brigade bench compare` and `report` read
    (run,) = result["runs"]
    assert result["backend"] == "sim" and run["completed"] == 6 and run["failed"] == 0
    assert all(r.output_tokens == 4 for r in run["records"])
    assert run["cache_hit_ratio"] > 0  # the shared system prompts were found in the cache
    assert (tmp_path / "report.html").exists()
    assert "simulated" in capsys.readouterr().out


def test_plan_recommends_a_configuration_meeting_the_slo(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "plan.json"
    code = main(["plan", *FLEET, *WORK, "--slo", "ttft=1s", "--max-gpus", "3", "--tp-sizes", "1",
                 "--policies", "kv_aware", "--json", str(out)])
    result = json.loads(out.read_text())
    best = result["recommended"]
    assert code == 0 and best is not None and best["meets"] and best["slo_met"] >= 0.9
    cheaper = [t for t in result["tried"] if t["gpus"] < best["gpus"]]
    assert all(not t["meets"] for t in cheaper)  # nothing cheaper met it
    assert "recommended:" in capsys.readouterr().out


def test_plan_names_the_closest_configuration_when_none_meets_the_slo(tmp_path: Path,
                                                                       capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "plan.json"
    code = main(["plan", *FLEET, *WORK, "--slo", "ttft=1ms", "--max-gpus", "2", "--tp-sizes", "1",
                 "--policies", "kv_aware", "--json", str(out)])
    result = json.loads(out.read_text())
    printed = capsys.readouterr().out
    assert code == 1 and result["recommended"] is None and result["closest"] is not None
    assert "no configuration up to 2 GPUs meets the SLO" in printed and "closest:" in printed


def test_plan_with_headroom_says_so(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "plan.json"
    code = main(["plan", *FLEET, *WORK, "--slo", "ttft=1s", "--max-gpus", "3", "--tp-sizes", "1",
                 "--policies", "kv_aware", "--headroom", "1.5", "--json", str(out)])
    result = json.loads(out.read_text())
    printed = capsys.readouterr().out
    assert code == 0 and result["headroom"] == 1.5 and result["recommended"]["headroom_met"] >= 0.9
    assert "% at 1.5x the costs)" in printed and "meet the SLO at 1.5x the costs" in printed


@pytest.mark.parametrize(("argv", "message"), [
    (["sim", "run", "--device", "B300"], "unknown device 'B300'"),
    (["sim", "run", "--workload", "trace"], "--trace-file"),
    (["sim", "run", "--workload-args", "num_prompts"], "KEY=VALUE"),
    (["sim", "run", "--workload-args", "input_len=abc"], "--workload-args"),
    (["plan", "--slo", "speed=1"], "bad SLO"),
    (["plan", "--slo", "ttft=1s", "--headroom", "0.5"], "headroom: Input should be greater than or equal to 1"),
])
def test_bad_flags_get_one_line(argv: list[str], message: str, capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_calibrate_fits_a_device_and_nothing_of_a_serving_path(capsys: pytest.CaptureFixture) -> None:
    """Its flags time the engine's steps; its help says what the profile leaves out."""
    with pytest.raises(SystemExit):
        main(["sim", "calibrate", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--threads" in text and "--dtype" in text
    assert "--url" not in text and "--disagg-url" not in text and "--serving-only" not in text
    assert "what a serving path adds per request" in text and "a device of its own" in text
    with pytest.raises(SystemExit) as exc:
        main(["sim", "calibrate", "--url", "http://127.0.0.1:1"])
    assert exc.value.code == 2
