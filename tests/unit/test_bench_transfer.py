"""The UCX protocol report parser of bench transfer (no Ray: the module imports it lazily)."""

from lab.bench.transfer import parse_read_transports

REPORT = """\
[1.0] [vm:1 :0]   +--------+-------------+-----------------------------------+
[1.0] [vm:1 :0]   | a self cfg#0                                             |
[1.0] [vm:1 :0]   | remote memory write by ucp_put* from host memory to host |
[1.0] [vm:1 :0]   +--------+-------------+-----------------------------------+
[1.0] [vm:1 :0]   | Range  | Description |              Config               |
[1.0] [vm:1 :0]   +--------+-------------+-----------------------------------+
[1.0] [vm:1 :0]   | 0..inf | zero-copy   | posix/memory                      |
[1.0] [vm:1 :0]   +--------+-------------+-----------------------------------+
[2.0] [vm:1 :0]   +--------+-------------+-------------------------------------------+
[2.0] [vm:1 :0]   | a intra-node cfg#1                                                 |
[2.0] [vm:1 :0]   | remote memory read by ucp_get*(multi) into host memory from host |
[2.0] [vm:1 :0]   +--------+-------------+-------------------------------------------+
[2.0] [vm:1 :0]   | Range  | Description |                  Config                   |
[2.0] [vm:1 :0]   +--------+-------------+-------------------------------------------+
[2.0] [vm:1 :0]   | 0..8k  | copy        | tcp/lo                                    |
[2.0] [vm:1 :0]   | 8k..inf| zero-copy   | cma/memory                                |
[2.0] [vm:1 :0]   +--------+-------------+-------------------------------------------+
[3.0] [vm:1 :0]   | 0..inf | short       | tcp/lo, rc/mlx5_0:1                       |
"""


def test_parse_read_transports_takes_only_the_read_tables_config_cells():
    assert parse_read_transports(REPORT) == ["tcp/lo", "cma/memory"]


def test_parse_read_transports_of_an_empty_report_is_empty():
    assert parse_read_transports("") == []
