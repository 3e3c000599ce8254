"""benchmarks/ptx_compare.py: two folders of kernels' PTX compared kernel by kernel."""

from pathlib import Path

from _scripts import benchmark_script

ptx_compare = benchmark_script("ptx_compare")


def _write(folder: Path, file: str, name: str, lines: list[str]) -> None:
    folder.mkdir(exist_ok=True)
    (folder / file).write_text("\n".join([f"// {name}", *lines]) + "\n")


def test_kernels_alike_but_for_line_numbers_and_paths_are_the_same(tmp_path, capsys):
    a, b = tmp_path / "a", tmp_path / "b"
    _write(a, "k1.ptx", "k1 []", ['\t.file 1 "/tmp/a/k.py"', "\t.loc 1 10 5", "add.s32 %r1, 1;"])
    _write(b, "k1.ptx", "k1 []", ['\t.file 1 "/tmp/b/k.py"', "\t.loc 1 12 5", "add.s32 %r1, 1;"])
    assert ptx_compare.main([str(a), str(b)]) == 0
    assert "1 kernels the same, 0 differ, 0 in one folder only" in capsys.readouterr().out


def test_a_changed_instruction_and_a_kernel_one_side_lacks_are_named(tmp_path, capsys):
    a, b = tmp_path / "a", tmp_path / "b"
    _write(a, "k1.ptx", "k1 [('BLOCK', 16)]", ["add.s32 %r1, %r2, 1;", "ret;"])
    _write(b, "k1.ptx", "k1 [('BLOCK', 16)]", ["add.s32 %r1, %r2, 2;", "ret;"])
    _write(a, "k2.ptx", "k2 (integers 1) []", ["ret;"])  # (failed to compile in b)
    assert ptx_compare.main([str(a), str(b)]) == 1
    out = capsys.readouterr().out
    assert "0 kernels the same, 1 differ, 1 in one folder only" in out
    assert "differs (2 lines): k1 [('BLOCK', 16)]" in out
    assert f"only in {a}: k2 (integers 1) []" in out
