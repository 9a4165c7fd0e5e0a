"""fa-a2a's tools: the benchmarks (bench, bench_call, bench_methods, bench_report, bench_config,
bench_block), the X-Stage model and its calibration (xstage, calibrate), the MPS launcher (mps) and
the command lines' shared parts (cli). The runtime (the public face, fa_a2a.engine, fa_a2a.models)
imports none of them; `python -m fa_a2a.bench | bench_block | calibrate | mps` run them."""
