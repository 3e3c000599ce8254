"""benchmarks/sass_stats.py: a kernel's figures from its SASS file, the loop found by the
longest backward branch, and the listing and comparison of two folders."""

from _scripts import benchmark_script

sass_stats = benchmark_script("sass_stats")

HEADER = "// k {'N': 16}\n// REG:200 STACK:8 SHARED:4096\n"
CODE = """
        /*0000*/                   MOV R1, c[0x0][0x28] ;
        /*0010*/                   LDL R2, [R1] ;
.L_x_1:
        /*0020*/                   HGMMA.64x16x16.F32 R4, R8, gdesc[UR4], RZ ;
        /*0030*/                   BAR.SYNC.DEFER_BLOCKING 0x0 ;
        /*0034*/                   PRMT R5, R6, 0x5410, R7 ;
        /*0038*/               @!P3 LOP3.LUT R5, R5, 0x7777, RZ, 0xc0, !PT ;
        /*003c*/                   IMAD.SHL.U32 R6, R5, 0x10, RZ ;
.L_x_2:
        /*0040*/                   LDL R3, [R1+0x8] ;
        /*0050*/               @P0 BRA `(.L_x_2) ;
        /*0060*/                   STL [R1+0x4], R3 ;
        /*0070*/               @P1 BRA `(.L_x_1) ;
        /*0080*/                   @P2 BRA `(.L_x_3) ;
.L_x_3:
        /*0090*/                   EXIT ;
"""


def test_a_kernels_figures_and_its_longest_loop():
    s = sass_stats.stats(HEADER + CODE)
    assert s["name"] == "k {'N': 16}"
    assert (s["reg"], s["stack"], s["shared"]) == (200, 8, 4096)
    assert s["sass"] == 13
    # the loop from .L_x_1 (0x20) to its branch (0x70), not the inner one nor the forward one
    assert (s["loop"], s["loop_bar"], s["loop_ldl"], s["loop_stl"], s["loop_mma"]) == (
        9,
        1,
        1,
        1,
        1,
    )
    # a permute and a (predicated) logic op are ALU-pipe opcodes, IMAD is not
    assert (s["loop_prmt"], s["loop_alu"]) == (1, 2)


def test_no_backward_branch_is_no_loop():
    s = sass_stats.stats(HEADER + "        /*0000*/                   EXIT ;\n")
    assert (s["sass"], s["loop"], s["loop_bar"]) == (1, 0, 0)


def test_folders_listed_and_compared(tmp_path, capsys):
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    (a / "1.sass").write_text(HEADER + CODE)
    (b / "1.sass").write_text(HEADER.replace("STACK:8", "STACK:0") + CODE)
    other = HEADER.replace("// k", "// other")
    (a / "2.sass").write_text(other + CODE)
    (b / "2.sass").write_text(other + CODE)
    assert sass_stats.main([str(a), "--match", "other"]) == 0
    out = capsys.readouterr().out
    assert "other" in out and "k {" not in out
    assert sass_stats.main([str(a), str(b)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "2 kernels in both folders, 1 with other figures"
    assert out[2] == "k {'N': 16}"
    assert out[3].split()[1:4] == ["200", "8", "4096"] and out[4].split()[1:4] == [
        "200",
        "0",
        "4096",
    ]
