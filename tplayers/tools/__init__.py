"""The `tplayers` command and what it runs: the demo (train on local CPU ranks, checked against
the unsharded model), the benchmark runner, and the ahead-of-time compile report.

    cli.py             the `tplayers` entry point (demo, bench, plan, compile-report)
    demo.py            the demo's model, data, training loop and report
    bench.py           runs bench/ scripts into one CSV and PNG
    compile_report.py  compiles every kernel for sm_80 / sm_90a and reads the cubins

The top of the stack: may import anything in tplayers; nothing imports it.
"""
