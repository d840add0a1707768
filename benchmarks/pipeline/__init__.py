"""The pipeline overhead benchmark, ``python benchmarks/pipeline.py`` (``cli``'s docstring describes the
run). Modules, in import order:

- ``measure``: a point (one arm, front door, workload, stop rule and concurrency), its measured window,
  token arrivals, CPU per process from /proc;
- ``conversation``: the workloads (single-turn, agent loops) and the closed loop of ``c`` clients;
- ``clients``: the HTTP front doors (OA flow, OpenAI streaming) and the measured runs over them;
- ``engine``: the engine alone (the child process's side);
- ``stack``: the processes of an arm (tokentrail server and worker, PostgreSQL + Redis, ``vllm serve``,
  the engine child);
- ``modes``: ``--ceiling`` (synthetic engine), ``--idle-streams``, ``--prompt-build``;
- ``report``: tables, ratios, done-when comparisons, plot;
- ``cli``: the command line.
"""
