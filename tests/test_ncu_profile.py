"""benchmarks/ncu_profile.py without a GPU: reading ncu's CSV, the table, and bad input."""

import csv
import io

import pytest

from benchmarks.ncu_profile import ROWS, main, parse_ncu_csv, summarize, table

HEADER = ["ID", "Process ID", "Process Name", "Host Name", "Kernel Name", "Context", "Stream", "Block Size",
          "Grid Size", "Device", "CC", "Section Name", "Body Item Label", "Metric Name", "Metric Unit",
          "Metric Value", "Rule Name", "Rule Type", "Rule Description", "Estimated Speedup Type",
          "Estimated Speedup"]
PIPES = "Pipe Utilization (% of peak instructions executed over elapsed cycles)"


def ncu_output(launches: list[dict]) -> str:
    """What `ncu --csv --page details` prints for these launches ({(section, item, metric): value}),
    after the profiled program's own lines."""
    out = io.StringIO()
    out.write("==PROF== Connected to process 782 (/usr/bin/python3.12)\nprofiling 192x128s2\n")
    writer = csv.writer(out, quoting=csv.QUOTE_ALL, lineterminator="\n")
    writer.writerow(HEADER)
    for launch_id, metrics in enumerate(launches):
        for (section, item, name), value in metrics.items():
            writer.writerow([str(launch_id), "782", "python3.12", "127.0.0.1", "kernel_fwd", "1", "7", "(512, 1, 1)",
                             "(132, 1, 1)", "0", "9.0", section, item, name, "%", value, "", "", "", "", ""])
    return out.getvalue()


def launch(xu: str, wait: str, executed: str) -> dict:
    return {
        ("Compute Workload Analysis", "", "Issue Slots Busy"): "43.30",
        ("Compute Workload Analysis", PIPES, "XU"): xu,
        ("Compute Workload Analysis", "Pipe Utilization (% of peak instructions executed over active cycles)", "XU"): "99",
        ("Compute Workload Analysis", PIPES, "FMA"): "17.60",
        ("Scheduler Statistics", "", "No Eligible"): "56.19",
        ("Warp State Statistics", "", "Warp Cycles Per Issued Instruction"): "7.42",
        ("Warp State Statistics", "", "Stall Wait"): wait,
        ("Warp State Statistics", "", "Stall Long Scoreboard"): "0.74",
        ("Warp State Statistics", "", "Stall Sleeping"): "0",
        ("Instruction Statistics", "", "Executed Instructions"): executed,
    }


def test_launches_are_read_in_order_with_their_metrics():
    launches = parse_ncu_csv(ncu_output([launch("66.48", "2.35", "1,411,537,912"), launch("55.05", "1.77", "1,686,099,448")]))
    assert len(launches) == 2
    first, second = (summarize(m) for m in launches)
    assert first["XU (MUFU) pipe, % of peak"] == 66.48  # over elapsed cycles, not the active-cycles item
    assert second["executed instructions"] == 1686099448
    assert first["ALU pipe, % of peak"] is None  # not in this output
    assert list(first["stalls"]) == ["Wait", "Long Scoreboard"]  # largest first, zeros left out
    text = table("64:16384", ["default", "default + emu_share=0.125"], [first, second])
    assert "| XU (MUFU) pipe, % of peak | 66.48 | 55.05 |" in text
    assert "| stall: Wait (cycles per issued instruction) | 2.35 | 1.77 |" in text
    assert "| ALU pipe, % of peak | - | - |" in text
    assert len([line for line in text.splitlines() if line.startswith("| ")]) == 1 + len(ROWS) + 2


def test_output_without_a_csv_is_an_error():
    with pytest.raises(ValueError, match="no ncu CSV header"):
        parse_ncu_csv("==ERROR== Failed to initialize the profiler: LibraryNotLoaded\n")


@pytest.mark.parametrize("argv, message", [
    (["--shape", "64"], "--shape wants head_dim:seqlen"),
    (["--set", "nope=1"], "--set wants knob=value"),
    (["--ncu", "/nonexistent/ncu"], "no Nsight Compute at /nonexistent/ncu"),
])
def test_bad_input_says_what_is_wrong(argv, message, capsys):
    assert main(argv) == 2
    assert message in capsys.readouterr().err
