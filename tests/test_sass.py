"""benchmarks/sass.py: counting nvdisasm's SASS, bad input, and (where a disassembler is installed)
a real compile of the backward's default config read back."""

import pytest

from benchmarks.sass import find_tool, longest_run, main, opcodes, summarize

SASS = """
        /*2e10*/                   WARPGROUP.DEPBAR.LE gsb0, 0x1 ;
        /*2e20*/              @!P1 BRA `(.L_x_16) ;
        /*2ea0*/                   FFMA R219, R219, UR15, -R8.reuse ;
        /*2ed0*/                   MUFU.EX2 R184, R219 ;
        /*2ee0*/               @P2 FFMA R220, R220, UR15, -R8 ;
        /*2ef0*/                   MUFU.EX2 R185, R220 ;
        /*2f00*/                   MUFU.EX2 R186, R221 ;
        /*2f10*/                   MUFU.EX2 R187, R222 ;
        /*2f18*/                   MUFU.RCP R188, R223 ;
        /*2f20*/                   LDS.128 R8, [R216+0x800] ;
        /*2f30*/                   LDS R12, [R216+0x900] ;
        /*2f38*/                   LDS.U16 R13, [R216+0x940] ;
        /*2f40*/                   STS [R3+0x10], R184 ;
        /*2f50*/                   STS.64 [R3+0x20], R186 ;
        /*2f60*/                   BAR.SYNC.DEFER_BLOCKING 0x2, 0x100 ;
        /*2f70*/                   BAR.ARV 0x3, 0x120 ;
        /*2f80*/                   HGMMA.64x64x16.F32.BF16 R152, gdesc[UR16], RZ, !UPT ;
        /*2f90*/                   STL [R1], R5 ;
"""


def test_opcodes_are_read_with_their_modifiers_and_predicates_skipped():
    ops = opcodes(SASS)
    assert ops[:4] == ["WARPGROUP.DEPBAR.LE", "BRA", "FFMA", "MUFU.EX2"]
    assert ops[4] == "FFMA"  # the predicated one
    assert len(ops) == 18


def test_counts_and_the_longest_ex2_run():
    counts = summarize(opcodes(SASS))
    assert counts["MUFU.EX2"] == 4
    # the three back to back (not the one after the first FFMA, nor the RCP after them)
    assert counts["EX2 run"] == 3
    assert counts["FFMA"] == 2
    assert counts["LDS"] == "U16:1 32:1 128:1"
    assert counts["STS"] == "32:1 64:1"
    assert counts["BAR"] == 1 and counts["BAR.ARV"] == 1
    assert counts["HGMMA"] == 1
    assert counts["local"] == 1
    assert longest_run(["A", "MUFU.EX2", "B"], "MUFU") == 1
    assert longest_run([], "MUFU") == 0


def test_bad_input_says_what_is_wrong(capsys, tmp_path):
    missing = str(tmp_path / "no-nvdisasm")
    assert main(["--nvdisasm", missing]) == 2
    assert "no nvdisasm" in capsys.readouterr().err
    if find_tool("nvdisasm") is None:
        pytest.skip("no nvdisasm here: the remaining cases need one to get past the first check")
    assert main(["--backward", "--set", "no_such_knob=1"]) == 2
    assert "knob=value" in capsys.readouterr().err
    assert main(["--problem", "head_dim"]) == 2
    assert "name=value" in capsys.readouterr().err


@pytest.mark.compile
def test_the_backward_default_is_compiled_and_read_back(capsys, tmp_path):
    if find_tool("nvdisasm") is None:
        pytest.skip("no nvdisasm (pip install nvidia-cuda-nvdisasm)")
    assert main(["--backward", "--shape", "128:4096:causal", "--dump", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if line.startswith("| default |"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    # 64x128, head dim 128: five GEMMs a step of 128/16 or 64/16 HGMMAs each, 32 EX2 a thread
    # (the masked and the unmasked exp block), no local memory.
    assert int(cells[4]) > 0 and int(cells[5]) >= 32 and cells[-1] == "0"
    dumped = list(tmp_path.glob("*.sass"))
    assert len(dumped) == 1 and "HGMMA" in dumped[0].read_text()
