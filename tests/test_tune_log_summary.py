"""benchmarks/tune_log_summary.py: a tune log's worker time summed by family."""

from _scripts import benchmark_script

summary = benchmark_script("tune_log_summary")

LOG = """\
tuning 3 studies, 40 trials each at most, sampler local, on 1 GPU(s)
[gpu 0] store_mxfp4_mla-g32-l512-bf16-paged-sm90-gpu @ num_tokens=1: ran 4 trials in 1.9 s \
(0.6 s building inputs, 1.1 s first check, 0.0 s check, 0.2 s timing, 0 kernels compiled, \
4 kernels cached); study best so far 1.00 us {'rows_per_program': 1}
[gpu 0] store_mxfp4_mla-g32-l512-bf16-paged-sm90-gpu @ num_tokens=1: re-timed in 0.6 s, best 1.01 us
[gpu 1] store_mxfp4_mla-g32-l512-fp16-paged-sm90-gpu @ num_tokens=4: ran 12 trials in 2.4 s \
(0.0 s building inputs, 0.3 s first check, 1.5 s check, 0.6 s timing, 5 kernels compiled, \
7 kernels cached); study best so far 1.04 us {'rows_per_program': 2}; stopped: no more gain
[gpu 0] gqa_decode-d128-dv128-bf16-kvint8-g0-rows-sm90-gpu @ rows=4: ran 10 trials in 30.0 s \
(1.0 s building inputs, 2.0 s first check, 20.0 s check, 7.0 s timing, 6 kernels compiled, \
0 kernels cached, 18.5 s compiling); study best so far 258.9 us {'num_stages': 3}
[gpu 0] gqa_decode-d128-dv128-bf16-kvint8-g0-rows-sm90-gpu @ rows=4: 33.5 s in all \
(0.5 s opening the study and its warm start)
[gpu 0] gqa_decode-d128-dv128-bf16-kvint8-g0-rows-sm90-gpu @ rows=4: re-timed in 2.0 s, best \
257.10 us {'num_stages': 2} (trial 259.20); 258.00 us {'num_stages': 3} (trial 258.90)
[gpu 1] store_mxfp4_mla-g32-l512-fp16-paged-sm90-gpu @ num_tokens=4: re-timed in 0.5 s \
(0.0 s first check, 0.1 s check, 0.2 s sizing, 0.2 s timing), best \
1.04 us {'rows_per_program': 2} (trial 1.04); 1.10 us {'rows_per_program': 4} (trial 1.06)
progress: 3/3 studies done in 0.6 min
[gpu 0] store_mxfp4_mla-g32-l512-bf16-paged-sm90-gpu @ num_tokens=1: out of GPU memory in a \
trial of {'rows_per_program': 2} (try 1 of 3); trying again in 10 s
[gpu 0] store_mxfp4_mla-g32-l512-bf16-paged-sm90-gpu @ num_tokens=1: a trial lost, its point \
queued again: out of GPU memory in 3 tries: OutOfMemoryError: CUDA out of memory.
[gpu 0] store_mxfp4_mla-g32-l512-bf16-paged-sm90-gpu @ num_tokens=1: ran 2 trials in 0.5 s \
(0.2 s building inputs, 0.0 s first check, 0.1 s check, 0.2 s timing, 0 kernels compiled, \
2 kernels cached); study best so far 0.90 us {'rows_per_program': 2}
"""


def test_study_and_retiming_lines_are_summed_by_family(tmp_path):
    rows = summary.summarize(LOG.splitlines())
    assert set(rows) == {"store_mxfp4_mla", "gqa_decode"}
    mx = rows["store_mxfp4_mla"]
    assert (mx["studies"], mx["trials"], mx["compiled"], mx["cached"]) == (2, 18, 5, 13)
    assert mx["again"] == 1  # the second pass's line of a study counts once as a study
    assert (mx["oom retries"], mx["lost"]) == (1, 1)
    assert abs(mx["total"] - 4.8) < 1e-9 and abs(mx["check"] - 1.6) < 1e-9
    assert abs(mx["first check"] - 1.4) < 1e-9 and abs(mx["re-timing"] - 1.1) < 1e-9
    # the decode's re-timing chose against its fastest trial, the store's did not (and the
    # older line, with no trial readings, counts as neither)
    assert rows["gqa_decode"]["overruled"] == 1 and mx["overruled"] == 0
    assert rows["gqa_decode"]["check"] == 20.0
    assert rows["gqa_decode"]["compiling"] == 18.5 and mx["compiling"] == 0.0  # (older logs)
    assert rows["gqa_decode"]["in all"] == 33.5 and rows["gqa_decode"]["opening"] == 0.5
    assert mx["in all"] == 0.0  # (older logs)
    # a re-timing line's split: its checks and sizings apart from the graphs' timing
    assert abs(mx["re-t. checks"] - 0.3) < 1e-9 and rows["gqa_decode"]["re-t. checks"] == 0.0
    log = tmp_path / "tune.log"
    log.write_text(LOG)
    assert summary.main([str(log)]) == 0
    empty = tmp_path / "empty.log"
    empty.write_text("nothing\n")
    assert summary.main([str(empty)]) == 1


def test_the_table_ends_with_the_sums(capsys):
    print(summary.table(summary.summarize(LOG.splitlines())))
    last = capsys.readouterr().out.strip().splitlines()[-1].split()
    assert last[:4] == ["all", "3", "1", "28"]  # studies, again, trials
