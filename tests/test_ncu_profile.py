"""benchmarks/ncu_profile.py without a GPU: reading ncu's CSV, the table, and bad input."""

import csv
import io

import pytest

from benchmarks.ncu_profile import ROWS, main, parse_ncu_csv, summarize, table

HEADER = [
    "ID",
    "Process ID",
    "Process Name",
    "Host Name",
    "Kernel Name",
    "Context",
    "Stream",
    "Block Size",
    "Grid Size",
    "Device",
    "CC",
    "Section Name",
    "Body Item Label",
    "Metric Name",
    "Metric Unit",
    "Metric Value",
    "Rule Name",
    "Rule Type",
    "Rule Description",
    "Estimated Speedup Type",
    "Estimated Speedup",
]
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
            writer.writerow(
                [
                    str(launch_id),
                    "782",
                    "python3.12",
                    "127.0.0.1",
                    "kernel_fwd",
                    "1",
                    "7",
                    "(512, 1, 1)",
                    "(132, 1, 1)",
                    "0",
                    "9.0",
                    section,
                    item,
                    name,
                    "%",
                    value,
                    "",
                    "",
                    "",
                    "",
                    "",
                ]
            )
    return out.getvalue()


def launch(xu: str, wait: str, executed: str) -> dict:
    return {
        ("Compute Workload Analysis", "", "Issue Slots Busy"): "43.30",
        ("Compute Workload Analysis", PIPES, "XU"): xu,
        (
            "Compute Workload Analysis",
            "Pipe Utilization (% of peak instructions executed over active cycles)",
            "XU",
        ): "99",
        ("Compute Workload Analysis", PIPES, "FMA"): "17.60",
        ("Scheduler Statistics", "", "No Eligible"): "56.19",
        ("Warp State Statistics", "", "Warp Cycles Per Issued Instruction"): "7.42",
        ("Warp State Statistics", "", "Stall Wait"): wait,
        ("Warp State Statistics", "", "Stall Long Scoreboard"): "0.74",
        ("Warp State Statistics", "", "Stall Sleeping"): "0",
        ("Instruction Statistics", "", "Executed Instructions"): executed,
    }


def test_launches_are_read_in_order_with_their_metrics():
    launches = parse_ncu_csv(
        ncu_output(
            [launch("66.48", "2.35", "1,411,537,912"), launch("55.05", "1.77", "1,686,099,448")]
        )
    )
    assert len(launches) == 2
    first, second = (summarize(m) for m in launches)
    assert (
        first["XU (MUFU) pipe, % of peak"] == 66.48
    )  # over elapsed cycles, not the active-cycles item
    assert second["executed instructions"] == 1686099448
    assert first["ALU pipe, % of peak"] is None  # not in this output
    assert list(first["stalls"]) == ["Wait", "Long Scoreboard"]  # largest first, zeros left out
    text = table("64:16384", ["default", "default + emu_share=0.125"], [first, second])
    assert "| XU (MUFU) pipe, % of peak | 66.48 | 55.05 |" in text
    assert "| stall: Wait (cycles per issued instruction) | 2.35 | 1.77 |" in text
    assert "| ALU pipe, % of peak | - | - |" in text
    assert len([line for line in text.splitlines() if line.startswith("| ")]) == 1 + len(ROWS) + 2


def test_raw_counters_are_read_by_name_in_any_section():
    metrics = launch("66.48", "2.35", "1,411,537,912")
    store = "l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_st.sum"
    metrics[("Command line profiler metrics", "", store)] = "1,048,576"
    metrics[("Command line profiler metrics", "", store.replace("_st.", "_ld."))] = "0"
    (launched,) = parse_ncu_csv(ncu_output([metrics]))
    row = summarize(launched)
    assert row["shared store bank conflicts"] == 1048576
    assert row["shared load bank conflicts"] == 0
    assert row["shared store wavefronts"] is None  # not in this output
    text = table("96:4096:causal", ["default"], [row])
    assert "| shared store bank conflicts | 1,048,576 |" in text
    assert "| shared load bank conflicts | 0.00 |" in text


def test_output_without_a_csv_is_an_error():
    with pytest.raises(ValueError, match="no ncu CSV header"):
        parse_ncu_csv("==ERROR== Failed to initialize the profiler: LibraryNotLoaded\n")


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--shape", "64"], "--shape wants head_dim:seqlen"),
        (["--set", "nope=1"], "--set wants knob=value"),
        # --backward takes the backward's knobs, and only them
        (["--backward", "--set", "wg_pingpong=false"], "a knob of tile_m, tile_n, num_stages"),
        (["--backward", "--set", "ds_stages=3"], "ds_stages=3"),
        (["--ncu", "/nonexistent/ncu"], "no Nsight Compute at /nonexistent/ncu"),
        (["--peer"], "give --backward too"),
    ],
)
def test_bad_input_says_what_is_wrong(argv, message, capsys):
    assert main(argv) == 2
    assert message in capsys.readouterr().err


SOURCE_COLUMNS = [
    "Address",
    "Source",
    "Warp Stall Sampling (All Samples)",
    "Warp Stall Sampling (Not-issued Samples)",
    "stall_long_sb",
    "stall_mio",
    "stall_wait",
    "stall_barrier",
    "stall_wait (Not Issued)",
]


def source_output(rows: list[tuple]) -> str:
    """What `ncu -i REPORT --page source --csv --print-source sass` prints for one launch: a line
    naming the kernel, the header, one row per SASS instruction."""
    out = io.StringIO()
    writer = csv.writer(out, quoting=csv.QUOTE_ALL, lineterminator="\n")
    out.write('"Kernel Name","kernel_fwd",\n')
    writer.writerow(SOURCE_COLUMNS)
    for address, source, samples, long_sb, mio, wait, barrier in rows:
        writer.writerow([address, source, samples, samples, long_sb, mio, wait, barrier, "0"])
    return out.getvalue()


SOURCE_ROWS = [
    ("0x10", "      MUFU.EX2 R4, R4", "300", "0", "100", "200", "0"),
    ("0x20", "@!P0  BRA 0x7fde237b0110", "100", "90", "0", "10", "0"),
    ("0x30", "      MUFU.EX2 R5, R5", "100", "0", "60", "40", "0"),
    ("0x40", "      WARPGROUP.DEPBAR.LE gsb0, 0x0", "0", "0", "0", "0", "0"),
]


def test_source_counters_are_summed_per_opcode():
    from benchmarks.ncu_profile import opcode, parse_source_csv, source_table, summarize_source

    assert opcode("@!P0  BRA 0x7f") == "BRA" and opcode("MUFU.EX2 R4, R4") == "MUFU.EX2"
    assert opcode("HGMMA.64x96x16.F32.BF16 R24, gdesc[UR20], RZ, !UPT") == "HGMMA.64x96x16"
    rows = parse_source_csv(source_output(SOURCE_ROWS))
    assert len(rows) == 4
    ops = summarize_source(rows)
    assert list(ops) == ["MUFU.EX2", "BRA"]  # by samples; an opcode never sampled is left out
    assert ops["MUFU.EX2"]["share"] == 80.0 and ops["BRA"]["share"] == 20.0
    assert ops["MUFU.EX2"]["stalls"] == {"wait": 60.0, "mio": 40.0}  # % of the opcode's samples
    text = source_table(["default", "variant"], [ops, {"BRA": ops["BRA"]}])
    assert "| MUFU.EX2 | 80.0% (wait 60%, mio 40%) | - |" in text
    assert "| BRA | 20.0% (long_sb 90%, wait 10%) | 20.0% (long_sb 90%, wait 10%) |" in text
    with pytest.raises(ValueError, match="no ncu source CSV header"):
        parse_source_csv('"Kernel Name","kernel_fwd",\n')


FAKE_NCU = '''#!{python}
"""Stands in for ncu: `-o REPORT ...` writes REPORT.ncu-rep (the profiled program is not run) unless
the file `fail` is beside this script; `-i REPORT --page details|source` prints the CSV saved beside
this script for that page (and launch), and fails where REPORT does not exist."""
import pathlib, sys
here = pathlib.Path(__file__).parent
args = sys.argv[1:]
(here / "calls.txt").open("a").write(" ".join(args) + "\\n")
if "-o" in args:
    if (here / "fail").exists():
        sys.stdout.write("==ERROR== ERR_NVGPUCTRPERM - no permission to access NVIDIA GPU \
Performance Counters\\n")
        sys.exit(1)
    pathlib.Path(args[args.index("-o") + 1] + ".ncu-rep").write_text("report")
elif not pathlib.Path(args[args.index("-i") + 1]).exists():
    sys.stderr.write("==ERROR== no such report\\n")
    sys.exit(1)
elif args[args.index("--page") + 1] == "details":
    sys.stdout.write((here / "details.csv").read_text())
else:
    sys.stdout.write((here / ("source%s.csv" % args[args.index("--launch-skip") + 1])).read_text())
'''


@pytest.fixture
def fake_ncu(tmp_path):
    import sys

    ncu = tmp_path / "ncu"
    ncu.write_text(FAKE_NCU.format(python=sys.executable))
    ncu.chmod(0o755)
    (tmp_path / "details.csv").write_text(
        ncu_output(
            [launch("66.48", "2.35", "1,411,537,912"), launch("69.30", "2.10", "1,455,668,488")]
        )
    )
    (tmp_path / "source0.csv").write_text(source_output(SOURCE_ROWS))
    (tmp_path / "source1.csv").write_text(source_output(SOURCE_ROWS[1:]))
    return ncu


def test_source_run_profiles_to_a_report_and_reads_each_launch_back(fake_ncu, tmp_path, capsys):
    """The whole main() with --source against a stand-in for ncu: the sections asked for, the report
    read back once for the details and once per launch for the source counters, both tables
    printed, and with --csv each launch's source page kept."""
    import json

    out_json = tmp_path / "out.json"
    assert (
        main(
            [
                "--ncu",
                str(fake_ncu),
                "--set",
                "wg_pingpong=false",
                "--source",
                "--json",
                str(out_json),
                "--csv",
                str(tmp_path / "kept.csv"),
            ]
        )
        == 0
    )
    printed = capsys.readouterr().out
    for i in (0, 1):  # each launch's source page kept beside the details' CSV, as ncu printed it
        kept = (tmp_path / f"kept-source{i}.csv").read_text()
        assert kept == (tmp_path / f"source{i}.csv").read_text()
    assert "| XU (MUFU) pipe, % of peak | 66.48 | 69.30 |" in printed
    assert "| MUFU.EX2 | 80.0% (wait 60%, mio 40%) | 50.0% (mio 60%, wait 40%) |" in printed
    calls = (tmp_path / "calls.txt").read_text().splitlines()
    assert len(calls) == 4 and "--section SourceCounters" in calls[0] and "--child" in calls[0]
    assert "--page details" in calls[1] and "--launch-skip 1 --launch-count 1" in calls[3]
    columns = json.loads(out_json.read_text())["columns"]
    assert list(columns) == ["default", "default + wg_pingpong=false"]
    assert columns["default"]["opcodes"]["BRA"]["share"] == 20.0


def test_run_without_source_reads_the_details_only(fake_ncu, tmp_path, capsys):
    assert (
        main(
            [
                "--ncu",
                str(fake_ncu),
                "--set",
                "wg_pingpong=false",
                "--csv",
                str(tmp_path / "kept.csv"),
            ]
        )
        == 0
    )
    printed = capsys.readouterr().out
    assert (
        "| XU (MUFU) pipe, % of peak | 66.48 | 69.30 |" in printed
        and "per SASS opcode" not in printed
    )
    calls = (tmp_path / "calls.txt").read_text().splitlines()
    assert len(calls) == 2 and "SourceCounters" not in calls[0]
    assert parse_ncu_csv((tmp_path / "kept.csv").read_text())  # the details page's CSV kept
    assert not list(tmp_path.glob("kept-source*"))


def test_a_failed_profile_says_so_with_ncus_output(fake_ncu, tmp_path, capsys):
    (tmp_path / "fail").write_text("")
    assert main(["--ncu", str(fake_ncu), "--source"]) == 1
    err = capsys.readouterr().err
    assert (
        "the profiled run wrote no report; ncu exit status 1" in err and "ERR_NVGPUCTRPERM" in err
    )
    assert len((tmp_path / "calls.txt").read_text().splitlines()) == 1  # nothing read back


def test_a_missing_launch_is_named_before_the_source_counters_are_read(fake_ncu, tmp_path, capsys):
    (tmp_path / "details.csv").write_text(ncu_output([launch("66.48", "2.35", "1,411,537,912")]))
    assert main(["--ncu", str(fake_ncu), "--set", "wg_pingpong=false", "--source"]) == 1
    assert "1 profiled launches, expected 2" in capsys.readouterr().err
    assert len((tmp_path / "calls.txt").read_text().splitlines()) == 2


def test_backward_profiles_only_the_main_kernel_with_its_knobs(fake_ncu, tmp_path, capsys):
    """--backward: ncu keeps the backward's main kernel (not the preprocessing kernel or the dQ
    cast around it), and the child is told to run the backward with the backward's knob."""
    assert main(["--ncu", str(fake_ncu), "--backward", "--set", "dq_tma=false"]) == 0
    assert "| XU (MUFU) pipe, % of peak | 66.48 | 69.30 |" in capsys.readouterr().out
    profile = (tmp_path / "calls.txt").read_text().splitlines()[0]
    assert "--kernel-name regex:FlashBackwardSm90" in profile
    assert "--child" in profile and "--backward" in profile and "--set dq_tma=false" in profile


def test_peer_adds_flash_attn_4s_backward_main_kernel_as_a_column(fake_ncu, tmp_path, capsys):
    """--backward --peer: ncu keeps both main kernels (ours and flash-attn-4's), and the table has
    a column per launch, flash-attn-4's last."""
    (tmp_path / "details.csv").write_text(
        ncu_output([launch("66.48", "2.35", "1,411,537,912"), launch("70.10", "2.00", "1,200")])
    )
    assert main(["--ncu", str(fake_ncu), "--backward", "--peer"]) == 0
    assert "| metric | default | flash-attn-4 |" in capsys.readouterr().out
    profile = (tmp_path / "calls.txt").read_text().splitlines()[0]
    assert "--kernel-name regex:FlashBackwardSm90|FlashAttentionBackwardSm90" in profile
    assert "--backward --peer" in profile
