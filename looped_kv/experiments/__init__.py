"""The experiments: the command-line runs that measure and print, built on the library (decoding, runtime,
analysis, workloads).

* :mod:`~looped_kv.experiments.bench`: speed-ups of every decoder over paired greedy decoding (``looped-kv bench``);
* :mod:`~looped_kv.experiments.components`: DAS's component diagnostics (Tables 7, 8, 10 and 14): their decoder
  configurations, the Deep K/V over Deep V verdicts, and draft time alone;
* :mod:`~looped_kv.experiments.speed`: decoding speed against the public reference code, every method eager and
  compiled (``looped-kv speed``);
* :mod:`~looped_kv.experiments.pass_cost`: the time of one model pass against its tokens, loops and context, fitted
  and recorded (``looped-kv pass-cost``);
* :mod:`~looped_kv.experiments.throughput`: batched throughput and memory against B (``looped-kv batched``);
* :mod:`~looped_kv.experiments.gpu_check`: cache memory and loop cost on a GPU, random weights;
* :mod:`~looped_kv.experiments.plan_check`: each chapter's measured peak memory against the plan.
"""
