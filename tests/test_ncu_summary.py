"""benchmarks/ncu_summary.py: Nsight Compute's details page reduced to a few lines a kernel."""

from _scripts import benchmark_script

ncu = benchmark_script("ncu_summary")

HEAD = (
    '"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream","Block Size",'
    '"Grid Size","Device","CC","Section Name","Metric Name","Metric Unit","Metric Value",'
    '"Rule Name","Rule Type","Rule Description","Estimated Speedup Type","Estimated Speedup"'
)


def row(kid, metric="", unit="", value="", rule=""):
    launch = [kid, "1", "python3", "h", "split_kernel", "1", "7", "(128, 1, 1)", "(256, 8, 1)"]
    cells = [*launch, "0", "9.0", "S", metric, unit, value, "R" if rule else "", "", rule, "", ""]
    return ",".join(f'"{c}"' for c in cells)


CSV = "\n".join([
    "==PROF== Connected to process 1",
    "case gqa-int8: launched twice",
    HEAD,
    row("0", "Duration", "us", "1,463.04"),
    row("1", "Duration", "us", "463.04"),
    row("1", "DRAM Throughput", "%", "80.52"),
    row("1", "Registers Per Thread", "register/thread", "77"),
    row("1", rule="On average, each warp of this kernel spends 7.4 cycles being stalled waiting "
        "for a scoreboard dependency on a L1TEX (local, global, surface, texture) operation. "
        "Find the instruction..."),
    row("1", rule="The memory access pattern for global loads from L2 might not be optimal. On "
        "average, only 4.2 of the 32 bytes transmitted per sector are utilized by each thread. "
        "This applies to the 96.8% of sectors missed in L1TEX."),
    row("1", rule="This kernel has uncoalesced global accesses resulting in a total of 4,587,520 "
        "excessive sectors (11% of the total 43,568,560 sectors). Check the L2 ..."),
])  # fmt: skip


def test_each_launch_is_summarised_with_its_rules(tmp_path, capsys):
    path = tmp_path / "ncu.csv"
    path.write_text(CSV)
    assert ncu.main([str(path), "--skip-first"]) == 0
    out = capsys.readouterr().out
    assert "ID 0" not in out and "## split_kernel (256, 8, 1)x(128, 1, 1) (ID 1)" in out
    assert "Duration us 463.04" in out and "DRAM Throughput % 80.52" in out
    assert "stall: 7.4 cycles waiting for a scoreboard dependency on a L1TEX" in out
    assert "global loads from L2: 4.2 of 32 bytes a sector used (96.8 % of sectors missed" in out
    assert "uncoalesced global accesses: 4587520 excessive sectors (11 % of 43568560)" in out
    assert ncu.main([str(path)]) == 0
    assert "Duration us 1,463.04" in capsys.readouterr().out  # (without --skip-first)
    bad = tmp_path / "bad.csv"
    bad.write_text("no report\n")
    assert ncu.main([str(bad)]) == 1
