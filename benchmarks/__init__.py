"""Benchmark suite for ``datastates`` and its peers.

Run ``python benchmarks/run.py --help``. The suite is split by concern:

- :mod:`benchmarks.common`   -- timing, statistics, file-system helpers (pure helpers, no torch state)
- :mod:`benchmarks.memory`   -- RSS sampling and the memory budget check
- :mod:`benchmarks.limits`   -- physical limits of this machine and disk, measured in the same run
- :mod:`benchmarks.states`   -- the training states that are checkpointed (GPT-style and fragmented)
- :mod:`benchmarks.methods`  -- one small adapter per checkpointing method, behind one interface
- :mod:`benchmarks.phases`   -- the save, load and end-to-end experiments (interleaved rounds)
- :mod:`benchmarks.report`   -- results.json, report.md and the PNG charts
- :mod:`benchmarks.run`      -- the command line
"""
