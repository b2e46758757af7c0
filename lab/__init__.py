"""The lab: everything that measures, drills or demonstrates the product, in one place.

- ``lab.bench``: the benchmarks (``prefix-cache bench NAME``) and trace replay (``prefix-cache
  replay``), each comparing against its named baseline in the same run;
- ``lab.load``: the load and fault drills (``prefix-cache loadtest``), the user-like workloads
  they and the benchmarks send, hostile inputs and real API clients;
- ``lab.demo``: ``prefix-cache demo``; ``lab.k8s_render``: ``prefix-cache k8s render``;
- ``lab.gpu_check``: the steps of ``scripts/gpu-check.sh`` written in Python.

The lab imports down into the product (``cluster``, ``actors``, ``serve_app``); nothing in the
product imports it (tests/unit/test_code_shape.py checks both).
"""
